"""Prefill: a request's decode state set up, shared prompt prefixes copied, its prompt run
through the target chunk by chunk, and its first token sampled (the engine's ``start`` and
``prefill_chunk``, on the loop's thread)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

import torch

from dflash.core.finish import FINISH_LENGTH, FINISH_STOP
from dflash.core.logits_processors import token_logprobs
from dflash.core.sampling import Sampling, coupled_choice, position_noise, probs_from_logits, sample_from
from dflash.core.speculation import DEFAULT_SUFFIX_DEPTH, SUFFIX_MODES, TREE_MODES, SpecMode
from verifier_svc.decode_state import DecodeState
from verifier_svc.request import Request, StepEvent
from verifier_svc.sessions import Session
from verifier_svc.target_protocol import Target


def speculation_limits(req: Request, default_mode: str, *, trees: bool, suffix: bool,
                       tree_budget: int, tree_budgets: Sequence[int]) -> tuple[SpecMode, int, int, int]:
    """A request's speculation mode and limits: ``(mode, block_limit, tree_budget,
    suffix_limit)`` (``DecodeState``'s fields), from its own settings, its drafter's card and
    the engine's defaults (``trees``/``suffix``: the target may verify them at all)."""
    mode = SpecMode(req.spec_mode or default_mode)      # both validated: the request, the engine
    block_limit, budget, suffix_limit = 1, 0, 0
    if req.proposer is not None and mode != SpecMode.OFF:
        card = req.proposer.card
        block_limit = min(req.block_size or card.block_size, card.block_size)
        if trees and mode in TREE_MODES:
            budget = req.tree_budget or (
                tree_budget if mode in (SpecMode.TREE, SpecMode.HYBRID, SpecMode.SUFFIX)
                else max(tree_budgets, default=0))
    if suffix and mode != SpecMode.OFF and (req.proposer is not None or mode in SUFFIX_MODES):
        # with a drafter, suffix candidates are its fallback in every mode (a failed call
        # still speculates); without one, the modes that may speculate from them alone
        suffix_limit = block_limit - 1 if req.proposer is not None else \
            (req.block_size - 1 if req.block_size else DEFAULT_SUFFIX_DEPTH)
        if not budget:
            budget = req.tree_budget or (
                tree_budget if mode in (SpecMode.SUFFIX, SpecMode.HYBRID)
                else max(tree_budgets, default=tree_budget))
    return mode, block_limit, budget, suffix_limit


def share_prefix(st: DecodeState, t: Target, sessions: Iterable[Session]) -> None:
    """Shared prompt prefill: copy the longest prompt prefix that another session of the
    request's prefix group holds (the n samples of one request: the first prefills, the
    others copy its KV entries and taps, then run the last prompt token), when it is longer
    than what this session reuses of its own. Only sessions whose prompt is fully in their
    cache lend (``Session.prefix_group``); a target without ``supports_fork`` (expert parallel)
    prefills every sample."""
    s, req = st.session, st.req
    want = len(req.prompt) - 1               # the last prompt token runs: its logits are read
    if not req.prefix_group or not t.supports_fork or st.reuse >= want:
        return
    best, best_len = None, st.reuse
    for other in sessions:
        if other is s or other.prefix_group != req.prefix_group:
            continue
        n = min(common_prefix(other.tokens, req.prompt), other.cached, want)
        if s.drafter.tap_ids:   # the drafter needs this prefix's taps: the same layers'
            if other.drafter.tap_ids != s.drafter.tap_ids:
                continue
            n = min(n, len(other.drafter.taps))
        if n > best_len:
            best, best_len = other, n
    if best is None:
        return
    with t.lock:
        t.fork(best.cache, s.cache, best_len)
    if s.drafter.tap_ids:
        s.drafter.taps.truncate(st.reuse)
        s.drafter.taps.append(best.drafter.taps.rows(st.reuse)[:best_len - st.reuse])
    st.shared = best_len - st.reuse
    st.prefilled = best_len


def prefill_chunk(st: DecodeState, t: Target, budget: int, *, suffix: bool) -> StepEvent | None:
    """Prefill up to ``budget`` prompt tokens of ``st``'s request on target ``t``; the first
    token's event once the prompt is in (``suffix``: keep the session's suffix index)."""
    s, req = st.session, st.req
    d = s.drafter
    t0 = time.perf_counter()
    end = min(len(req.prompt), st.prefilled + max(budget, 1))
    with t.lock:
        logits, taps = t.forward(req.prompt[st.prefilled:end], s.cache, d.tap_ids,
                                 logits_to_keep=1)         # only the last row is read
    st.prefill_seconds += time.perf_counter() - t0
    if d.tap_ids:
        assert taps is not None                 # the target taps the layers it is asked for
        d.taps.append(taps)
    st.prefilled = end
    if end < len(req.prompt):
        return None
    s.tokens = list(req.prompt)
    s.prefix_group = req.prefix_group        # cache, taps and tokens agree on the prompt
    raw = logits[-1:]                                       # [1, V]
    x = st.processor.apply(raw) if st.processor else raw
    if st.grammar is not None:             # the first token is masked by the grammar's start
        x = x.float().masked_fill(~st.grammar.mask().to(x.device), -math.inf)
    first = sample_first(x, req.sampling, st.gen, len(req.prompt))
    s.tokens.append(first)
    if suffix:
        s.suffix.sync(s.tokens)              # O(new tokens) after a turn that kept its prefix
    if st.processor:
        st.processor.commit([first])
    if st.grammar is not None:
        st.grammar.commit([first])
    st.emitted = 1
    finish = FINISH_STOP if first in st.stops else (FINISH_LENGTH if req.max_tokens == 1 else None)
    if req.proposer is not None and st.block_limit > 1:
        d.proposer = req.proposer
    return StepEvent(tokens=[first], finish=finish, verify_seconds=st.prefill_seconds,
                     stats=st.stats, prompt_tokens=len(req.prompt),
                     cached_prompt_tokens=st.reuse + st.shared + st.hit,
                     logprobs=token_logprobs(raw, [0], [first], req.sampling.top_logprobs)
                     if req.sampling.logprobs else None)


def sample_first(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None,
                 position: int) -> int:
    """The token at sequence index ``position`` from the last row of ``logits`` [n, V]:
    argmax, the seeded race against ``position_noise`` (as verification does), or a draw
    from ``gen``."""
    if sampling.greedy:
        return int(logits[-1].argmax())
    probs = probs_from_logits(logits[-1], sampling)
    if sampling.seed is not None:
        return int(coupled_choice(probs, position_noise(sampling.seed, [position],
                                                        logits.shape[-1], logits.device)[0]))
    assert gen is not None                      # a sampled request has its generator
    return int(sample_from(probs, gen))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
