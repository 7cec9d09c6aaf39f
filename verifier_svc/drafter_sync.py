"""What each session's drafter holds, and the step's draft calls.

The drafter keeps each session's context (its K/V of the committed positions' taps). The
verifier must know how much of it the drafter holds, send exactly the rows it lacks, and start
over whenever the drafter may have lost some: a failed draft, a failed context-only update
reported later by the stream's reader thread, another drafter, other tap layers. That state
lives here, in one place: :class:`DrafterState` per session (the tap rows included) and
:class:`DrafterSync` for the calls of one step.

A context-only update that nothing waits for (``ContextSender.send_context``) advances the
held length at once; if it fails, the session's epoch says whether the failure is still news
(a reset since then already resends everything) and the next step resends the whole context.
A draft request that overtakes the news fails with ``context_gap`` on the drafter and falls back.

A step waits for its drafts no longer than what speculating is worth (``budget_s`` of
:meth:`DrafterSync.draft`, from ``SpeculationPolicy.draft_budget``), handed to a
:class:`DeadlineProposer`. A draft the step stopped waiting for (``DraftError(FallbackReason.LATE)``) is
still queued on the drafter, which takes in its context: the held length advances as for a
context-only update, and a late failure is news in the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from dflash.core.proposer import DraftError, FallbackReason, Proposal, ProposalRequest, Proposer
from dflash.core.sampling import Sampling
from verifier_svc.draft_checks import malformed
from verifier_svc.tap_buffer import TapRows

log = logging.getLogger("dflash.verifier")


@runtime_checkable
class ContextSender(Protocol):
    """A proposer that can send context-only updates without waiting for the reply."""

    def send_context(self, requests: list[ProposalRequest],
                     on_failed: Callable[[list[str]], None]) -> None: ...


@runtime_checkable
class DeadlineProposer(Protocol):
    """A proposer whose draft call waits at most what the step's drafts are worth
    (``verifier_svc.drafter_client.RemoteProposer.propose_within``)."""

    def propose_within(self, requests: list[ProposalRequest], budget_s: float | None,
                       on_late_failure: Callable[[list[str]], None]
                       ) -> list[Proposal | DraftError]: ...


#: The reason of a draft the step stopped waiting for while the drafter still takes it in.
LATE = FallbackReason.LATE


@dataclasses.dataclass
class DrafterState:
    """One session's drafter: which one, which taps, and what it holds."""

    proposer: Proposer | None = None
    tap_ids: tuple[int, ...] = ()
    taps: TapRows = dataclasses.field(default_factory=TapRows)   # rows of the cached positions
    length: int = 0                    # context positions the drafter holds
    epoch: int = 0                     # bumped by reset: older async failures are moot
    # A cached prefix the drafter may start the session from, (key, positions), when longer
    # than ``length`` (``verifier_svc.prefix_reuse.take_cached``); the next call names it.
    prefix: tuple[bytes, int] | None = None

    def reset(self) -> None:
        """The drafter holds none of this session's context now: the next call resends it all."""
        self.length = 0
        self.prefix = None
        self.epoch += 1

    @property
    def from_prefix(self) -> bool:
        """The next call starts the session from its cached prefix."""
        return self.prefix is not None and self.prefix[1] > self.length


@dataclasses.dataclass(frozen=True)
class DraftItem:
    """One session's part of a step's draft calls."""

    session_id: str
    state: DrafterState
    proposer: Proposer | None          # the request's drafter (None: speculation off)
    cached: int                        # target positions cached (the anchor comes next)
    anchor: int
    k: int                             # drafts wanted (0: context update only, if any)
    room: bool                         # could speculate at all (block limit and tokens left)
    sampling: Sampling
    trace_context: dict[str, str]
    top_k: int = 0                     # alternatives wanted per draft position (a tree); 0 = chain
    no_learn: bool = False             # its tenant opted out of online learning
    tokens: Sequence[int] = ()         # the session's committed ids, [0, cached] (read, not kept)
    prompt_len: int = 0                # ids below it are the request's prompt: never sent


@dataclasses.dataclass(frozen=True)
class DraftOutcome:
    """One session's drafts this step."""

    tokens: torch.Tensor               # [k] int64 drafts, the proposal's own (k = 0: none)
    probs: torch.Tensor | None         # [k, V] float, sampled drafts' q; None = greedy/one-hot
    fallback: str | None               # why a wanted block is missing
    called: bool                       # the drafter was called for it (its time counts)
    # The drafter's top alternatives per draft position (``Proposal.top_ids``), only when the
    # item asked for top_k > 0 and the drafter has them; None from a chain drafter, whose
    # block is then verified as a chain.
    top_ids: torch.Tensor | None = None        # [k, c] int64 target ids, 1 <= c <= top_k
    top_logprobs: torch.Tensor | None = None   # [k, c] float32 <= 0, descending per row


#: No drafts (never written to: every outcome without drafts shares it).
EMPTY = torch.empty(0, dtype=torch.int64)
NONE = DraftOutcome(EMPTY, None, None, False)


@dataclasses.dataclass(frozen=True)
class DraftRound:
    """One step's draft calls: per item its outcome (in item order), the seconds spent in
    calls that returned no usable draft (the drafter's failure, not the price of the step's
    block: the policy leaves them out of the step's cost), and whether a call uploaded a
    session's context from its first position (a joining session's prompt, or a resend after a
    failure: not what a steady step costs either)."""

    outcomes: list[DraftOutcome]
    wasted_seconds: float = 0.0
    uploaded: bool = False             # a call carried some session's whole context (a join)


@dataclasses.dataclass
class PrefixCounts:
    """Sessions started from a drafter's cached prefix since start (``DrafterSync.prefixes``)."""

    hits: int = 0                      # the drafter held it: only the rest was uploaded
    hit_tokens: int = 0                # context positions not uploaded thanks to them
    misses: int = 0                    # it did not (restarted, evicted): the whole context sent


class DrafterSync:
    """The draft calls of one step and the per-session bookkeeping around them.

    Args:
        vocab_size: drafts outside ``[0, vocab_size)`` are refused (``out_of_vocab``).
        context_flush: a session that does not speculate this step sends its new context once
            this many rows are unsent, or whenever its drafter is called this step anyway; a
            draft request always carries the rest. Raises ValueError below 1.
    """

    def __init__(self, vocab_size: int, context_flush: int = 8):
        if context_flush < 1:
            raise ValueError(f"context_flush must be >= 1, got {context_flush}")
        self.vocab_size = vocab_size
        self.context_flush = context_flush
        self._lock = threading.Lock()
        self._failed: set[tuple[str, int]] = set()   # (session, epoch) of failed async updates
        self.prefixes = PrefixCounts()

    # ------------------------------------------------------------------ per session
    def bind(self, session_id: str, state: DrafterState, proposer: Proposer | None) -> bool:
        """A request starts on this session with ``proposer``: release another drafter, reset
        the taps when the layers differ. Returns whether the cached prefix's taps are usable."""
        tap_ids = tuple(proposer.card.target_layer_ids) if proposer else ()
        if state.proposer is not None and state.proposer is not proposer:
            self.release(session_id, state)
        if tap_ids != state.tap_ids:
            state.taps, state.tap_ids = TapRows(), tap_ids
            state.reset()
            return False
        return True

    def truncate(self, state: DrafterState, n: int) -> None:
        """The session keeps its first ``n`` positions (prefix reuse)."""
        if state.tap_ids:
            state.taps.truncate(n)
        state.length = min(state.length, n)
        if state.prefix is not None and state.prefix[1] > n:
            state.prefix = None

    def release(self, session_id: str, state: DrafterState) -> None:
        """The drafter may drop the session (never raises: a drafter failure fails nothing)."""
        if state.proposer is not None:
            try:
                state.proposer.release([session_id])
            except Exception:
                log.warning("drafter release failed for session %s", session_id, exc_info=True)
            state.proposer = None
        state.reset()

    # ------------------------------------------------------------------ one step
    def draft(self, items: list[DraftItem], budget_s: float | None = None) -> DraftRound:
        """Per item its drafts; one call per drafter, with every session that has unsent rows.

        A call without any draft goes to a :class:`ContextSender` without waiting. ``budget_s``:
        seconds the step's draft calls may take in all (``SpeculationPolicy.draft_budget``;
        None = unknown): a :class:`DeadlineProposer` gets what is left of it when its call
        starts."""
        out = [NONE] * len(items)
        wasted = 0.0
        uploaded = False
        t0 = time.perf_counter()
        with self._lock:
            failed, self._failed = self._failed, set()
        for it in items:   # an earlier context-only update did not land: resend it all
            if (it.session_id, it.state.epoch) in failed:
                it.state.reset()
        candidates: dict[int, list[tuple[int, bool, bool]]] = {}   # proposer -> (item, must, may)
        for i, it in enumerate(items):
            if it.proposer is None or it.state.proposer is not it.proposer:
                continue
            unsent = it.cached - it.state.length
            must = bool(it.k) or (it.room and unsent >= self.context_flush)
            candidates.setdefault(id(it.proposer), []).append((i, must, it.room and unsent > 0))
        # Once a drafter is called this step every session with unsent rows rides along: the
        # call, not the rows, is the cost.
        groups = [[i for i, must, may in c if must or may] for c in candidates.values()
                  if any(must for _, must, _ in c)]
        for idx in groups:
            proposer = items[idx[0]].proposer
            assert proposer is not None            # only items with a drafter are grouped
            uploaded = uploaded or any(not items[i].state.length for i in idx)
            # a call that starts a session from a cached prefix is waited for: a miss is then
            # known at once and the whole context resent in this step
            if not any(items[i].k or items[i].state.from_prefix for i in idx) and \
                    isinstance(proposer, ContextSender):
                self._send_context(proposer, [items[i] for i in idx])
                for i in idx:
                    out[i] = DraftOutcome(EMPTY, None, None, True)
                continue
            t_call = time.perf_counter()
            left = None if budget_s is None else budget_s - (t_call - t0)
            res = self._call(proposer, [items[i] for i in idx], left)
            if all(isinstance(r, DraftError) for r in res):
                wasted += time.perf_counter() - t_call
            for i, r in zip(idx, res):
                out[i] = self._outcome(items[i], r)
        return DraftRound(out, wasted, uploaded)

    def _call(self, proposer: Proposer, items: list[DraftItem], budget_s: float | None
              ) -> list[Proposal | DraftError]:
        """One draft call for ``items``; the sessions it started from a cached prefix that
        the drafter does not hold (or, predating prefixes, answers with a gap) are resent in
        full by a second call, at once (never raises)."""
        prefixed = [it.state.prefix[1] if it.state.from_prefix and it.state.prefix else 0
                    for it in items]
        res = self._propose(proposer, items, budget_s)
        again = [j for j, r in enumerate(res) if prefixed[j] and isinstance(r, DraftError)
                 and r.reason in (FallbackReason.PREFIX_MISS, FallbackReason.CONTEXT_GAP)]
        for j, r in enumerate(res):
            if prefixed[j] and isinstance(r, Proposal):
                self.prefixes.hits += 1
                self.prefixes.hit_tokens += prefixed[j]
        if again:
            log.info("%d session(s): the drafter holds no cached prefix for them; uploading "
                     "their whole context", len(again))
            self.prefixes.misses += len(again)
            for j in again:
                items[j].state.reset()
            for j, r in zip(again, self._propose(proposer, [items[j] for j in again], None)):
                res[j] = r
        return res

    def _propose(self, proposer: Proposer, items: list[DraftItem], budget_s: float | None
                 ) -> list[Proposal | DraftError]:
        reqs = [self._request(it, it.k + 1) for it in items]
        try:
            if isinstance(proposer, DeadlineProposer):
                return proposer.propose_within(reqs, budget_s, self._resend_on_failure(
                    items, "late draft"))
            return proposer.propose(reqs)
        except Exception as e:  # the drafter must never fail the request
            return [DraftError(FallbackReason.EXCEPTION, repr(e))] * len(reqs)

    def _outcome(self, it: DraftItem, r: Proposal | DraftError) -> DraftOutcome:
        """One item's drafts from its call's result, and what its drafter now holds."""
        reason = self.malformed(r, it.k, it.top_k if it.k else 0)
        if reason:
            log.info("session %s: drafter fallback (%s)", it.session_id, reason)
            if reason == LATE:   # still queued on the drafter: its context lands there
                it.state.length = it.cached
            else:
                it.state.reset()  # resend the whole context once the drafter is healthy
            it.state.prefix = None
            return DraftOutcome(EMPTY, None, reason if it.k else None, True)
        assert isinstance(r, Proposal)     # malformed() found nothing wrong
        it.state.length = it.cached
        it.state.prefix = None
        return DraftOutcome(r.tokens, r.probs, None, True, top_ids=r.top_ids,
                            top_logprobs=r.top_logprobs)

    def _resend_on_failure(self, items: list[DraftItem], what: str) -> Callable[[list[str]], None]:
        """The callback for sessions whose unawaited call (``what``) failed on the drafter (any
        thread): the next step resends their whole context, unless a reset since made it moot."""
        epochs = {it.session_id: it.state.epoch for it in items}

        def failed(ids: list[str]) -> None:
            log.info("%s failed for %d session(s); resending", what, len(ids))
            with self._lock:
                self._failed.update((i, epochs[i]) for i in ids if i in epochs)

        return failed

    @staticmethod
    def _request(it: DraftItem, block_size: int) -> ProposalRequest:
        start, key = it.state.length, b""
        if it.state.from_prefix and it.state.prefix is not None:
            key, start = it.state.prefix
        context = it.state.taps.rows(start)
        return ProposalRequest(session_id=it.session_id, context_start=start, prefix_key=key,
                               context=context, anchor_token=it.anchor,
                               block_size=block_size, sampling=it.sampling,
                               trace_context=it.trace_context,
                               top_k=it.top_k if block_size > 1 else 0,   # nothing to rank
                               no_learn=it.no_learn,
                               context_ids=_context_ids(it, start, int(context.shape[0])))

    def _send_context(self, proposer: ContextSender, items: list[DraftItem]) -> None:
        """Context-only update nothing this step waits for; the held length advances now."""
        reqs = [self._request(it, 1) for it in items]
        failed = self._resend_on_failure(items, "context update")
        try:
            proposer.send_context(reqs, failed)
        except Exception as e:  # the drafter must never fail the request
            log.info("context update raised %r; resending", e)
            failed([r.session_id for r in reqs])
        for it in items:
            it.state.length = it.cached

    def malformed(self, res: Proposal | DraftError, k: int, top_k: int = 0) -> str | None:
        """Why ``res`` is not ``k`` usable drafts (:func:`verifier_svc.draft_checks.malformed`)."""
        return malformed(res, k, self.vocab_size, top_k)


def _context_ids(it: DraftItem, start: int, n: int) -> tuple[int, ...]:
    """The ids of positions ``[start, start + n)`` for ``ProposalRequest.context_ids``: the
    committed tokens, -1 for the request's prompt (its ids never reach a drafter); () when the
    item carries no tokens."""
    if not it.tokens:
        return ()
    lo = min(max(start, it.prompt_len), start + n)
    return (-1,) * (lo - start) + tuple(it.tokens[lo:start + n])
