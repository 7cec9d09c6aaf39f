"""Whether a drafter's reply is usable: ``k`` drafts in the target's vocabulary, with
well-formed probabilities and top-k alternatives when it sends them (a malformed reply falls
back to no speculation for that step, ``verifier_svc.drafter_sync``)."""

from __future__ import annotations

import torch

from dflash.core.proposer import DraftError, FallbackReason, Proposal


def malformed(res: Proposal | DraftError, k: int, vocab_size: int, top_k: int = 0) -> str | None:
    """Why ``res`` is not ``k`` usable drafts with up to ``top_k`` alternatives each (None:
    it is).

    Probabilities (reason "malformed_probs"): when sent, ``[k, vocab_size]`` floating,
    finite, non-negative and positive on each drafted token.

    Top-k (reason "malformed_topk"): a result with neither ``top_ids`` nor
    ``top_logprobs`` is a chain drafter that predates top-k and is fine whatever
    ``top_k`` is. Otherwise both must be there, asked for (top_k > 0), int64 and float32
    of one shape ``[k, c]`` with ``1 <= c <= min(top_k, vocab_size)`` (fewer than asked
    only from a drafter whose vocabulary, a draft vocabulary included, is smaller), ids in
    ``[0, vocab_size)`` and distinct per row (a tree node has one child per token),
    log-probs finite, ``<= 0`` and non-increasing along each row.
    """
    if isinstance(res, DraftError):
        return res.reason
    toks = res.tokens
    if toks.dim() != 1 or toks.numel() != k:
        return FallbackReason.MALFORMED_BLOCK
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= vocab_size):
        return FallbackReason.OUT_OF_VOCAB
    if res.probs is not None and not _probs_ok(res.probs, toks, vocab_size):
        return FallbackReason.MALFORMED_PROBS
    if res.top_ids is not None or res.top_logprobs is not None:
        if not _top_k_ok(res.top_ids, res.top_logprobs, k, top_k, vocab_size):
            return FallbackReason.MALFORMED_TOPK
    return None

def _probs_ok(q: torch.Tensor, toks: torch.Tensor, vocab_size: int) -> bool:
    """q ``[k, vocab_size]`` floating, finite, non-negative, and positive on each row's own
    draft ``toks[j]``: a drafter cannot have drawn a token it gives 0, and rejection
    sampling would otherwise test it against ``u * 0 <= p``."""
    if q.shape != (toks.numel(), vocab_size) or not q.dtype.is_floating_point:
        return False
    if not (torch.isfinite(q).all() and (q >= 0).all()):
        return False
    return bool((q.gather(1, toks.to(torch.int64)[:, None]) > 0).all())

def _top_k_ok(ids: torch.Tensor | None, lp: torch.Tensor | None, k: int, top_k: int,
              vocab_size: int) -> bool:
    if ids is None or lp is None or top_k <= 0:
        return False
    if ids.dtype != torch.int64 or lp.dtype != torch.float32 or ids.dim() != 2:
        return False
    c = ids.shape[1]
    if lp.shape != ids.shape or ids.shape[0] != k or not 1 <= c <= min(top_k, vocab_size):
        return False
    if not k:
        return True
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return False
    by_id = ids.sort(-1).values
    if (by_id[:, 1:] == by_id[:, :-1]).any():
        return False
    return bool(torch.isfinite(lp).all() and (lp <= 0).all()
                and (lp[:, 1:] <= lp[:, :-1]).all())
