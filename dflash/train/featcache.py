"""Local cache of what training needs from the target, recomputed from the committed token ids.

Per token shard ``<cache>/<fingerprint>/<shard stem>.safetensors`` holds, for the shard's T
tokens (rows in shard order):
  ``taps``       bfloat16 [T, len(target_layer_ids) * H]  tapped hidden states at each position
  ``topk_ids``   int32 [T, K]    the target's K most likely ids for the token at this row
  ``topk_logp``  float16 [T, K]  their log-probabilities (full-vocabulary log-softmax)
The last row's taps are zeros (generation never runs the last token; a block at anchor p
reads context rows < p only). Row t's top-k is the distribution the target predicted token t from (logits at t - 1); rows of
prompt tokens are zeros. Metadata records the shard's sha256, the layer ids and K, so a cache
entry for other ids, another K or an edited shard is rebuilt, never reused.

Generation writes the entry as it answers (the taps and distributions it computes anyway); a new
machine rebuilds it with one batched forward per group of sequences (:func:`compute_features`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.core.taps import hidden_state_indices, tap_features
from dflash.train.tokdata import TokenSeq


def cache_path(cache_dir: str | Path, fingerprint: str, shard_name: str) -> Path:
    return Path(cache_dir) / fingerprint.replace("sha256:", "") / (Path(shard_name).stem + ".safetensors")


def _meta(sha256: str, layer_ids, k: int) -> dict[str, str]:
    return {"shard_sha256": sha256, "target_layer_ids": json.dumps(list(layer_ids)), "topk": str(k)}


def write_entry(path: Path, feats: list[dict[str, torch.Tensor]], *, sha256: str, layer_ids, k: int) -> None:
    """Write one cache entry atomically from per-sequence ``{taps, topk_ids, topk_logp}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({name: torch.cat([f[name] for f in feats]).contiguous()
               for name in ("taps", "topk_ids", "topk_logp")}, str(tmp), metadata=_meta(sha256, layer_ids, k))
    tmp.replace(path)


def valid_entry(path: Path, *, sha256: str, layer_ids, k: int) -> bool:
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}) == _meta(sha256, layer_ids, k)
    except Exception:        # a torn or foreign file: rebuild it
        return False


def read_entry(path: Path, seqs: list[TokenSeq]) -> list[dict[str, torch.Tensor]]:
    """Per-sequence slices ``{taps [n, kH], topk_ids [n, K], topk_logp [n, K]}``.

    Raises ``ValueError`` when the entry's row count is not the shard's token count."""
    from safetensors.torch import load_file

    d = load_file(str(path))
    total = sum(len(s.ids) for s in seqs)
    if d["taps"].shape[0] != total:
        raise ValueError(f"{path}: {d['taps'].shape[0]} rows for a shard of {total} tokens")
    out, a = [], 0
    for s in seqs:
        b = a + len(s.ids)
        out.append({k: v[a:b] for k, v in d.items()})
        a = b
    return out


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (ids int32 [n, k], log-probabilities float16 [n, k]) of the top k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


@torch.no_grad()
def compute_features(model, seqs: list[TokenSeq], layer_ids, k: int, max_tokens: int | None = None
                     ) -> list[dict[str, torch.Tensor]]:
    """Features of ``seqs`` from one right-padded forward per group of about ``max_tokens``
    padded tokens (sequences sorted by length; default 4096 on a CPU, 32768 on a GPU, where a
    larger forward costs no more per token). Taps at every position; top-k rows for response
    tokens (zeros elsewhere). Same layout as :func:`read_entry`; the model runs on
    ``model.device``, the inputs are copied there once per group and the rows come back to the
    host."""
    dev = model.device
    if max_tokens is None:
        max_tokens = 4096 if dev.type == "cpu" else 32768
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    out: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
    hs = hidden_state_indices(layer_ids)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[j]].ids) <= max_tokens:
            j += 1
        group = [seqs[g] for g in order[i:j]]
        width = max(len(s.ids) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64, device="cpu")
        attn = torch.zeros(len(group), width, dtype=torch.int64, device="cpu")
        for r, s in enumerate(group):
            ids[r, :len(s.ids)] = torch.from_numpy(s.ids)
            attn[r, :len(s.ids)] = 1
        res = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), output_hidden_states=hs)
        feats = tap_features(res.hidden_states, layer_ids).to(torch.bfloat16).cpu()
        for r, (g, s) in enumerate(zip(order[i:j], group)):
            n = len(s.ids)
            tid = torch.zeros(n, k, dtype=torch.int32, device="cpu")
            tlp = torch.zeros(n, k, dtype=torch.float16, device="cpu")
            resp = torch.from_numpy(s.loss_mask.astype(bool))
            resp[0] = False                         # token 0 has no prediction
            rows = torch.nonzero(resp).flatten()
            if len(rows):
                top_i, top_v = topk_rows(res.logits[r, (rows - 1).to(dev)], k)
                tid[rows], tlp[rows] = top_i.cpu(), top_v.cpu()
            taps = feats[r, :n].clone()
            taps[-1] = 0            # as generation leaves it: the last token never ran (unused)
            out[g] = {"taps": taps, "topk_ids": tid, "topk_logp": tlp}
        i = j
    return out  # type: ignore[return-value]


def ensure_features(store, entry: dict, cache_dir: str | Path, model_loader, layer_ids, k: int
                    ) -> tuple[list[TokenSeq], list[dict[str, torch.Tensor]]]:
    """Sequences of a listed shard and their features, computing the cache entry if missing.

    ``model_loader()`` returns the target (called only when something must be recomputed)."""
    seqs = store.read(entry)
    path = cache_path(cache_dir, store.fingerprint, entry["name"])
    if not valid_entry(path, sha256=entry["sha256"], layer_ids=layer_ids, k=k):
        feats = compute_features(model_loader(), seqs, layer_ids, k)
        write_entry(path, feats, sha256=entry["sha256"], layer_ids=layer_ids, k=k)
    return seqs, read_entry(path, seqs)


def as_numpy_seq(ids: list[int], n_prompt: int) -> TokenSeq:
    """A :class:`TokenSeq` from prompt + response ids (``n_prompt`` prompt tokens)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[n_prompt:] = 1
    return TokenSeq(np.asarray(ids, dtype=np.int64), mask)
