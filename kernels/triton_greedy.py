"""Batched greedy acceptance in Triton; reference: :func:`kernels.reference.greedy_accept`.

Stage 1 (grid ``[batch * (K + 1), n_splits]``): partial argmax of each target row over one vocab
chunk. Stage 2 (grid ``[batch]``): finish the argmax of the ``K + 1`` rows (the posterior), take
the accepted prefix where ``draft[k] == posterior[k]`` and write accepted drafts, the bonus token
``posterior[accepted]``, then -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import first_max, first_max_step, reduce_min, vocab_split


@triton.jit
def _row_argmax_partial_kernel(
    logits_ptr, part_val_ptr, part_idx_ptr,
    stride_b, stride_k, K1, V, n_splits,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * (K + 1) + k
    split = tl.program_id(1)
    base = logits_ptr + (row // K1) * stride_b + (row % K1) * stride_k
    start = split * CHUNK
    lanes = tl.arange(0, BLOCK_V)
    best_v = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = start + lanes  # an all -inf row keeps its first index, as torch.argmax does
    for off in range(0, CHUNK, BLOCK_V):
        idx = start + off + lanes
        v = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        best_v, best_i = first_max_step(best_v, best_i, v, idx)
    m, i = first_max(best_v, best_i, 0)
    tl.store(part_val_ptr + row * n_splits + split, m)
    tl.store(part_idx_ptr + row * n_splits + split, i)


@triton.jit
def _greedy_accept_kernel(
    draft_ptr, part_val_ptr, part_idx_ptr, accepted_ptr, out_ptr,
    stride_db, K, n_splits,
    BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K1)
    ss = tl.arange(0, BLOCK_S)
    tile = (b * (K + 1) + ks)[:, None] * n_splits + ss[None, :]
    mask = (ks[:, None] < K + 1) & (ss[None, :] < n_splits)
    vals = tl.load(part_val_ptr + tile, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + tile, mask=mask, other=2147483647)
    _, posterior = first_max(vals, idxs, 1)  # [BLOCK_K1]
    draft = tl.load(draft_ptr + b * stride_db + ks, mask=ks < K, other=-1)
    # First k < K with draft != posterior, else K (lanes >= K contribute their own k >= K).
    accepted = reduce_min(tl.where((ks < K) & (draft == posterior), K, ks), 0)
    out = tl.where(ks <= accepted, posterior.to(tl.int64), -1)
    tl.store(out_ptr + b * (K + 1) + ks, out, mask=ks < K + 1)
    tl.store(accepted_ptr + b, accepted.to(tl.int64))


LOGIT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})  # exact in fp32


def supports(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> bool:
    """Whether the kernel reproduces the reference: logits that fp32 holds exactly (not fp64)
    and integer draft tokens."""
    return (target_logits.dtype in LOGIT_DTYPES and not draft_tokens.dtype.is_floating_point
            and draft_tokens.dtype != torch.bool)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, *,
                  block_v: int = 1024, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference.greedy_accept` (NaN-free logits).

    Args:
        draft_tokens: integer [batch, K].
        target_logits: float (fp32/fp16/bf16) [batch, K + 1, vocab]; rows may be strided but the
            vocab dimension must be contiguous (otherwise a contiguous copy is made).
        block_v, chunk: vocab split sizes (see :func:`kernels.triton_common.vocab_split`).
    Returns:
        accepted: int64 [batch]; output: int64 [batch, K + 1].
    """
    b, k = draft_tokens.shape
    _, k1, vocab = target_logits.shape
    if k1 != k + 1:
        raise ValueError(f"target_logits has {k1} rows per sequence, expected K + 1 = {k + 1}")
    device = target_logits.device
    accepted = torch.empty(b, dtype=torch.int64, device=device)
    output = torch.empty(b, k + 1, dtype=torch.int64, device=device)
    if b == 0:
        return accepted, output
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    split = vocab_split(vocab, block_v=block_v, chunk=chunk)
    part_val = torch.empty(b * k1, split.n_splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(b * k1, split.n_splits, dtype=torch.int32, device=device)
    _row_argmax_partial_kernel[(b * k1, split.n_splits)](
        target_logits, part_val, part_idx,
        target_logits.stride(0), target_logits.stride(1), k1, vocab, split.n_splits,
        CHUNK=split.chunk, BLOCK_V=split.block_v,
    )
    _greedy_accept_kernel[(b,)](
        draft_tokens, part_val, part_idx, accepted, output,
        draft_tokens.stride(0) if k else 0, k, split.n_splits,
        BLOCK_K1=triton.next_power_of_2(k1), BLOCK_S=split.block_s,
    )
    return accepted, output
