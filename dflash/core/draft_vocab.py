"""Reduced draft vocabulary: the drafter's LM head over a subset of the target's token ids.

The drafter reuses the target's LM head (``V x H``; 49152 x 576 for SmolLM2), and on a CPU that
matrix product is most of a drafter call. As EAGLE-3 does (its ``d2t`` map, SafeAILab/EAGLE), a
drafter can score only the ``N`` ids the target actually emits often: drafts are argmax (or
samples) over those ids, mapped back to target ids. Verification is unchanged and still runs over
the full vocabulary, so output stays lossless: a token outside the subset can never be drafted,
which costs acceptance only where the target emits it. For sampled drafts the proposal q is zero
outside the subset, which rejection sampling handles exactly (Leviathan et al. 2023, any q works).

Stored beside a drafter checkpoint as ``draft_vocab.safetensors`` with one tensor ``ids`` (int64
[N], unique, most frequent first); :func:`build_draft_vocab` ranks ids seen in the training
responses by count, then fills the rest in id order (byte-level BPE ids roughly follow merge order,
i.e. corpus frequency).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILE = "draft_vocab.safetensors"


def build_draft_vocab(counts: torch.Tensor, size: int, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Top ``size`` ids: by ``counts`` (int64 [V], occurrences in training responses), then the
    ids of ``prior`` (an earlier draft vocabulary, e.g. the warm-start drafter's, in its order)
    not seen, then the rest by ascending id. Returns int64 [min(size, V)]. Raises
    ``ValueError`` for size < 1."""
    if size < 1:
        raise ValueError(f"draft_vocab_size: must be >= 1, got {size}")
    key = -counts.to(torch.int64) * 2
    if prior is not None:          # unseen prior ids rank after seen ids, before unseen others
        key = key.clone()
        unseen = counts[prior] == 0
        key[prior[unseen]] = -1
    order = torch.sort(key, stable=True).indices        # ties: ascending id
    if prior is not None:          # unseen prior ids keep the prior's own order
        n_seen = int((counts > 0).sum())
        n_prior = int((key == -1).sum())
        order[n_seen:n_seen + n_prior] = prior[counts[prior] == 0]
    return order[:size].to(torch.int64)


def save_draft_vocab(drafter_dir: str | Path, ids: torch.Tensor) -> Path:
    """Write ``ids`` to ``<drafter_dir>/draft_vocab.safetensors``."""
    path = Path(drafter_dir) / FILE
    save_file({"ids": ids.to(torch.int64).contiguous()}, str(path))
    return path


def load_draft_vocab(drafter_dir: str | Path, vocab_size: int, size: int = -1) -> torch.Tensor | None:
    """The first ``size`` ids of the drafter's draft vocabulary (``-1``: all of them; ``0``: none,
    i.e. the full vocabulary). Returns int64 [N] or None (no file, or ``size`` 0).

    Raises ``ValueError`` naming ``draft_vocab`` when the file is malformed (not 1-D int64, ids
    out of ``[0, vocab_size)`` or repeated) and ``draft_vocab_size`` when ``size`` exceeds it.
    """
    path = Path(drafter_dir) / FILE
    if size == 0 or not path.is_file():
        return None
    ids = load_file(str(path)).get("ids")
    if ids is None or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise ValueError(f"draft_vocab: {path} must hold a non-empty 1-D int64 tensor 'ids'")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft_vocab: ids outside [0, {vocab_size}) in {path}")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"draft_vocab: repeated ids in {path}")
    if size > ids.numel():
        raise ValueError(f"draft_vocab_size: {size} > {ids.numel()} ids in {path}")
    return ids if size < 0 else ids[:size]
