"""Draft choice from a block's logits, and the compute threads' setup (for ``engine.py``).

Pure torch; never imports generated protobuf.
"""

from __future__ import annotations

import logging
import os

import torch

from dflash.core.proposer import Proposal, ProposalRequest
from dflash.core.sampling import coupled_choice, position_noise, probs_from_logits, sample_from
from dflash.serving.threads import claim

log = logging.getLogger("dflash.drafter")


def choose_drafts(r: ProposalRequest, logits: torch.Tensor, *, length: int,
                  generator: torch.Generator | None, draft_vocab: torch.Tensor | None,
                  vocab_size: int, device: torch.device
                  ) -> tuple[Proposal, torch.Generator | None]:
    """Drafts (and q for unseeded sampled drafts) in target ids, and the session's generator
    (made on first use).

    ``logits`` float32 [K, N] (N = draft vocabulary size when ``draft_vocab`` int64 [N] is
    given, else ``vocab_size``); ``length`` = the session's cached positions (the anchor's).
    With a draft vocabulary q is scattered into a full-vocabulary [K, V] tensor, zero
    elsewhere. Seeded drafts are ``argmax(q_t / position_noise(seed, t))`` for the sequence
    indices t after the anchor (``dflash.core.sampling.position_noise``), sent without q."""
    ids = draft_vocab
    if r.sampling.greedy:
        tok = logits.argmax(-1)
        return Proposal(tokens=ids[tok] if ids is not None else tok), generator
    probs = probs_from_logits(logits, r.sampling)
    if r.sampling.seed is not None:
        # the verifier's own noise for these sequence indices (the anchor sits at
        # ``length``): coupled, a draft is accepted iff the target's race picks it too
        first = length + 1
        noise = position_noise(r.sampling.seed, range(first, first + probs.shape[0]),
                               vocab_size, device)
        tok = coupled_choice(probs, noise if ids is None else noise[:, ids])
        # no q: coupled verification never reads it (and it is [k, V] floats on the wire)
        return Proposal(tokens=ids[tok] if ids is not None else tok), generator
    if generator is None:
        generator = r.sampling.generator(device)
    tok = sample_from(probs, generator)
    if ids is None:
        return Proposal(tokens=tok, probs=probs), generator
    full = probs.new_zeros((probs.shape[0], vocab_size))
    full[:, ids] = probs
    return Proposal(tokens=ids[tok], probs=full), generator


def top_k_in_target_ids(logits: torch.Tensor, k: int, draft_vocab: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_logprobs` of a block's draft logits, ids in the target vocabulary."""
    idx, vals = top_k_logprobs(logits, k)
    if draft_vocab is not None:
        idx = draft_vocab[idx]
    return idx, vals


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top ``k`` per draft position, what DDTree builds its tree from
    (Ringel & Romano, arXiv 2604.12989; liranringel/ddtree ``build_ddtree_tree``: float32
    log-softmax of the draft logits, top-k per depth).

    Args:
        logits: float32 [K, N] of this block's drafts (N = draft vocabulary size when there
            is one, else V), the very logits the drafts came from (no second forward).
        k: 1 <= k <= MAX_TOP_K; more than N gives N columns.
    Returns:
        (ids int64 [K, c]: columns of ``logits``, i.e. draft-vocabulary rows when there is
        one; logprobs float32 [K, c], descending per row), c = min(k, N): log-softmax at
        temperature 1 whatever the request's sampling. Column 0 is ``argmax(logits)`` (its
        first index among ties), the greedy draft.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    n = lp.shape[-1]
    c = min(k, n)
    vals, idx = lp.topk(min(max(k, 2), n), dim=-1)   # >= 2 columns: a tie for the top shows
    # topk does not promise argmax's first-index rule on ties (common in bf16 logits), yet
    # column 0 must be the greedy chain's draft: put argmax first, and the column it held
    # (if among the top) where it was. Its log-prob is the row's max (rounding is monotone),
    # so the row stays sorted; a row without a tie is unchanged (its top is the argmax).
    # Whole-tensor ops: no host round trip per row.
    first = logits.argmax(-1)                                      # [K]
    hit = idx == first[:, None]                                    # [K, c']
    at = hit.to(torch.int64).argmax(-1)                            # first's column, or 0
    rows = torch.arange(idx.shape[0], device=idx.device)
    idx[rows, at] = torch.where(hit.any(-1), idx[:, 0], idx[rows, at])
    idx[:, 0] = first
    vals, idx = vals[:, :c], idx[:, :c]
    return idx, vals


def context_thread_init(threads: int, sched: str) -> None:
    """Initializer of the context thread: ``threads`` torch threads for this thread only (the
    process default for threads started later is left as it was), and ``SCHED_IDLE`` when
    ``sched`` is "idle" (Linux ``sched_setscheduler`` on the calling thread; an unprivileged
    thread may lower its own policy)."""
    claim(threads, others=torch.get_num_threads())
    if sched == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            log.warning("context thread keeps the process's scheduling policy: %s", e)


def to_host(out: list, device: torch.device) -> list:
    """Every proposal's tensors on the host, with one wait for the device: each copy is queued
    into pinned memory without blocking (``non_blocking`` from CUDA allocates the host side
    pinned), then the stream is synchronised once (a ``.tolist()`` or a pageable copy per
    tensor would wait for the device each time)."""
    if device.type != "cuda":
        return out
    for p in out:
        if isinstance(p, Proposal):
            p.tokens = p.tokens.to("cpu", non_blocking=True)    # a no-op for host tensors
            if p.probs is not None:
                p.probs = p.probs.to("cpu", non_blocking=True)
            if p.top_ids is not None and p.top_logprobs is not None:
                p.top_ids = p.top_ids.to("cpu", non_blocking=True)
                p.top_logprobs = p.top_logprobs.to("cpu", non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return out
