"""The verifier engine: sessions and the speculative decode step (prefill: ``prefill.py``).

Pure torch/Python (no protobuf). The step follows z-lab/dflash ``dflash_generate`` (the
conventions: docs/architecture.md, "DFlash semantics") and reads like gpt-fast's
``speculative_decode``:

    choose k (policy) -> propose (drafter_sync; the tree or chain: proposals) -> forward (target)
    -> verify (verification) -> commit (crop the KV cache, keep the taps, stop/length: commit)
    -> feed the policy (commit)

for every running session at once (continuous batching: ``verifier_svc/scheduler.py`` says
which, the loop of ``verifier_svc/core.py`` runs it), one ``StepRow`` per session: one
drafter call per drafter, one target forward over every session's block on the persistent
batch KV pool (``dflash/core/kv_pool.py``). With speculation off, or when the drafter fails, the
same step runs with ``k = 0`` (plain autoregressive decoding): the baseline every benchmark
compares against, and the fallback that keeps a drafter failure from ever failing a request.

A request's penalties and logit bias (``dflash.core.logits_processors``) are applied to the target's
logits of every verified row, each with the state its own path implies, before verification
(and to the first token after prefill); the state advances as tokens commit. Requests without
them skip this entirely. Log-probabilities, when asked, come from the raw logits of the rows that
emitted the committed tokens. A request's grammar (``dflash.core.grammar``; docs/structured-outputs.md)
prunes its drafts before the forward, adds the tokens it forces as drafts
(``verifier_svc.grammar_rows``), and masks every verified row after the penalties, each with
its own path's grammar state; its matcher advances as tokens commit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator

import torch

from dflash.core.cards import check_drafter_card
from dflash.core.finish import FINISH_CANCELLED
from dflash.core.grammar import GrammarCache, GrammarTokenizer
from dflash.core.logits_processors import LogitsProcessor
from dflash.core.sampling import InvalidParam
from dflash.core.speculation import MAX_TREE_BUDGET, SpecMode
from dflash.core.stats import AcceptanceCounter
from verifier_svc.commit import commit_row, log_step, step_feedback
from verifier_svc.core import EngineCore
from verifier_svc.decode_state import DecodeState, StepRow, StepTiming
from verifier_svc.drafter_sync import DrafterSync
from verifier_svc.engine_gauges import EngineGauges
from verifier_svc.grammar_rows import GrammarTime, constrain, plan_forced
from verifier_svc.policy import (
    DEFAULT_TREE_BUDGET,
    DEFAULT_TREE_BUDGETS,
    DEFAULT_TREE_MAX_BATCH,
    SpeculationPolicy,
)
from verifier_svc.prefill import common_prefix, prefill_chunk, share_prefix, speculation_limits
from verifier_svc.prefix_cache import PrefixCache
from verifier_svc.prefix_reuse import checkout_pin, keep_drafter_context, keep_finished, take_cached
from verifier_svc.proposals import draft_item, sourced, suffix_offers
from verifier_svc.request import MAX_BLOCK_SIZE, PreconditionError, Request, SlowConsumer, StepEvent, validate
from verifier_svc.scheduler import Admission, Job, Scheduler, StepPlan
from verifier_svc.sessions import Session, SessionStore
from verifier_svc.suffix_drafts import AnswerStore, SuffixCalibration, SuffixOffer
from verifier_svc.target_protocol import Target
from verifier_svc.tree import verify_trees
from verifier_svc.verification import RowParams, verify_batch

__all__ = ["VerifierEngine", "Request", "StepEvent", "PreconditionError", "SlowConsumer",
           "check_drafter_card", "MAX_BLOCK_SIZE", "InvalidParam", "Target"]


class VerifierEngine(EngineGauges):
    """Owns the target, the sessions and the decode step.

    Args:
        target: the loaded target model.
        session_ttl_s: idle sessions are dropped after this many seconds.
        max_sessions: bound on kept sessions (least recently used dropped first).
        spec_mode: default speculation mode (one of ``dflash.core.speculation.MODES``;
            ``verifier_svc.policy``; the services default to adaptive, ``--spec-mode``).
        tree_budget: nodes of a tree in mode "tree" when the request names none (``--tree-budget``).
        tree_max_batch: adaptive steps of more sessions verify chains only (``--tree-max-batch``;
            0: any batch).
        tree_budgets: budgets the adaptive policy may try as trees (``--tree-budgets``; empty:
            chains only). Trees need a target with ``supports_trees``.
        mode_race: adaptive races whole modes per batch bucket (``--mode-race``; the services
            default to on; ``verifier_svc.mode_race``).
        admission: bounds on waiting requests (``verifier_svc.scheduler.Admission``; default
            its defaults).
        answers: recent answers per tenant for suffix candidates (``verifier_svc.suffix_drafts.
            AnswerStore``; default its defaults; ``AnswerStore(0)``: none kept).
        suffix: whether steps may verify suffix candidates at all (``--suffix``; needs a
            target with ``supports_trees``).
        prefill_chunk: prompt tokens prefilled between two decode steps of the running batch.
        max_batch: sessions verified per step.
        context_flush: ``verifier_svc.drafter_sync.DrafterSync``. Raises ValueError below 1.
        max_unread: events a reader may leave unread before its request is cancelled.
        prefix_cache: finished requests' K/V kept for later prompts that start the same way,
            per tenant (``verifier_svc.prefix_cache``; sessions wait there between turns,
            pinned); None = none kept (``--prefix-cache off``), and always None on a target
            without ``supports_fork``.
        grammars: the compiled-grammar cache of structured requests; None: built on the first
            such request from the tokenizer in the target's directory (``target.path``).
        threads: torch threads of the scheduler thread, which runs every forward; it then is
            the process's only multi-threaded torch thread (``dflash.serving.threads.claim``; the
            service calls ``dflash.serving.threads.reserve`` at start). 0 = leave torch's threads alone.
    """

    def __init__(self, target: Target, *, session_ttl_s: float = 600.0, max_sessions: int = 256,
                 spec_mode: str = SpecMode.FIXED, prefill_chunk: int = 256, max_batch: int = 64,
                 context_flush: int = 8, max_unread: int = 4096, threads: int = 0,
                 tree_budget: int = DEFAULT_TREE_BUDGET, tree_budgets: tuple[int, ...] = DEFAULT_TREE_BUDGETS,
                 tree_max_batch: int = DEFAULT_TREE_MAX_BATCH, mode_race: bool = False,
                 admission: Admission | None = None,
                 answers: AnswerStore | None = None, suffix: bool = True,
                 prefix_cache: PrefixCache | None = None, grammars: GrammarCache | None = None):
        if not 1 <= tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget: must be in [1, {MAX_TREE_BUDGET}], got {tree_budget}")
        if any(not 1 <= n <= MAX_TREE_BUDGET for n in tree_budgets):
            raise ValueError(f"tree_budgets: each must be in [1, {MAX_TREE_BUDGET}], got {list(tree_budgets)}")
        self.target = target
        self.threads = threads
        self.sync = DrafterSync(target.vocab_size, context_flush)
        self.spec_mode = spec_mode
        self.tree_budget = tree_budget
        self.trees = target.supports_trees
        self.policy = SpeculationPolicy(spec_mode, tree_budgets=tree_budgets if self.trees else (),
                                        tree_max_batch=tree_max_batch, race=mode_race)
        self.scheduler = Scheduler(prefill_chunk=prefill_chunk, max_batch=max_batch,
                                   max_unread=max_unread, admission=admission)
        self.core = EngineCore(self.scheduler, self)
        self._sessions = SessionStore(target.new_cache, self._dropped, max_sessions=max_sessions,
                                      ttl_s=session_ttl_s)
        self.totals = AcceptanceCounter()
        self.prefix_cache = prefix_cache if target.supports_fork else None
        self.suffix = suffix and self.trees
        self.answers = answers if answers is not None else AnswerStore()
        self.suffix_calibration = SuffixCalibration()
        self.suffix_lookup_seconds = 0.0     # summed over steps (metrics: per-step cost)
        self.suffix_lookups = 0
        self.grammar_time = GrammarTime()    # decode steps' seconds on grammars (metrics)
        self.step_listeners: list[Callable[[Request, StepEvent], None]] = []
        self._last_cycle_end = 0.0           # for the policy's per-cycle overhead
        self._grammars = grammars

    # ------------------------------------------------------------------ sessions
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def close_session(self, sid: str) -> bool:
        """Drop a session on the verifier and its drafter. Returns whether it existed."""
        return self._sessions.close(sid)

    def expire_sessions(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; returns how many."""
        return self._sessions.expire(now)

    def _dropped(self, s: Session) -> None:
        self.sync.release(s.id, s.drafter)
        pin, s.pin = s.pin, None
        if pin is not None and self.prefix_cache is not None:
            self.prefix_cache.unpin(pin)     # the entry stays, now evictable

    def validate(self, req: Request) -> None:
        """Raise InvalidParam naming the field for a request that cannot run (a grammar is
        compiled here, on the caller's thread, so its errors come before the first event)."""
        validate(req, self.target.vocab_size, self.target.max_positions)
        if req.grammar is not None:
            self.grammars.compile(req.grammar)

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache (built on first use; PreconditionError naming
        ``structured_output`` for a target without a tokenizer in its directory)."""
        if self._grammars is None:
            path = self.target.path
            if not (path / "tokenizer.json").exists():
                raise PreconditionError("structured_output", "this target has no tokenizer for grammars")
            tok = GrammarTokenizer.from_dir(path, self.target.vocab_size, sorted(self.target.eos_token_ids))
            self._grammars = GrammarCache(tok)
        return self._grammars

    # ------------------------------------------------------------------ the thread bridge
    def generate(self, req: Request, cancelled: Callable[[], bool] = lambda: False
                 ) -> Generator[StepEvent, None, None]:
        """Run one request; yields one StepEvent per step, the last with ``finish`` set.

        The request joins the scheduler's batch after its prefill; this generator only reads
        its events, buffered by the scheduler (which never waits for it). ``req.session_id``
        empty = a one-shot session freed at the end. A cancelled or closed request leaves the
        batch between steps and frees its session on verifier and drafter.

        Raises InvalidParam / PreconditionError before the first event, SlowConsumer when the
        caller fell too far behind.
        """
        self.validate(req)
        sid = req.session_key
        session = self._sessions.get(sid)
        if not session.busy.acquire(blocking=False):
            raise PreconditionError("session_id", f"session {sid!r} is already generating")
        job = Job(req=req, decode=DecodeState(req=req, session=session), cancelled=cancelled)
        finished = False
        try:
            self.core.submit(job)
            while True:
                item = job.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish:
                    # a cancelled turn may have left part of its prompt in the cache: drop it
                    finished = item.finish != FINISH_CANCELLED
                    return
        finally:
            job.closed = True
            self.core.wait_gone(job)
            if finished and (req.session_id or self.prefix_cache is not None):
                entry = None
                with self.target.lock:
                    self.target.own(session.cache)   # kept for the next turn, out of the batch
                    if self.prefix_cache is not None:
                        entry = keep_finished(session, req, self.target, self.prefix_cache,
                                              pin=bool(req.session_id))
                if entry is not None:    # its drafter keeps the context too (before the release)
                    keep_drafter_context(session, req, entry)
                if session.pin is not None and sid not in self._sessions:
                    self._dropped(session)           # closed while it finished: no pin left
            session.busy.release()
            session.last_used = time.monotonic()
            if not req.session_id or not finished:
                self.close_session(sid)

    def notify(self, req: Request, ev: StepEvent) -> None:
        """An event leaves the loop (its thread): step listeners, then the request's trace."""
        if ev.step >= 0:
            for listener in self.step_listeners:
                listener(req, ev)
        if req.trace is not None:
            req.trace.event(req, ev)

    def run_on_loop(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the loop's thread, which runs every forward (``EngineCore.run_on_loop``)."""
        return self.core.run_on_loop(fn)

    # ------------------------------------------------------------------ prefill
    def start(self, st: DecodeState) -> int:
        """Set up a request's decode state before its first prefill chunk (the loop's thread);
        returns the prompt positions its session's cache already holds."""
        s, req, t = st.session, st.req, self.target
        if self.prefix_cache is not None:
            checkout_pin(s, self.prefix_cache)
        taps_usable = self.sync.bind(s.id, s.drafter, req.proposer)
        reuse = common_prefix(s.tokens, req.prompt) if taps_usable else 0
        st.reuse = st.prefilled = min(reuse, s.cached, len(req.prompt) - 1)
        # on the target's device: its noise is drawn where the logits are (a CPU generator
        # fails a CUDA sample at prefill, and draws [k + 1, V] noise on the host per step)
        st.gen = req.sampling.generator(t.device)
        st.processor = _processor(req, t.vocab_size) if req.sampling.penalised else None
        st.grammar = self.grammars.state(req.grammar) if req.grammar is not None else None
        st.stops = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else t.eos_token_ids)
        st.mode, st.block_limit, st.tree_budget, st.suffix_limit = speculation_limits(
            req, self.spec_mode, trees=self.trees, suffix=self.suffix, tree_budget=self.tree_budget,
            tree_budgets=self.policy.tree_budgets)
        s.prefix_group = ""                  # this turn changes the cache: lends nothing now
        with t.lock:
            t.crop(s.cache, st.reuse)
        self.sync.truncate(s.drafter, st.reuse)
        share_prefix(st, t, self._sessions.values())
        if self.prefix_cache is not None:
            take_cached(st, t, self.prefix_cache)
        if req.trace is not None:
            req.trace.prefill_started()
        return st.prefilled

    def prefill_chunk(self, st: DecodeState, budget: int) -> StepEvent | None:
        """Prefill up to ``budget`` prompt tokens; the first token's event once the prompt is in
        (``verifier_svc.prefill.prefill_chunk``)."""
        return prefill_chunk(st, self.target, budget, suffix=self.suffix)

    # ------------------------------------------------------------------ one decode step
    def decode_step(self, plan: StepPlan) -> list[StepEvent]:
        """One speculative step for every job of ``plan``: one drafter call per drafter, one
        target forward, one batched verification; returns one event per job, in order."""
        t = self.target
        states = [j.decode for j in plan.jobs]
        offers = self._offers(states)
        choice = self.policy.choose_shapes(states, plan.waiting, offers)
        rows = [StepRow(st, st.session.cached, sh, o) for st, sh, o in zip(states, choice.shapes, offers)]
        for r in rows:
            plan_forced(r)      # a grammar's forced stretch as deep as the block: no drafter
        items = [draft_item(r) for r in rows]
        td = time.perf_counter()
        # the drafter calls wait no longer than speculating is worth this step
        drafts = self.sync.draft(items, self.policy.draft_budget(states, [r.shape for r in rows],
                                                                 choice.expectations))
        draft_s = time.perf_counter() - td
        for r, d in zip(rows, drafts.outcomes):
            r.draft, r.sourced = d, sourced(r, d, len(rows), self.policy)
            constrain(r)
            r.block = [r.state.session.tokens[-1]] + (r.tree.tokens if r.tree else r.draft.tokens.tolist())

        tv = time.perf_counter()
        with t.lock:
            outs = t.forward_batch([r.block for r in rows], [st.session.cache for st in states],
                                   [st.session.drafter.tap_ids for st in states],
                                   [r.tree.parents if r.tree else None for r in rows]
                                   if any(r.tree is not None for r in rows) else None)
        verify_s = time.perf_counter() - tv
        for r, (logits, taps) in zip(rows, outs):
            r.logits, r.taps = logits, taps

        self._verify(rows)
        timing = StepTiming(draft_s, verify_s, len(rows), choice.decision)
        with t.lock:
            events = [commit_row(r, timing, t, self.totals, suffix=self.suffix, answers=self.answers,
                                 calibration=self.suffix_calibration) for r in rows]
        self.grammar_time.add(rows)
        # a call that uploaded a session's whole context makes the step a join, not a steady
        # step (mode suffix sends nothing, so its sessions join nothing)
        self._feed_policy(plan, drafts.uploaded, rows, events, timing, drafts.wasted_seconds)
        return events

    def _offers(self, states: list[DecodeState]) -> list[SuffixOffer | None]:
        """Each job's suffix candidates this step (``proposals.suffix_offers``), the lookup
        timed for the metrics (None: it may verify none, or none matched)."""
        if not self.suffix or not any(st.suffix_limit for st in states):
            return [None] * len(states)
        t0 = time.perf_counter()
        out = suffix_offers(states, self.answers, self.suffix_calibration)
        self.suffix_lookup_seconds += time.perf_counter() - t0
        self.suffix_lookups += 1
        return out

    @staticmethod
    def _verify(rows: list[StepRow]) -> None:
        """Chains through ``verify_batch``, trees through ``verify_trees``: each row's
        ``verified``, from its logits with its penalties and bias applied (``_processed``)."""
        chains = [r for r in rows if r.tree is None]
        trees = [(r, r.tree) for r in rows if r.tree is not None]
        for r, v in zip(chains, verify_batch([r.draft.tokens for r in chains],
                                             [_processed(r) for r in chains],
                                             [r.draft.probs for r in chains],
                                             [_params(r.state) for r in chains])):
            r.verified = v
        if trees:
            for (r, _), v in zip(trees, verify_trees([tr for _, tr in trees],
                                                     [_processed(r) for r, _ in trees],
                                                     [_params(r.state) for r, _ in trees])):
                r.verified = v

    def _feed_policy(self, plan: StepPlan, joining: bool, rows: list[StepRow],
                     events: list[StepEvent], timing: StepTiming, wasted_s: float) -> None:
        """One observation of this step for the policy (``commit.step_feedback``), with the
        cycle's seconds outside verify and draft since the last step ended."""
        now = time.monotonic()
        last, self._last_cycle_end = self._last_cycle_end, now
        overhead = (None if plan.fresh_cycle or not last
                    else now - last - timing.verify_seconds - timing.draft_seconds)
        fb = step_feedback(plan, joining, rows, events, timing, wasted_s, overhead)
        self.policy.observe(fb)
        log_step(plan, joining, fb, timing)

    def close(self) -> None:
        """Stop the loop's thread (requests still running fail)."""
        self.core.stop()


def _processed(r: StepRow) -> torch.Tensor:
    """The logits ``[block, V]`` row ``r`` verifies: its penalties and bias applied to each row
    with that row's own state (``dflash.core.logits_processors``), then its grammar's masks
    (``r.masks``, each row its own path's), or the raw logits when it has neither."""
    assert r.logits is not None                      # the target's forward ran
    processor, tree = r.state.processor, r.tree
    x = r.logits
    if processor is not None:
        x = (processor.apply(x, tree.tokens, tree.parents) if tree is not None
             else processor.apply(x, r.block[1:]))
    if r.masks is not None:
        t0 = time.perf_counter()
        x = x.float().masked_fill(~r.masks.to(x.device), -math.inf)
        r.grammar_seconds += time.perf_counter() - t0
    return x


def _params(st: DecodeState) -> RowParams:
    return RowParams(st.req.sampling, st.gen, st.stops, st.req.max_tokens - st.emitted,
                     position=len(st.session.tokens))


def _processor(req: Request, vocab_size: int) -> LogitsProcessor:
    """The request's penalty state: a resumed request's last ``resumed`` prompt ids count as
    output already generated, so its penalties continue as on the replica it left."""
    cut = len(req.prompt) - req.resumed
    p = LogitsProcessor(req.sampling, req.prompt[:cut], vocab_size)
    p.commit(req.prompt[cut:])
    return p
