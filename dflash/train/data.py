"""Training data: the target answers synthetic prompts; we store its taps for the drafter.

For each batch of prompts (chat-formatted with :func:`dflash.humaneval.format_prompt`) the target
answers greedily (batched ``generate``, left padding); the tapped hidden states are read from the
same ``generate`` call (prefill + decode steps), which halves the cost compared with a second
forward over prompt + response (measured: 108 s generate + 56 s extra forward per 32 prompts).

Shard layout (safetensors, ``<out>/shard_00000.safetensors``), T = total tokens of the shard:
  ``input_ids`` int64 [T]; ``loss_mask`` uint8 [T] (1 on response tokens, including the final
  ``<|im_end|>``); ``offsets`` int64 [S+1] (sequence s is ``[offsets[s], offsets[s+1])``);
  ``taps`` bfloat16 [T, len(target_layer_ids) * H].
``<out>/meta.json`` records target dir, layer ids, counts and throughput.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.humaneval import encode_prompt
from dflash.taps import hidden_state_indices, tap_features


@dataclass(frozen=True, kw_only=True)
class GenConfig:
    target_dir: str
    out_dir: str
    target_layer_ids: tuple[int, ...]
    num_prompts: int = 2000
    batch_size: int = 32
    max_new_tokens: int = 224
    seed: int = 0
    time_budget_min: float | None = None   # stop after the batch that crosses it
    reverse: bool = False                  # walk batches last-to-first (a second writer process)
    start_batch: int = 0                   # first batch index this writer handles


@dataclass
class Sequence:
    input_ids: list[int]      # [n] prompt + response
    loss_mask: list[int]      # [n] 1 on response tokens


def load_target(target_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return model, tok


@torch.no_grad()
def answer_batch(model, tok, prompts: list[str], max_new_tokens: int,
                 layer_ids: tuple[int, ...]) -> tuple[list[Sequence], list[torch.Tensor]]:
    """Greedy target answers for a batch of prompts, with their taps, in one ``generate``.

    Left-padded batched generate; the taps come from the hidden states generate already
    computes (prefill + one per decode step), so there is no second forward. The last token of
    each sequence has never been run through the target: its tap row is zeros (training never
    reads it: a block at anchor p sees context positions < p only).
    Returns per sequence a :class:`Sequence` and its taps ``[n, len(ids)*H]`` (bfloat16).
    """
    enc = [encode_prompt(tok, p) for p in prompts]
    pad = tok.pad_token_id
    width = max(map(len, enc))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id,
                         output_hidden_states=True, return_dict_in_generate=True)
    hs_idx = hidden_state_indices(layer_ids)
    steps = [torch.cat([step[j] for j in hs_idx], dim=-1) for step in out.hidden_states]
    feats = torch.cat(steps, dim=1)                       # [b, width + steps - 1, k*H]
    seqs, taps = [], []
    for i, (e, row) in enumerate(zip(enc, out.sequences[:, width:].tolist())):
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id) + 1]
        n = len(e) + len(row)
        f = feats[i, width - len(e): width - len(e) + n - 1]
        taps.append(torch.cat([f, f.new_zeros(1, f.shape[1])]).to(torch.bfloat16))
        seqs.append(Sequence(input_ids=e + row, loss_mask=[0] * len(e) + [1] * len(row)))
    return seqs, taps


@torch.no_grad()
def batch_taps(model, seqs: list[Sequence], layer_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """Tap features ``[n_i, len(ids)*H]`` (bfloat16) per sequence, one right-padded forward.

    Reference path (and for data not produced by :func:`answer_batch`)."""
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.tensor([s.input_ids + [0] * (width - len(s.input_ids)) for s in seqs])
    attn = torch.tensor([[1] * len(s.input_ids) + [0] * (width - len(s.input_ids)) for s in seqs])
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=hidden_state_indices(layer_ids),
                logits_to_keep=1)
    feats = tap_features(out.hidden_states, layer_ids)           # [b, width, k*H]
    return [feats[i, :len(s.input_ids)].to(torch.bfloat16) for i, s in enumerate(seqs)]


def write_shard(path: Path, seqs: list[Sequence], taps: list[torch.Tensor]) -> None:
    """Write one shard atomically (readers never see a partial file)."""
    lens = torch.tensor([0] + [len(s.input_ids) for s in seqs])
    tmp = path.with_name(path.name + ".tmp")
    save_file({
        "input_ids": torch.tensor([t for s in seqs for t in s.input_ids], dtype=torch.int64),
        "loss_mask": torch.tensor([m for s in seqs for m in s.loss_mask], dtype=torch.uint8),
        "offsets": torch.cumsum(lens, 0).to(torch.int64),
        "taps": torch.cat(taps).contiguous(),
    }, str(tmp))
    tmp.replace(path)


def shard_paths(data_dir: str | Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard_*.safetensors"))


def read_shards(data_dir: str | Path, paths: list[Path] | None = None) -> list[dict[str, torch.Tensor]]:
    """Per-sequence dicts ``{input_ids [n], loss_mask [n], taps [n, k*H]}`` from the shards."""
    seqs = []
    for p in (shard_paths(data_dir) if paths is None else paths):
        d = load_file(str(p))
        off = d["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            seqs.append({"input_ids": d["input_ids"][a:b], "loss_mask": d["loss_mask"][a:b],
                         "taps": d["taps"][a:b]})
    return seqs


def generate_dataset(cfg: GenConfig, prompts: list[str]) -> dict:
    """Answer ``prompts`` in batches and write shards; resumes after existing shards."""
    from tqdm import tqdm

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(cfg.target_dir)
    batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    t0 = time.time()
    n_resp_tokens = n_seqs = 0
    bar = tqdm(total=len(prompts), desc="datagen", unit="prompt")
    order = list(enumerate(batches))[cfg.start_batch:]
    for bi, batch in (order[::-1] if cfg.reverse else order):
        shard = out / f"shard_{bi:05d}.safetensors"
        bar.update(len(batch))
        if shard.exists():
            continue
        seqs, taps = answer_batch(model, tok, batch, cfg.max_new_tokens, cfg.target_layer_ids)
        write_shard(shard, seqs, taps)
        n_seqs += len(seqs)
        n_resp_tokens += sum(sum(s.loss_mask) for s in seqs)
        dt = time.time() - t0
        bar.set_postfix(resp_tok_s=f"{n_resp_tokens / dt:.0f}", prompts_s=f"{n_seqs / dt:.2f}")
        if cfg.time_budget_min and dt > cfg.time_budget_min * 60:
            print(f"[datagen] time budget reached after {bi + 1} batches", flush=True)
            break
    bar.close()
    dt = time.time() - t0
    meta = {"target_dir": cfg.target_dir, "target_layer_ids": list(cfg.target_layer_ids),
            "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "new_sequences": n_seqs, "new_response_tokens": n_resp_tokens, "seconds": round(dt, 1),
            "response_tokens_per_s": round(n_resp_tokens / max(dt, 1e-9), 1)}
    name = "meta.json" if not (cfg.reverse or cfg.start_batch) else f"meta_{cfg.start_batch}{'r' if cfg.reverse else ''}.json"
    (out / name).write_text(json.dumps(meta, indent=2) + "\n")
    print(f"[datagen] {meta}", flush=True)
    return meta
