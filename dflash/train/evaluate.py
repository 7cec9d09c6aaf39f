"""Held-out acceptance length tau with a minimal in-process greedy DFlash loop (dflash.md 1.7).

Greedy only: drafts are argmax of the drafter, the target verifies a block in one forward and
the accepted length is the longest prefix where draft k equals the target's argmax after k-1.
tau = mean over rounds of (accepted drafts + 1): it includes the bonus token (max = B).
The emitted tokens equal plain greedy decoding (checked by ``--check-lossless``).

Usage: ``python -m dflash.train.evaluate --drafter models/smollm2-dflash-b16 [--ckpt runs/train]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from dflash.core.checkpoint import build_drafter
from dflash.core.dflash2 import DFlash2Drafter, selector_rows
from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.core.taps import hidden_state_indices, tap_features
from dflash.train.eval_sets import CHAT_EVAL, encode_messages, encode_prompt, load_problems


@dataclass
class GenResult:
    tokens: list[int]                                         # generated ids (after the prompt)
    accept_lengths: list[int] = field(default_factory=list)   # per round, includes the bonus

    @property
    def tau(self) -> float:
        return statistics.fmean(self.accept_lengths) if self.accept_lengths else 0.0


@torch.no_grad()
def dflash_greedy(target, drafter: DFlashDrafter, head: TargetHead, prompt_ids: list[int],
                  max_new_tokens: int, stop_ids: set[int]) -> GenResult:
    """Greedy speculative decoding of one prompt with a DFlash drafter (a DFlash2 one drafts
    its selector's best path).

    ``target``, ``drafter`` and ``head`` share one device (``target.device``); every tensor of
    the loop is made there, and each round reads back the accepted length and the tokens."""
    B = drafter.cfg.block_size
    dev = target.device
    ids_layers = drafter.cfg.target_layer_ids
    hs = hidden_state_indices(ids_layers)
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], dtype=torch.int64, device=dev)
    out = target(input_ids=ids, past_key_values=cache, output_hidden_states=hs, use_cache=True)
    bonus = int(out.logits[0, -1].argmax())
    feats = tap_features(out.hidden_states, ids_layers)                    # [1, n, kH]
    ctx_kv = drafter.context_kv(feats.float(), torch.arange(len(prompt_ids), device=dev)[None])
    start = len(prompt_ids)                                               # position of bonus
    res = GenResult(tokens=[bonus])
    mask_id = drafter.cfg.mask_token_id
    while len(res.tokens) < max_new_tokens and bonus not in stop_ids:
        block = torch.tensor([[bonus] + [mask_id] * (B - 1)], dtype=torch.int64, device=dev)
        pos = torch.arange(start, start + B, device=dev)[None]
        h = drafter(head.embed_tokens(block), pos, ctx_kv)
        logits = head.logits(h[0, 1:])
        if isinstance(drafter, DFlash2Drafter):                           # the selector's path
            logits = selector_rows(drafter.candidate_selector, logits, h[0, 1:], bonus, None)
        draft = logits.argmax(-1)                                         # [B-1]
        block[0, 1:] = draft
        out = target(input_ids=block, past_key_values=cache, output_hidden_states=hs, use_cache=True)
        post = out.logits[0].argmax(-1)                                  # [B]
        acc = int(torch.cumprod((draft == post[:-1]).int(), 0).sum())
        committed = block[0, 1:acc + 1].tolist() + [int(post[acc])]
        cache.crop(-(B - acc - 1))
        new_feats = tap_features(out.hidden_states, ids_layers)[:, :acc + 1]
        new_kv = drafter.context_kv(new_feats.float(), torch.arange(start, start + acc + 1, device=dev)[None])
        ctx_kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(ctx_kv, new_kv)]
        res.accept_lengths.append(acc + 1)
        for t in committed:
            res.tokens.append(t)
            if t in stop_ids or len(res.tokens) >= max_new_tokens:
                break
        start += acc + 1
        bonus = res.tokens[-1]
    return res


def heldout_prompts(n: int, train_prompts: int = 4000) -> list[str]:
    """Synthetic prompts not in the training set (different seed, training prompts removed)."""
    from dflash.train.prompts import make_prompts

    train = set(make_prompts(train_prompts, seed=0))
    return [p for p in make_prompts(n * 3, seed=1234) if p not in train][:n]


def humaneval_prompts(n: int) -> list[str]:
    probs = load_problems()
    step = max(1, len(probs) // n)
    return [p for _, p in probs[::step][:n]]


def chat_prompts(n: int) -> list[list[dict]]:
    """The first ``n`` prompts of the held-out chat set (:data:`dflash.train.eval_sets.CHAT_EVAL`)."""
    return [[{"role": "user", "content": p}] for p in CHAT_EVAL[:n]]


def drafter_from_ckpt(run_dir: str, target_dir: str) -> DFlashDrafter:
    """Drafter weights (float32, on the host) from a trainer run directory's checkpoint
    (``ckpt.safetensors`` + ``ckpt.json``, :mod:`dflash.recipe.ckpt`). Raises
    ``FileNotFoundError`` when there is none."""
    from dflash.core.checkpoint import load_target_head
    from dflash.recipe import ckpt
    from dflash.train.trainer import TrainConfig, drafter_config

    got = ckpt.load(Path(run_dir))
    if got is None:
        raise FileNotFoundError(f"--ckpt: no trainer checkpoint in {run_dir}")
    meta, weights = got[0], got[1]
    tcfg = TrainConfig(**meta["config"])
    tconf = json.loads((Path(target_dir) / "config.json").read_text())
    d = build_drafter(drafter_config(tcfg, tconf, load_target_head(target_dir)))
    d.load_state_dict(weights)
    return d.eval()


def evaluate(target, tok, drafter, head, prompts: list, max_new_tokens: int,
             check_lossless: bool = False) -> dict:
    from tqdm import tqdm

    stop = {tok.eos_token_id}
    taus, per_prompt, n_tok, t0 = [], [], 0, time.time()
    for p in tqdm(prompts, desc="eval", unit="prompt"):
        ids = encode_prompt(tok, p) if isinstance(p, str) else encode_messages(tok, p)
        r = dflash_greedy(target, drafter, head, ids, max_new_tokens, stop)
        if check_lossless:
            dev = target.device
            ref = target.generate(torch.tensor([ids], device=dev), max_new_tokens=max_new_tokens,
                                  do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev))
            ref = ref[0, len(ids):].tolist()
            assert r.tokens == ref[:len(r.tokens)], "DFlash output differs from greedy"
        taus += r.accept_lengths
        per_prompt.append(round(r.tau, 3))
        n_tok += len(r.tokens)
    return {"tau": round(statistics.fmean(taus), 3) if taus else 0.0, "rounds": len(taus),
            "tokens": n_tok, "per_prompt_tau": per_prompt, "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    from dflash.core.checkpoint import load_drafter, load_target_head
    from dflash.core.device import device_flag, resolve_device
    from dflash.train.data import load_target
    from dflash.train.target_setup import target_dir as default_target_dir

    ap = argparse.ArgumentParser(description="held-out tau of a DFlash drafter")
    ap.add_argument("--drafter", default=None, help="drafter directory (z-lab format)")
    ap.add_argument("--ckpt", default=None, help="or a trainer run directory (its checkpoint)")
    ap.add_argument("--target-dir", default=None)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--which", default="heldout,humaneval",
                    help="comma-separated: heldout (synthetic templates), humaneval, chat")
    ap.add_argument("--check-lossless", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", type=device_flag, default="cpu",
                    help="where the target and the drafter run (cpu, cuda, cuda:N; float32 on both)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    sets = args.which.split(",")
    bad = [w for w in sets if w not in ("heldout", "humaneval", "chat")]
    if bad:
        ap.error(f"--which: unknown set {bad[0]!r} (heldout, humaneval, chat)")
    if not (args.drafter or args.ckpt):
        ap.error("--drafter or --ckpt: give the drafter to evaluate")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    tdir = args.target_dir or str(default_target_dir())
    target, tok = load_target(tdir, device=device)
    head = load_target_head(tdir).to(device)
    drafter = (drafter_from_ckpt(args.ckpt, tdir) if args.ckpt
               else load_drafter(args.drafter, dtype=torch.float32)).to(device)
    results = {}
    for which in sets:
        prompts = {"heldout": heldout_prompts, "humaneval": humaneval_prompts,
                   "chat": chat_prompts}[which](args.n)
        results[which] = evaluate(target, tok, drafter, head, prompts, args.max_new_tokens,
                                  args.check_lossless)
        print(f"[eval] {which}: {results[which]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
