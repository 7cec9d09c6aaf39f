"""Torch references for the verification math. Each Triton kernel beside these must match them.

Words (vLLM ``v1/sample/rejection_sampler.py`` docstring; Leviathan et al. 2023): a *draft* block
holds ``K = B - 1`` proposed tokens; the target scores ``K + 1`` positions (the anchor/bonus
token followed by the drafts); *accepted* drafts form a prefix; on the first rejection a
*recovered* token is drawn from the normalised residual ``max(p - q, 0)``; if every draft is
accepted, the *bonus* token is drawn from the target at the last position.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification (DFlash ``dflash_generate`` acceptance; z-lab/dflash ``model.py``).

    Args:
        draft_tokens: int64 [batch, K] proposed tokens (block positions 1..K).
        target_logits: float [batch, K + 1, vocab]; row k scores the token after block position k.
    Returns:
        accepted: int64 [batch], length of the prefix where ``draft[k] == argmax(logits[k])``.
        output: int64 [batch, K + 1], the accepted drafts then the bonus token
            ``argmax(logits[accepted])``, then -1 placeholders.
    """
    posterior = target_logits.argmax(dim=-1)                                   # [b, K+1]
    k = draft_tokens.shape[1]
    match = (draft_tokens == posterior[:, :k]).to(torch.int64).cumprod(dim=1)  # [b, K]
    accepted = match.sum(dim=1)                                                # [b]
    pos = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    output = torch.where(pos <= accepted[:, None], posterior, torch.full_like(posterior, -1))
    return accepted, output


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, uniforms: torch.Tensor, exp_noise: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative (rejection) sampling, Leviathan et al. 2023 Alg. 1 / Chen et al. 2023.

    Draft ``d_k ~ q_k`` is accepted when ``u_k * q_k(d_k) <= p_k(d_k)``, ``p_k(d_k) > 0`` and
    ``q_k(d_k) > 0``: probability ``min(1, p/q)`` for ``u`` uniform on (0, 1], in a form exact in
    float32 (unlike ``u <= p / q``). The positivity terms keep out a token the target gives 0
    where the product holds as ``0 <= 0``: a q that is 0 on its own draft (a drafter bug), or
    ``u == 0``. At the first rejection the recovered token is sampled from
    ``max(p_k - q_k, 0)`` (normalisation is implicit); if all K are accepted the bonus token is
    sampled from ``p_K``. Sampling uses the exponential race ``argmax(w / E)`` with
    ``E ~ Exp(1)``, which draws index i with probability ``w_i / sum(w)``; the random numbers are
    inputs so that implementations consuming the same numbers give identical results.

    Args:
        draft_tokens: int64 [batch, K].
        draft_probs: float32 [batch, K, vocab], q (after temperature/top-k/top-p).
        target_probs: float32 [batch, K + 1, vocab], p (same processing as q).
        uniforms: float32 [batch, K] in (0, 1] (a 0 is harmless: the positivity terms hold).
        exp_noise: float32 [batch, K + 1, vocab], i.i.d. Exp(1) samples (> 0).
    Returns:
        accepted: int64 [batch].
        output: int64 [batch, K + 1]: accepted drafts, then the recovered or bonus token, then -1.
    """
    b, k = draft_tokens.shape
    q_d = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)   # [b, K]
    p_d = target_probs[:, :k].gather(2, draft_tokens[:, :, None]).squeeze(2)
    ok = (uniforms * q_d <= p_d) & (p_d > 0) & (q_d > 0)                # [b, K]
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)             # [b]
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)        # [b, K, V]
    # An all-zero residual (p <= q everywhere) is reached only by a draft q gives 0 (p == q) or
    # an unnormalised p; recover from p there, so the token stays in the target's support.
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    recover_from = torch.cat([residual, target_probs[:, k:]], dim=1)    # [b, K+1, V]
    sampled = (recover_from / exp_noise).argmax(dim=2)                  # [b, K+1]
    pos = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    drafts_ext = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)     # [b, K+1]
    output = torch.where(pos < accepted[:, None], drafts_ext,
                         torch.where(pos == accepted[:, None], sampled, torch.full_like(sampled, -1)))
    return accepted, output


def pack_features(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-sequence tap features into one contiguous wire buffer.

    Args:
        features: list of ``[n_i, C]`` tensors (same C and dtype), one per sequence.
    Returns:
        buffer: ``[sum(n_i), C]`` contiguous rows in sequence order.
        offsets: int64 ``[len(features) + 1]``, row offsets (``offsets[i]:offsets[i+1]``).
    """
    lengths = torch.tensor([f.shape[0] for f in features], dtype=torch.int64)
    offsets = torch.zeros(len(features) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return torch.cat(features, dim=0).contiguous(), offsets


def unpack_features(buffer: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`pack_features`: ``[N, C]`` + offsets -> list of ``[n_i, C]`` views.

    The views alias ``buffer`` (no copy). ``offsets`` is read to the host once.
    """
    bounds = offsets.tolist()
    return [buffer[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
