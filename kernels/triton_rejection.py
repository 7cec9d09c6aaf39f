"""Batched rejection sampling in Triton; reference: :func:`kernels.reference.rejection_sample`.

Consumes the same random inputs as the reference (``uniforms``, ``exp_noise``) and does the same
fp32 arithmetic (IEEE division via ``div_rn``, no FMA contraction), so results are bit-identical. Unlike the reference,
which samples a token at all ``K + 1`` positions and keeps one, only the row at the first
rejection (or the bonus row) is read from ``draft_probs`` / ``target_probs`` / ``exp_noise``.

Stage 1 (grid ``[batch, n_splits]``): every program recomputes the accepted length from K
gathers, then scans one vocab chunk of that row for two partial exponential-race winners:
``argmax(max(p - q, 0) / E)`` (recovered) and ``argmax(p / E)`` (bonus, and the fallback when the
residual is all zero), plus whether any residual entry is positive. Stage 2 (grid ``[batch]``)
reduces the partials and writes accepted drafts, the recovered or bonus token, then -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import first_max, first_max_step, reduce_max, reduce_min, vocab_split


@triton.jit
def _rejection_partial_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, e_ptr,
    accepted_ptr, r_val_ptr, r_idx_ptr, pos_ptr, p_val_ptr, p_idx_ptr,
    stride_db, stride_qb, stride_qk, stride_pb, stride_pk, stride_ub, stride_eb, stride_ek,
    K, V, n_splits,
    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)

    # Accepted length: first k failing u_k * q_k(d_k) <= p_k(d_k) & p_k(d_k) > 0 & q_k(d_k) > 0,
    # else K (the reference's rule: "0 <= 0" must not accept a token the target gives 0).
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    d = tl.load(draft_ptr + b * stride_db + ks, mask=kmask, other=0).to(tl.int64)
    q_d = tl.load(q_ptr + b * stride_qb + ks * stride_qk + d, mask=kmask, other=0.0)
    p_d = tl.load(p_ptr + b * stride_pb + ks * stride_pk + d, mask=kmask, other=0.0)
    u = tl.load(u_ptr + b * stride_ub + ks, mask=kmask, other=0.0)
    ok = (u * q_d <= p_d) & (p_d > 0.0) & (q_d > 0.0)
    accepted = reduce_min(tl.where(kmask & ok, K, ks), 0)
    tl.store(accepted_ptr + b, accepted.to(tl.int64), mask=split == 0)

    # Scan the row at position `accepted` (row K has no q: the bonus row).
    q_end = tl.where(accepted < K, V, 0)  # vocab end for q loads: none on the bonus row
    row = accepted.to(tl.int64)
    p_row = p_ptr + b * stride_pb + row * stride_pk
    q_row = q_ptr + b * stride_qb + row * stride_qk
    e_row = e_ptr + b * stride_eb + row * stride_ek
    start = split * CHUNK
    lanes = tl.arange(0, BLOCK_V)
    best_r = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_p = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_r = start + lanes
    idx_p = start + lanes
    any_pos = tl.full([BLOCK_V], 0, tl.int32)
    for off in range(0, CHUNK, BLOCK_V):
        idx = start + off + lanes
        m = idx < V
        p = tl.load(p_row + idx, mask=m, other=0.0)
        q = tl.load(q_row + idx, mask=idx < q_end, other=0.0)
        e = tl.load(e_row + idx, mask=m, other=1.0)
        r = tl.maximum(p - q, 0.0)
        rv = tl.where(m, tl.math.div_rn(r, e), float("-inf"))
        pv = tl.where(m, tl.math.div_rn(p, e), float("-inf"))
        best_r, idx_r = first_max_step(best_r, idx_r, rv, idx)
        best_p, idx_p = first_max_step(best_p, idx_p, pv, idx)
        any_pos = tl.maximum(any_pos, (m & (r > 0.0)).to(tl.int32))
    vr, ir = first_max(best_r, idx_r, 0)
    vp, ip = first_max(best_p, idx_p, 0)
    slot = b * n_splits + split
    tl.store(r_val_ptr + slot, vr)
    tl.store(r_idx_ptr + slot, ir)
    tl.store(pos_ptr + slot, reduce_max(any_pos, 0))
    tl.store(p_val_ptr + slot, vp)
    tl.store(p_idx_ptr + slot, ip)


@triton.jit
def _rejection_finish_kernel(
    draft_ptr, accepted_ptr, r_val_ptr, r_idx_ptr, pos_ptr, p_val_ptr, p_idx_ptr, out_ptr,
    stride_db, K, n_splits,
    BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    smask = ss < n_splits
    slot = b * n_splits + ss
    _, tok_r = first_max(tl.load(r_val_ptr + slot, mask=smask, other=float("-inf")),
                         tl.load(r_idx_ptr + slot, mask=smask, other=2147483647), 0)
    _, tok_p = first_max(tl.load(p_val_ptr + slot, mask=smask, other=float("-inf")),
                         tl.load(p_idx_ptr + slot, mask=smask, other=2147483647), 0)
    any_pos = reduce_max(tl.load(pos_ptr + slot, mask=smask, other=0), 0)
    accepted = tl.load(accepted_ptr + b)
    # Bonus row, or a recovered row whose residual is all zero: sample from p.
    tok = tl.where((accepted == K) | (any_pos == 0), tok_p, tok_r).to(tl.int64)
    ks = tl.arange(0, BLOCK_K1)
    d = tl.load(draft_ptr + b * stride_db + ks, mask=ks < K, other=0).to(tl.int64)
    out = tl.where(ks < accepted, d, tl.where(ks == accepted, tok, -1))
    tl.store(out_ptr + b * (K + 1) + ks, out, mask=ks < K + 1)


def supports(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
             uniforms: torch.Tensor, exp_noise: torch.Tensor) -> bool:
    """Whether the kernel reproduces the reference bit for bit: all float inputs float32 (other
    dtypes round differently in torch) and integer draft tokens."""
    floats = (draft_probs, target_probs, uniforms, exp_noise)
    return (all(t.dtype == torch.float32 for t in floats)
            and not draft_tokens.dtype.is_floating_point and draft_tokens.dtype != torch.bool)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, uniforms: torch.Tensor, exp_noise: torch.Tensor,
                     *, block_v: int = 1024, chunk: int = 4096
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference.rejection_sample` (float32, NaN-free inputs).

    Args:
        draft_tokens: integer [batch, K].
        draft_probs: float32 [batch, K, vocab], q.
        target_probs: float32 [batch, K + 1, vocab], p.
        uniforms: float32 [batch, K] in (0, 1].
        exp_noise: float32 [batch, K + 1, vocab], Exp(1) samples (> 0).
        block_v, chunk: vocab split sizes (see :func:`kernels.triton_common.vocab_split`).
    Returns:
        accepted: int64 [batch]; output: int64 [batch, K + 1].
    """
    b, k = draft_tokens.shape
    vocab = target_probs.shape[2]
    if target_probs.shape[1] != k + 1 or exp_noise.shape != target_probs.shape:
        raise ValueError("target_probs and exp_noise must be [batch, K + 1, vocab]")
    if draft_probs.shape != (b, k, vocab) or uniforms.shape != (b, k):
        raise ValueError("draft_probs must be [batch, K, vocab] and uniforms [batch, K]")
    device = target_probs.device
    accepted = torch.empty(b, dtype=torch.int64, device=device)
    output = torch.empty(b, k + 1, dtype=torch.int64, device=device)
    if b == 0:
        return accepted, output
    draft_probs, target_probs, exp_noise = (
        t if t.stride(2) == 1 else t.contiguous() for t in (draft_probs, target_probs, exp_noise))
    draft_tokens, uniforms = draft_tokens.contiguous(), uniforms.contiguous()
    split = vocab_split(vocab, block_v=block_v, chunk=chunk)
    r_val = torch.empty(b, split.n_splits, dtype=torch.float32, device=device)
    p_val = torch.empty_like(r_val)
    r_idx = torch.empty(b, split.n_splits, dtype=torch.int32, device=device)
    p_idx, any_pos = torch.empty_like(r_idx), torch.empty_like(r_idx)
    stride_db = draft_tokens.stride(0) if k else 0
    _rejection_partial_kernel[(b, split.n_splits)](
        draft_tokens, draft_probs, target_probs, uniforms, exp_noise,
        accepted, r_val, r_idx, any_pos, p_val, p_idx,
        stride_db, draft_probs.stride(0), draft_probs.stride(1),
        target_probs.stride(0), target_probs.stride(1), uniforms.stride(0) if k else 0,
        exp_noise.stride(0), exp_noise.stride(1),
        k, vocab, split.n_splits,
        BLOCK_K=triton.next_power_of_2(max(k, 1)), CHUNK=split.chunk, BLOCK_V=split.block_v,
        enable_fp_fusion=False,  # keep u * q, p - q and div_rn exactly as torch rounds them
    )
    _rejection_finish_kernel[(b,)](
        draft_tokens, accepted, r_val, r_idx, any_pos, p_val, p_idx, output,
        stride_db, k, split.n_splits,
        BLOCK_K1=triton.next_power_of_2(k + 1), BLOCK_S=split.block_s,
    )
    return accepted, output
