"""Training data generation: the target answers prompt batches; ids go to the repository.

One process, all threads: prompts are sorted by token length and answered in large batches by a
plain decode loop over a :class:`transformers.DynamicCache` (left padding, explicit position
ids); rows that finish leave the batch (``batch_select_indices``), so short answers stop costing
compute. The loop takes what training needs as it goes: the taps of every fed position and the
target's top-k distribution of every response token, written to the local feature cache
(:mod:`dflash.train.featcache`); the ids go to a :class:`~dflash.train.tokdata.TokenStore`.

The target runs in float32: the dtype the verifier serves on a CPU (``--dtype`` default), so
the answers are the served target's greedy answers (bf16 was no faster on a CPU without bf16
instructions: docs/training.md).

Sources (``--mix``): ``code`` (stubs of real functions, :mod:`dflash.train.code_prompts`),
``template`` (synthetic HumanEval-shaped tasks, :mod:`dflash.train.prompts`), ``passage``
(everyday instructions over prose paragraphs, :mod:`dflash.train.chat_prompts`), ``magpie``
(user turns the target writes itself, sampled from the chat template's user header).
Shard ``shard_<source>_s<seed>_<batch>.npz`` is batch ``<batch>`` of that source's length-sorted
prompt list, so a resumed or second run skips what the manifest already lists.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from dflash.core.taps import hidden_state_indices, tap_features
from dflash.train import chat_prompts, featcache
from dflash.train.tokdata import TokenStore

SOURCES = ("code", "template", "passage", "magpie", "chat2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Answer:
    response: list[int]              # generated ids (ends with a stop id unless cut at the cap)
    taps: torch.Tensor | None        # bfloat16 [n_prompt + n_response, kH]; last row zeros
    topk_ids: torch.Tensor | None    # int32 [n_response, K]
    topk_logp: torch.Tensor | None   # float16 [n_response, K]


@torch.no_grad()
def decode_batch(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: set[int],
                 pad_id: int, layer_ids=None, topk: int = 0, temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> list[Answer]:
    """Answer a batch of tokenised prompts; greedy when ``temperature`` is 0.

    With ``layer_ids`` the taps of every position that went through the target are returned
    (the final token never does: its row is zeros); with ``topk`` > 0 the top-k log-probabilities
    of the distribution each response token was chosen from. Sampling uses ``generator``
    (temperature, then nucleus ``top_p``), which must live on ``model.device``
    (:func:`generator_for`).

    Runs on ``model.device``: the padded batch is built on the host and copied once; each step
    reads the chosen ids back with one ``.tolist()`` and, when asked for, the step's taps and
    top-k rows with one copy each. Every returned tensor is on the host.
    """
    dev = model.device
    b, width = len(prompts), max(map(len, prompts))
    ids = torch.full((b, width), pad_id, dtype=torch.int64, device="cpu")
    attn = torch.zeros(b, width, dtype=torch.int64, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.int64, device="cpu")
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    hs = hidden_state_indices(layer_ids) if layer_ids else None
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                use_cache=True, output_hidden_states=hs, logits_to_keep=1)
    taps: list[list[torch.Tensor]] = [[] for _ in range(b)]
    if hs:
        f = tap_features(out.hidden_states, layer_ids).to(torch.bfloat16).cpu()
        for i, p in enumerate(prompts):
            taps[i].append(f[i, width - len(p):])
    resp: list[list[int]] = [[] for _ in range(b)]
    tk_i: list[list[torch.Tensor]] = [[] for _ in range(b)]
    tk_v: list[list[torch.Tensor]] = [[] for _ in range(b)]
    active = list(range(b))                      # batch row r holds sequence active[r]
    last = pos[:, -1]
    while active:
        logits = out.logits[:, -1].float()
        if temperature > 0:
            nxt = _sample(logits, temperature, top_p, generator)
        else:
            nxt = logits.argmax(-1)
        if topk:
            ti, tv = (t.cpu() for t in featcache.topk_rows(logits, topk))
        chosen = nxt.tolist()                    # the step's one read-back of the ids
        keep = []
        for r, s in enumerate(active):
            t = chosen[r]
            resp[s].append(t)
            if topk:
                tk_i[s].append(ti[r])
                tk_v[s].append(tv[r])
            if t not in stop_ids and len(resp[s]) < max_new_tokens:
                keep.append(r)
        if len(keep) < len(active):
            if not keep:
                break
            sel = torch.tensor(keep, dtype=torch.int64, device=dev)
            cache.batch_select_indices(sel)
            attn, last, nxt = attn[sel], last[sel], nxt[sel]
        active = [active[r] for r in keep]
        attn = torch.cat([attn, attn.new_ones(len(active), 1)], 1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last[:, None],
                    past_key_values=cache, use_cache=True, output_hidden_states=hs)
        if hs:
            f = tap_features(out.hidden_states, layer_ids)[:, 0].to(torch.bfloat16).cpu()
            for r, s in enumerate(active):
                taps[s].append(f[r:r + 1])
    answers = []
    for s in range(b):
        t = None
        if hs:
            t = torch.cat(taps[s])
            t = torch.cat([t, t.new_zeros(1, t.shape[1])])
        answers.append(Answer(resp[s], t, torch.stack(tk_i[s]) if topk else None,
                              torch.stack(tk_v[s]) if topk else None))
    return answers


def generator_for(model, seed: int) -> torch.Generator:
    """A seeded generator on ``model.device`` (sampling draws on the logits' device). On a CPU
    the draws are those of ``torch.Generator().manual_seed(seed)``; a GPU's stream differs."""
    return torch.Generator(device=model.device).manual_seed(seed)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        cut = sp.cumsum(-1) - sp > top_p           # drop tokens once the mass before them > top_p
        sp[cut] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def user_header(tok) -> list[int]:
    """Ids of the chat template up to where a user's message starts (Magpie's pre-query)."""
    mark = "\u2063MAGPIE\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return tok(text[:text.index(mark)], add_special_tokens=False)["input_ids"]


def magpie_instructions(model, tok, n: int, *, seed: int, max_tokens: int = 80,
                        temperature: float = 1.0, top_p: float = 0.95, seen: set[str] | None = None) -> list[str]:
    """Up to ``n`` distinct user turns the target writes after the user header (one sampled
    batch; :func:`chat_prompts.clean_instruction` filters them, ``seen`` deduplicates)."""
    head = user_header(tok)
    gen = generator_for(model, seed)
    ans = decode_batch(model, [head] * n, max_new_tokens=max_tokens, stop_ids={tok.eos_token_id},
                       pad_id=tok.pad_token_id, temperature=temperature, top_p=top_p, generator=gen)
    texts = [tok.decode(a.response, skip_special_tokens=True) for a in ans
             if a.response and a.response[-1] == tok.eos_token_id]     # cut-off turns dropped
    return chat_prompts.dedupe([t for t in map(chat_prompts.clean_instruction, texts) if t], seen)


def source_prompts(source: str, n: int, seed: int) -> list[str]:
    """The first ``n`` user messages of a deterministic source (``code``, ``template``,
    ``passage``) in its seeded order; prefix-stable, so batch k is the same whatever ``n``.
    Raises ``ValueError`` for another source or a source with fewer than ``n`` prompts."""
    if source == "code":
        import random

        from dflash.train.code_prompts import function_stubs
        from dflash.train.eval_sets import INSTRUCTION

        pool = function_stubs()
        if len(pool) < n:
            raise ValueError(f"num_prompts: only {len(pool)} function stubs available, asked for {n}")
        return [INSTRUCTION.format(prompt=p) for p in random.Random(seed).sample(pool, len(pool))[:n]]
    if source == "template":
        from dflash.train.eval_sets import INSTRUCTION
        from dflash.train.prompts import make_prompts

        return [INSTRUCTION.format(prompt=p) for p in make_prompts(n, seed=seed)]
    if source == "passage":
        return chat_prompts.passage_prompts(n, seed=seed)
    raise ValueError(f"source: {source!r} is not one of {SOURCES}")


def source_size(source: str) -> int:
    """How many prompts a deterministic source can give (templates: unbounded in practice)."""
    if source == "code":
        from dflash.train.code_prompts import function_stubs

        return len(function_stubs())
    if source == "passage":
        return len([p for p in chat_prompts.passages() if not chat_prompts.is_eval_prompt(p)])
    return 1 << 30


def length_sorted_batches(prompts: list[list[int]], batch_size: int, window: int = 8) -> list[list[list[int]]]:
    """Batches of ``batch_size`` with prompts sorted by length inside windows of ``window``
    batches (less padding), so batch k depends only on the prompts of its own window."""
    out = []
    span = batch_size * window
    for w in range(0, len(prompts), span):
        part = sorted(prompts[w:w + span], key=len)
        out += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return out


def encode_user(tok, text: str) -> list[int]:
    from dflash.train.eval_sets import encode_messages

    return encode_messages(tok, [{"role": "user", "content": text}])


@dataclass(frozen=True, kw_only=True)
class GenConfig:
    data_dir: str                      # token store (committed)
    cache_dir: str                     # feature cache (local)
    target_dir: str
    layer_ids: tuple[int, ...]
    mix: dict[str, int]                # source -> number of batches to have
    batch_size: int = 128
    max_new_tokens: int = 128
    topk: int = 16
    seed: int = 0
    budget_min: float | None = None    # stop after the batch that crosses it
    dtype: str = "float32"             # the target's dtype while answering (see generate)
    device: str = "cpu"                # where the target answers ("cuda" on a GPU)


def generate(cfg: GenConfig) -> dict:
    """Fill the store up to ``cfg.mix`` batches per source, round-robin over sources so any
    stopping point leaves a mix; skips batches the manifest lists. Returns totals.

    ``cfg.dtype`` "float32" answers as the verifier serves on a CPU and writes the feature
    cache as it goes; "bfloat16" answers 2-3x faster where the CPU has bf16 matrix units (AMX)
    and writes ids only: its taps are not the served target's, so the trainer recomputes the
    features in float32 from the ids. Each shard records the dtype it was answered in."""
    from dflash.core.checkpoint import load_target_head, target_fingerprint
    from dflash.train.data import load_target

    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: {cfg.dtype!r} is not one of {sorted(DTYPES)}")
    model, tok = load_target(cfg.target_dir, DTYPES[cfg.dtype], cfg.device)
    served = cfg.dtype == "float32"
    tcfg = json.loads((Path(cfg.target_dir) / "config.json").read_text())
    fp = target_fingerprint(tcfg, load_target_head(cfg.target_dir).embed)
    store = TokenStore(cfg.data_dir, fingerprint=fp)
    store.manifest["generation"] = {"greedy": True, "max_new_tokens": cfg.max_new_tokens,
                                    "batch_size": cfg.batch_size, "topk": cfg.topk,
                                    "stop": "eos", "chat_template": "target tokenizer's"}
    bs, seed = cfg.batch_size, cfg.seed
    lists: dict[str, list[list[list[int]]]] = {}
    window = 8
    for src, nb in cfg.mix.items():
        if src not in ("magpie", "chat2") and nb:
            want = -(-nb // window) * window * bs          # whole windows (prefix-stable source)
            texts = source_prompts(src, min(want, source_size(src)), seed)
            lists[src] = length_sorted_batches([encode_user(tok, t) for t in texts], bs, window)
    seen: set[str] = set()
    for e in store.shards({"magpie"}):        # magpie batches deduplicate against earlier ones
        for s in store.read(e):
            seen.add(chat_prompts._norm(_user_text(tok, s.ids[:len(s.ids) - s.response_tokens])))
    todo = [(src, k) for k in range(max(cfg.mix.values(), default=0)) for src in cfg.mix
            if k < cfg.mix[src] and _name(src, seed, k) not in store.names()]
    t0, n_resp, n_prompt_tok = time.time(), 0, 0
    print(f"[datagen] {len(todo)} batches of {bs} to answer ({store.manifest.get('totals', {})} in the store)",
          flush=True)
    for done, (src, k) in enumerate(todo, 1):
        if src == "magpie":
            texts = magpie_instructions(model, tok, bs, seed=seed * 100003 + k, seen=seen)
            batch = sorted((encode_user(tok, t) for t in texts), key=len)
        elif src == "chat2":
            batch = second_turns(model, tok, store, seed=seed, k=k)
            if not batch:
                print(f"[datagen] {_name(src, seed, k)}: no {_name('magpie', seed, k)} to continue", flush=True)
                continue
        else:
            if k >= len(lists[src]):
                continue
            batch = lists[src][k]
        if not batch:           # every sampled Magpie turn filtered out (a random test target)
            print(f"[datagen] {_name(src, seed, k)}: no usable prompt", flush=True)
            continue
        answers = decode_batch(model, batch, max_new_tokens=cfg.max_new_tokens, stop_ids={tok.eos_token_id},
                               pad_id=tok.pad_token_id, layer_ids=cfg.layer_ids if served else None,
                               topk=cfg.topk if served else 0)
        seqs = [featcache.as_numpy_seq(p + a.response, len(p)) for p, a in zip(batch, answers)]
        name = _name(src, seed, k)
        # a shard answered on a GPU says so (its greedy ids are that device's); a CPU shard's
        # entry is unchanged
        where = {} if model.device.type == "cpu" else {"device": model.device.type}
        entry = store.add(name, seqs, source=src, vocab_size=tcfg["vocab_size"], seed=seed, batch=k,
                          dtype=cfg.dtype, **where)
        if served:
            feats = [_cache_rows(p, a, cfg.topk) for p, a in zip(batch, answers)]
            featcache.write_entry(featcache.cache_path(cfg.cache_dir, fp, name), feats, sha256=entry["sha256"],
                                  layer_ids=cfg.layer_ids, k=cfg.topk)
        n_resp += entry["response_tokens"]
        n_prompt_tok += entry["tokens"] - entry["response_tokens"]
        dt = time.time() - t0
        eta = dt / done * (len(todo) - done)
        print(f"[datagen] {done}/{len(todo)} {name}: {entry['sequences']} answers, "
              f"{entry['response_tokens']} response tokens; {n_resp / dt:.1f} response tok/s "
              f"({(n_resp + n_prompt_tok) / dt:.1f} incl. prompts), ETA {eta / 60:.1f} min", flush=True)
        if cfg.budget_min and dt > cfg.budget_min * 60:
            print(f"[datagen] time budget reached after {done} batches", flush=True)
            break
    return store.manifest.get("totals", {})


def second_turns(model, tok, store: TokenStore, *, seed: int, k: int, max_user_tokens: int = 80
                 ) -> list[list[int]]:
    """Prompts of ``chat2`` batch ``k``: the conversations of ``shard_magpie_s<seed>_<k>`` (an
    answer cut at the token cap ends its turn there), each with a second user turn (:mod:`dflash.train.multiturn`: half
    copying follow-ups, half written by the target), sorted by length. ``[]`` when that magpie
    shard is not in the store."""
    from dflash.train import multiturn

    entry = next((e for e in store.shards({"magpie"}) if e["name"] == _name("magpie", seed, k)), None)
    if entry is None:
        return []
    user_head, asst_head, _ = multiturn.turn_separators(tok)
    eos = tok.eos_token_id
    # most first answers hit the token cap (about 4 in 5 at 128): they end their turn there
    firsts = [[int(t) for t in s.ids] + ([] if int(s.ids[-1]) == eos else [eos]) for s in store.read(entry)]
    plan = multiturn.follow_up_plan(len(firsts), seed * 100003 + k)
    own = [i for i, f in enumerate(plan) if f is None]
    if own:
        gen = generator_for(model, seed * 100003 + k + 1)
        sampled = decode_batch(model, [firsts[i] + user_head for i in own], max_new_tokens=max_user_tokens,
                               stop_ids={eos}, pad_id=tok.pad_token_id, temperature=1.0, top_p=0.95,
                               generator=gen)
        fallback = multiturn.follow_up_plan(len(own), seed * 100003 + k + 2)
        for j, (i, a) in enumerate(zip(own, sampled)):
            text = (tok.decode(a.response, skip_special_tokens=True)
                    if a.response and a.response[-1] == eos else "")
            plan[i] = chat_prompts.clean_instruction(text) or fallback[j] or multiturn.FOLLOW_UPS[0]
    prompts = [multiturn.second_turn_prompt(f, tok(u, add_special_tokens=False)["input_ids"],
                                            user_head, asst_head) for f, u in zip(firsts, plan)]
    return sorted(prompts, key=len)


def _name(src: str, seed: int, k: int) -> str:
    return f"shard_{src}_s{seed}_{k:04d}.npz"


def _user_text(tok, prompt_ids) -> str:
    """The user message of a chat-formatted prompt (roles are plain words in ChatML)."""
    text = tok.decode(prompt_ids, skip_special_tokens=True)
    return text.rsplit("user\n", 1)[-1].rsplit("assistant", 1)[0].strip()


def _cache_rows(prompt: list[int], a: Answer, k: int) -> dict[str, torch.Tensor]:
    """Feature-cache rows of one sequence: top-k rows for response tokens, zeros for the prompt."""
    n = len(prompt) + len(a.response)
    tid = torch.zeros(n, k, dtype=torch.int32, device="cpu")
    tlp = torch.zeros(n, k, dtype=torch.float16, device="cpu")
    tid[len(prompt):], tlp[len(prompt):] = a.topk_ids, a.topk_logp
    return {"taps": a.taps, "topk_ids": tid, "topk_logp": tlp}
