"""Training blocks for DFlash: anchors, block inputs, the block attention mask, labels, weights.

Recipe (dflash.md section 5; SpecForge ``dflash_family_model.py``): per sequence, anchors are
sampled among positions p with ``loss_mask[p]`` and ``loss_mask[p+1]`` both 1. Block j at anchor
``a_j`` is ``[token a_j, MASK x (B-1)]`` at positions ``a_j .. a_j+B-1``. Its queries see context
positions strictly before ``a_j`` and every position of their own block, never other blocks.
Block position k (k >= 1) predicts the token at ``a_j + k`` (excluded beyond the sequence or
where ``loss_mask`` is 0), with loss weight ``exp(-(k-1)/gamma)``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p+1] (int64 [m])."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num: int, rng: random.Random) -> list[int]:
    """Up to ``num`` distinct valid anchors, sorted."""
    cand = valid_anchors(loss_mask).tolist()
    return sorted(rng.sample(cand, min(num, len(cand))))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weight per block position: 0 for k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device="cpu")
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass
class BlockBatch:
    """N blocks per sequence, b sequences, padded (q = N*B queries per sequence)."""

    ctx_features: torch.Tensor    # [b, n, k*H] taps of positions 0..n-1 (zero padded)
    ctx_positions: torch.Tensor   # [b, n] int64
    block_ids: torch.Tensor       # [b, q] int64 [anchor, MASK, ...] per block
    block_positions: torch.Tensor  # [b, q] int64 anchor + k
    mask: torch.Tensor            # [b, 1, q, n + q] bool, True = may attend
    labels: torch.Tensor          # [b, q] int64, -100 = excluded
    weights: torch.Tensor         # [b, q] float32 loss weight (0 where excluded)
    soft_ids: torch.Tensor | None = None  # [b, q, K] int64 target's top-k ids of each label
    soft_p: torch.Tensor | None = None    # [b, q, K] float32 their probabilities, renormalised

    def to(self, device: torch.device | str) -> BlockBatch:
        """The same batch on ``device``: every tensor copied once (built on the host by
        :func:`build_batch`; the trainer moves each batch here and nowhere else)."""
        moved = {f.name: (None if (t := getattr(self, f.name)) is None else t.to(device, non_blocking=True))
                 for f in dataclasses.fields(self)}
        return BlockBatch(**moved)


def block_mask(anchors: list[int], ctx_len: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """Bool [q, ctx_len + q] for one sequence's blocks (q = num_blocks * B; missing blocks padded).

    Query rows of block j see context columns c < anchors[j] and the B columns of block j. Rows of
    padding blocks (j >= len(anchors)) see only their own block (kept finite, weight 0).
    """
    q = num_blocks * block_size
    m = torch.zeros(q, ctx_len + q, dtype=torch.bool, device="cpu")
    for j in range(num_blocks):
        rows = slice(j * block_size, (j + 1) * block_size)
        if j < len(anchors):
            m[rows, :anchors[j]] = True
        m[rows, ctx_len + j * block_size: ctx_len + (j + 1) * block_size] = True
    return m


def build_batch(seqs: list[dict[str, torch.Tensor]], anchors: list[list[int]], *, block_size: int,
                mask_token_id: int, gamma: float) -> BlockBatch:
    """Assemble a :class:`BlockBatch` from sequences (``input_ids``, ``loss_mask``, ``taps`` and
    optionally ``topk_ids``/``topk_logp`` [n, K], the target's distribution of each token)."""
    B = block_size
    nb = max(1, max(len(a) for a in anchors))
    # Context only needs positions < the last anchor of each sequence.
    ctx_len = max(1, max((max(a) if a else 1) for a in anchors))
    b, kh = len(seqs), seqs[0]["taps"].shape[-1]
    host = torch.device("cpu")     # built on the host; BlockBatch.to moves it once
    feats = torch.zeros(b, ctx_len, kh, dtype=seqs[0]["taps"].dtype, device=host)
    ids = torch.full((b, nb * B), mask_token_id, dtype=torch.int64, device=host)
    pos = torch.zeros(b, nb * B, dtype=torch.int64, device=host)
    labels = torch.full((b, nb * B), -100, dtype=torch.int64, device=host)
    weights = torch.zeros(b, nb * B, device=host)
    mask = torch.zeros(b, 1, nb * B, ctx_len + nb * B, dtype=torch.bool, device=host)
    w = position_weights(B, gamma)
    soft = "topk_ids" in seqs[0]
    if soft:
        K = seqs[0]["topk_ids"].shape[-1]
        soft_ids = torch.zeros(b, nb * B, K, dtype=torch.int64, device=host)
        soft_p = torch.zeros(b, nb * B, K, device=host)
    for i, (s, anc) in enumerate(zip(seqs, anchors)):
        n = len(s["input_ids"])
        m = min(n, ctx_len)
        feats[i, :m] = s["taps"][:m]
        mask[i, 0] = block_mask(anc, ctx_len, B, nb)
        for j, a in enumerate(anc):
            base = j * B
            ids[i, base] = s["input_ids"][a]
            pos[i, base:base + B] = torch.arange(a, a + B, device=host)
            for k in range(1, B):
                t = a + k
                if t < n and s["loss_mask"][t]:
                    labels[i, base + k] = s["input_ids"][t]
                    weights[i, base + k] = w[k]
            if soft:
                ts = slice(a + 1, min(a + B, n))
                rows = slice(base + 1, base + 1 + (ts.stop - ts.start))
                soft_ids[i, rows] = s["topk_ids"][ts].long()
                soft_p[i, rows] = torch.softmax(s["topk_logp"][ts].float(), -1)
        for j in range(len(anc), nb):   # padding blocks: harmless positions
            pos[i, j * B:(j + 1) * B] = torch.arange(B, device=host)
    ctx_pos = torch.arange(ctx_len, device=host).expand(b, ctx_len).contiguous()
    return BlockBatch(feats, ctx_pos, ids, pos, mask, labels, weights,
                      soft_ids if soft else None, soft_p if soft else None)

