"""Pieces shared by the Triton verification kernels: first-index argmax and vocab split sizes.

Every vocab-wide argmax here is split in two stages so that small batches still fill the GPU:
stage 1 runs one program per (row, vocab chunk) and writes a partial ``(max, first index)``; stage
2 reduces the partials of a row and does the acceptance logic. Ties resolve to the smallest index
at both stages, which is ``torch.argmax``'s rule (first maximal index), so results match exactly.
NaN is not handled (torch treats NaN as the maximum; these kernels skip it): logits and
probabilities must be NaN-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True, kw_only=True)
class VocabSplit:
    """How one vocab row is cut for stage 1: ``n_splits`` programs of ``chunk`` entries each,
    every program reading ``block_v`` entries per step (``chunk`` is a multiple of ``block_v``)."""

    block_v: int
    chunk: int
    n_splits: int
    block_s: int  # next power of two >= n_splits, the stage-2 tile width


def vocab_split(vocab: int, *, block_v: int = 1024, chunk: int = 4096) -> VocabSplit:
    """Split sizes for a row of ``vocab`` entries (defaults tuned for 32k-256k vocabularies)."""
    if block_v & (block_v - 1) or block_v <= 0:
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    chunk = max(block_v, (chunk // block_v) * block_v)
    n_splits = max(1, triton.cdiv(vocab, chunk))
    return VocabSplit(block_v=block_v, chunk=chunk, n_splits=n_splits,
                      block_s=triton.next_power_of_2(n_splits))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


# tl.max / tl.min are @jit functions of triton.language, made compiled or interpreted once, when
# triton is imported; a test process has often imported triton (transformers does) before it sets
# TRITON_INTERPRET, and then they cannot run under the interpreter. tl.reduce is a builtin and
# follows the mode of the calling kernel. The combine functions are triton's own (what tl.max
# uses, which the interpreter recognises and runs in numpy); ours only if a release drops them.
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _max_combine)
_MIN_COMBINE = getattr(tl.standard, "_elementwise_min", _min_combine)


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX_COMBINE)


@triton.jit
def reduce_min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MIN_COMBINE)


@triton.jit
def first_max_step(best_v, best_i, v, idx):
    """Per-lane running max; strict ``>`` keeps the earlier index on ties (lanes scan upwards)."""
    take = v > best_v
    return tl.where(take, v, best_v), tl.where(take, idx, best_i)


@triton.jit
def first_max(vals, idxs, axis: tl.constexpr):
    """Max along ``axis`` and the smallest index attaining it (torch.argmax's tie-break)."""
    m = reduce_max(vals, axis)
    if axis == 0:
        hit = vals == m
    else:
        hit = vals == m[:, None]
    i = reduce_min(tl.where(hit, idxs, 2147483647), axis)
    return m, i
