"""The verifier engine: sessions, prefill, the speculative decode loop, commit.

Pure torch/Python (no protobuf). The loop follows z-lab/dflash ``dflash_generate`` (Sec. 1.7 of
shared/reference/dflash.md) with the verification math of ``kernels`` (greedy longest-prefix
acceptance; Leviathan rejection sampling when temperature > 0) and exact stopping:

1. prefill the prompt (reusing the session's cached prefix), sample the first token (the anchor);
2. each step: send the drafter the taps of positions committed since its last step plus the
   anchor; get ``K`` drafts; verify ``[anchor, d_1..d_K]`` in one target forward;
3. commit the accepted drafts plus one bonus/recovered token, cut at EOS / stop ids /
   ``max_tokens``; crop the target KV cache to the committed length; keep their taps.

With speculation off, or when the drafter fails, the same loop runs with ``K = 0`` (plain
autoregressive decoding): the baseline every benchmark compares against, and the fallback that
keeps a drafter failure from ever failing a request.

Many requests share each step (continuous batching, ``verifier_svc/scheduler.py``): one
drafter call per drafter with every session's items, one target forward for every session's
block (``decode_step``); ``K`` per session comes from the speculation policy
(``verifier_svc/policy.py``). A step's ``draft_seconds`` / ``verify_seconds`` are the whole
batch's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

import kernels
from dflash.proposer import DraftError, DrafterCard, Proposal, Proposer, ProposalRequest
from dflash.sampling import InvalidParam, Sampling, probs_from_logits, sample_from
from dflash.stats import AcceptanceCounter
from dflash.tracing import inject_context
from verifier_svc.policy import MODES, Decision, SpeculationPolicy
from verifier_svc.scheduler import Job, Scheduler
from verifier_svc.tap_buffer import TapRows
from verifier_svc.target import TargetModel

log = logging.getLogger("dflash.verifier")
MAX_BLOCK_SIZE = 64


class PreconditionError(RuntimeError):
    """The request or drafter does not fit this target; maps to FAILED_PRECONDITION."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def check_drafter_card(card: DrafterCard, target: TargetModel) -> list[str]:
    """Refuse a drafter that does not fit ``target``; return warnings for soft mismatches.

    Raises PreconditionError naming the field (hidden_size, vocab_size, target_layer_ids,
    block_size, mask_token_id).
    """
    if card.hidden_size != target.hidden_size:
        raise PreconditionError("hidden_size", f"drafter has {card.hidden_size}, target has "
                                f"{target.hidden_size}")
    if card.vocab_size != target.vocab_size:
        raise PreconditionError("vocab_size", f"drafter has {card.vocab_size}, target has "
                                f"{target.vocab_size}")
    if not card.target_layer_ids:
        raise PreconditionError("target_layer_ids", "empty")
    for i in card.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise PreconditionError("target_layer_ids", f"layer id {i} out of range for a "
                                    f"{target.num_layers}-layer target (valid 0..{target.num_layers - 1})")
    if not 1 <= card.block_size <= MAX_BLOCK_SIZE:
        raise PreconditionError("block_size", f"{card.block_size} not in [1, {MAX_BLOCK_SIZE}]")
    if not 0 <= card.mask_token_id < target.vocab_size:
        raise PreconditionError("mask_token_id", f"{card.mask_token_id} outside the vocabulary")
    warnings = []
    if card.target_fingerprint and card.target_fingerprint != target.fingerprint:
        warnings.append(f"target_fingerprint: drafter was built for {card.target_fingerprint}, "
                        f"this target is {target.fingerprint}")
    if card.rope_theta and target.rope_theta and card.rope_theta != target.rope_theta:
        warnings.append(f"rope_theta: drafter {card.rope_theta}, target {target.rope_theta}")
    return warnings


@dataclasses.dataclass(kw_only=True)
class Request:
    """One generation request, validated. ``proposer`` None = speculation off."""

    request_id: str
    session_id: str = ""
    prompt: list[int]
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    proposer: Proposer | None = None
    block_size: int = 0                 # 0 = the drafter's block size
    spec_mode: str = ""                 # "" = the engine's; "off" | "fixed" | "adaptive"


@dataclasses.dataclass(kw_only=True)
class StepEvent:
    """What one step committed. ``finish`` is set on the last event."""

    tokens: list[int]
    accepted: int = 0
    drafted: int = 0
    finish: str | None = None          # "length" | "stop" | "cancelled"
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback: str | None = None        # reason this step ran without speculation
    stats: AcceptanceCounter | None = None   # the request's counts so far (same object each step)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0      # prompt tokens reused from the session's KV cache
    batch_size: int = 1                # sessions verified in this step's target forward
    policy: Decision | None = None     # the speculation policy's choice for this step


@dataclasses.dataclass
class Session:
    """State kept between steps and turns, keyed by session id."""

    id: str
    cache: object
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + emitted
    taps: TapRows = dataclasses.field(default_factory=TapRows)   # rows for cached positions
    tap_ids: tuple[int, ...] = ()
    drafter: Proposer | None = None
    drafter_len: int = 0               # context positions the drafter holds
    drafter_epoch: int = 0             # bumped by reset_drafter: older async failures are moot
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def reset_drafter(self) -> None:
        """The drafter holds none of this session's context now: the next call resends it all."""
        self.drafter_len = 0
        self.drafter_epoch += 1

    def tap_rows(self, start: int) -> torch.Tensor:
        """Taps of positions ``[start, cached)`` (a view; ``TapRows.rows``)."""
        return self.taps.rows(start)


class VerifierEngine:
    """Owns the target, the sessions and the decode loop.

    Args:
        target: the loaded target model.
        session_ttl_s: idle sessions are dropped after this many seconds.
        max_sessions: bound on kept sessions (least recently used dropped first).
        spec_mode: default speculation mode ("off" | "fixed" | "adaptive"; ``verifier_svc.policy``).
        prefill_chunk: prompt tokens prefilled between two decode steps of the running batch.
        max_batch: sessions verified per step.
        context_flush: on steps without speculation, send the drafter a session's context once
            this many rows are unsent (1 = every step). Raises ValueError below 1.
        threads: torch threads of the scheduler thread, which runs every forward; it then is
            the process's only multi-threaded torch thread (``dflash.threads.claim``; the
            service calls ``dflash.threads.reserve`` at start). 0 = leave torch's threads alone.
    """

    def __init__(self, target: TargetModel, *, session_ttl_s: float = 600.0, max_sessions: int = 256,
                 spec_mode: str = "fixed", prefill_chunk: int = 256, max_batch: int = 64,
                 context_flush: int = 8, threads: int = 0):
        self.target = target
        self.threads = threads
        if context_flush < 1:
            raise ValueError(f"context_flush must be >= 1, got {context_flush}")
        self.context_flush = context_flush
        self.spec_mode = spec_mode
        self.policy = SpeculationPolicy(spec_mode)
        self.scheduler = Scheduler(self, prefill_chunk=prefill_chunk, max_batch=max_batch)
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.totals = AcceptanceCounter()
        self.step_listeners: list[Callable[[Request, StepEvent], None]] = []
        self._context_failed: set[tuple[str, int]] = set()   # (session, epoch) of failed
                                                             # async context updates

    # ------------------------------------------------------------------ sessions
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Target KV positions held by all sessions (a metrics gauge)."""
        with self._lock:
            return sum(s.cached for s in self._sessions.values())

    def _session(self, sid: str) -> Session:
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                s = Session(id=sid, cache=self.target.new_cache())
                self._sessions[sid] = s
                self._evict_locked()
            s.last_used = time.monotonic()
            return s

    def close_session(self, sid: str) -> bool:
        """Drop a session on the verifier and its drafter. Returns whether it existed."""
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            return False
        self._release_drafter(s)
        return True

    def expire_sessions(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_used > self.session_ttl_s and not s.busy.locked()]
        return sum(self.close_session(sid) for sid in old)

    def _evict_locked(self) -> None:
        while len(self._sessions) > self.max_sessions:
            idle = [s for s in self._sessions.values() if not s.busy.locked()]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used)
            self._sessions.pop(victim.id)
            self._release_drafter(victim)

    @staticmethod
    def _release_drafter(s: Session) -> None:
        if s.drafter is not None:
            try:
                s.drafter.release([s.id])
            except Exception:  # a drafter failure never fails the verifier
                log.warning("drafter release failed for session %s", s.id, exc_info=True)
            s.drafter = None
            s.reset_drafter()

    # ------------------------------------------------------------------ validation
    def validate(self, req: Request) -> None:
        """Raise InvalidParam naming the field for a request that cannot run."""
        if not req.prompt:
            raise InvalidParam("prompt", "must not be empty")
        if req.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be >= 1, got {req.max_tokens}")
        v = self.target.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < v), None)
        if bad is not None:
            raise InvalidParam("prompt_token_ids", f"token id {bad} outside the vocabulary [0, {v})")
        window = self.target.max_positions
        if len(req.prompt) >= window:
            raise InvalidParam("prompt", f"{len(req.prompt)} tokens do not fit the context window "
                               f"of {window} tokens")
        if len(req.prompt) + req.max_tokens > window:
            raise InvalidParam("max_tokens", f"prompt ({len(req.prompt)}) + max_tokens "
                               f"({req.max_tokens}) exceeds the context window of {window} tokens")
        if req.block_size < 0 or req.block_size > MAX_BLOCK_SIZE:
            raise InvalidParam("block_size", f"must be in [0, {MAX_BLOCK_SIZE}]")
        if req.spec_mode and req.spec_mode not in MODES:
            raise InvalidParam("speculation.mode", f"{req.spec_mode!r} not one of {', '.join(MODES)}")

    # ------------------------------------------------------------------ the loop
    def generate(self, req: Request, cancelled: Callable[[], bool] = lambda: False
                 ) -> Iterator[StepEvent]:
        """Run one request; yields one StepEvent per step, the last with ``finish`` set.

        The request joins the scheduler's batch after its prefill; this generator only reads
        its events (so the caller's thread, and its current trace span, follow the request).
        ``req.session_id`` empty = a one-shot session freed at the end. A cancelled or closed
        request leaves the batch between steps and frees its session on verifier and drafter.
        """
        self.validate(req)
        sid = req.session_id or f"req-{req.request_id}"
        session = self._session(sid)
        if not session.busy.acquire(blocking=False):
            raise PreconditionError("session_id", f"session {sid!r} is already generating")
        job = Job(req=req, session=session, cancelled=cancelled)
        finished = False
        try:
            self.scheduler.submit(job)
            while True:
                self.scheduler.want_next(job, inject_context())   # from the caller's step span
                item = job.events.get()
                if isinstance(item, BaseException):
                    raise item
                ev, notify = item
                if notify:
                    for listener in self.step_listeners:
                        listener(req, ev)
                yield ev
                if ev.finish:
                    finished = True
                    return
        finally:
            job.closed = True
            self.scheduler.wait_gone(job)
            own = getattr(self.target, "own", None)
            if own is not None and req.session_id and finished:
                own(session.cache)     # kept for the next turn: drop views of a batched cache
            session.busy.release()
            session.last_used = time.monotonic()
            if not req.session_id or not finished:
                self.close_session(sid)

    # ------------------------------------------------------------------ one scheduler step
    def start_job(self, job: "Job") -> None:
        """Set up a job's decode state before its first prefill chunk (scheduler thread)."""
        s, req, t = job.session, job.req, self.target
        proposer = req.proposer
        job.tap_ids = tuple(proposer.card.target_layer_ids) if proposer else ()
        if s.drafter is not None and s.drafter is not proposer:
            self._release_drafter(s)
        if job.tap_ids != s.tap_ids:
            s.taps, s.tap_ids = TapRows(), job.tap_ids
            s.reset_drafter()
            reuse = 0  # taps of the cached prefix are for other layers: recompute them
        else:
            reuse = _common_prefix(s.tokens, req.prompt)
        job.reuse = job.prefilled = min(reuse, s.cached, len(req.prompt) - 1)
        job.gen = req.sampling.generator()
        job.stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(t.eos_token_ids))
        job.stats = AcceptanceCounter()
        job.mode = req.spec_mode or self.spec_mode
        job.block_limit = 1
        if proposer is not None and job.mode != "off":
            job.block_limit = min(req.block_size or proposer.card.block_size, proposer.card.block_size)
        with t.lock:
            t.crop(s.cache, job.reuse)
        if job.tap_ids:
            s.taps.truncate(job.reuse)
        s.drafter_len = min(s.drafter_len, job.reuse)

    def prefill_chunk(self, job: "Job", budget: int) -> StepEvent | None:
        """Prefill up to ``budget`` prompt tokens; the first token's event once the prompt is in."""
        s, req, t = job.session, job.req, self.target
        t0 = time.perf_counter()
        end = min(len(req.prompt), job.prefilled + max(budget, 1))
        with t.lock:
            logits, taps = t.forward(req.prompt[job.prefilled:end], s.cache, job.tap_ids,
                                     logits_to_keep=1)         # only the last row is read
        job.prefill_seconds += time.perf_counter() - t0
        if job.tap_ids:
            s.taps.append(taps)
        job.prefilled = end
        if end < len(req.prompt):
            return None
        s.tokens = list(req.prompt)
        first = self._sample(logits[-1:], req.sampling, job.gen)
        s.tokens.append(first)
        job.emitted = 1
        finish = "stop" if first in job.stops else ("length" if req.max_tokens == 1 else None)
        if req.proposer is not None and job.block_limit > 1:
            s.drafter = req.proposer
        return StepEvent(tokens=[first], finish=finish, verify_seconds=job.prefill_seconds,
                         stats=job.stats, prompt_tokens=len(req.prompt),
                         cached_prompt_tokens=job.reuse)

    def decode_step(self, jobs: list["Job"], waiting: int = 0) -> list[StepEvent]:
        """One speculative step for every job: one drafter call per drafter, one target forward.
        ``waiting``: requests whose prompts wait for prefill behind this step (the policy)."""
        t = self.target
        ks = self.policy.choose(jobs, waiting)
        anchors = [j.session.tokens[-1] for j in jobs]
        lens = [j.session.cached for j in jobs]
        # a session whose drafter holds none of its context yet sends its whole prompt this step
        joining = any(j.req.proposer is not None and j.session.drafter is j.req.proposer
                      and j.session.drafter_len == 0 for j in jobs)
        td = time.perf_counter()
        drafted = self._draft_all(jobs, anchors, lens, ks)
        draft_s = time.perf_counter() - td
        blocks = [[a] + d[0] for a, d in zip(anchors, drafted)]
        tv = time.perf_counter()
        with t.lock:
            caches = [j.session.cache for j in jobs]
            tap_ids = [j.tap_ids for j in jobs]
            if hasattr(t, "forward_batch"):
                outs = t.forward_batch(blocks, caches, tap_ids)
            else:  # a target without batching (test doubles): one forward per session
                outs = [t.forward(b, c, ids) for b, c, ids in zip(blocks, caches, tap_ids)]
        verify_s = time.perf_counter() - tv
        if not (waiting or joining):
            # Ramp steps (prompts waiting: no speculation whatever the cells say) and steps that
            # carry a joining session's prompt to the drafter are not what a steady step at this
            # k costs: recorded, they priced k = 0 ~15% above a plain step (c=16 log: (16, 0)
            # cell 217 ms, steady no-speculation steps 185 ms), so adaptive speculated at a
            # load where it lost.
            self.policy.observe_step(len(jobs), max(len(b) for b in blocks) - 1, verify_s,
                                     draft_s if any(d[3] for d in drafted) else 0.0)
        events = []
        verified: dict[str, list[tuple[int, int]]] = {}   # drafter label -> (drafts, accepted)
        for j, block, n, (drafts, probs, fallback, asked), (logits, taps) in zip(
                jobs, blocks, lens, drafted, outs):
            req, s = j.req, j.session
            accepted, out = self._verify(block, logits, probs, req.sampling, j.gen)
            new = out[:accepted + 1]
            finish = None
            for i, tok in enumerate(new):
                if tok in j.stops:
                    new, finish = new[:i + 1], "stop"
                    break
            if j.emitted + len(new) >= req.max_tokens:
                new, finish = new[:req.max_tokens - j.emitted], finish or "length"
            t.crop(s.cache, n + len(new))
            if j.tap_ids:
                s.taps.append(taps[:len(new)])
            s.tokens.extend(new)
            j.emitted += len(new)
            k = len(drafts)
            acc_emitted = min(accepted, len(new))
            j.stats.record(k, acc_emitted)
            j.stats.verify_seconds += verify_s
            j.stats.draft_seconds += draft_s if asked else 0.0
            if fallback:
                j.stats.fallback_steps += 1
            self.totals.record(k, acc_emitted)
            if k and req.proposer is not None:
                verified.setdefault(req.proposer.card.label, []).append((k, acc_emitted))
            events.append(StepEvent(tokens=new, accepted=acc_emitted, drafted=k, finish=finish,
                                    draft_seconds=draft_s if asked else 0.0, verify_seconds=verify_s,
                                    fallback=fallback, stats=j.stats, batch_size=len(jobs),
                                    policy=self.policy.last_decision))
        for label, label_blocks in verified.items():
            self.policy.observe_acceptance(label, label_blocks)
        self.policy.observe_outcome([len(ev.tokens) for ev in events])
        if log.isEnabledFor(logging.DEBUG):
            d = self.policy.last_decision or Decision(mode="", k=-1, batch=len(jobs))
            log.debug("step batch=%d waiting=%d joining=%s k=%d explored=%s expected=%.2f "
                      "committed=%d estimated=%.1fms measured verify=%.1fms draft=%.1fms mode=%s",
                      len(jobs), waiting, joining, d.k, d.explored, d.expected_tokens,
                      sum(len(e.tokens) for e in events), 1e3 * d.cost_seconds,
                      1e3 * verify_s, 1e3 * draft_s, d.mode or "-")
        return events

    def _draft_all(self, jobs, anchors, lens, ks):
        """Per job: (drafts, probs, fallback reason, asked the drafter). One call per drafter.

        A job that speculates asks for ``k + 1``-token blocks (with every context row the
        drafter lacks). A job that does not speculate this step sends its new context only
        (block_size 1) once ``context_flush`` rows are unsent, or whenever its drafter is called
        this step anyway, so the drafter stays (nearly) current at a fraction of the calls, and
        acceptance does not collapse when speculation resumes: the draft request always carries
        the rest. A call without any speculation goes to a remote drafter without waiting for
        its reply (``RemoteProposer.send_context``; ``_send_context``).
        """
        results: list = [([], None, None, False)] * len(jobs)
        with self._lock:
            failed, self._context_failed = self._context_failed, set()
        for j in jobs:   # an earlier context-only update did not land: resend it all
            if (j.session.id, j.session.drafter_epoch) in failed:
                j.session.reset_drafter()
        candidates: dict[int, list[tuple[int, bool, bool]]] = {}   # proposer -> (job, must, may)
        for i, j in enumerate(jobs):
            if j.req.proposer is None or j.session.drafter is not j.req.proposer:
                continue
            room = j.block_limit > 1 and j.req.max_tokens - j.emitted > 1   # could speculate
            unsent = lens[i] - j.session.drafter_len
            must = bool(ks[i]) or (room and unsent >= self.context_flush)
            candidates.setdefault(id(j.req.proposer), []).append((i, must, room and unsent > 0))
        # Once a drafter is called this step, every session with unsent context rides along:
        # the call, not the rows, is the cost (gRPC round trip, one drafter forward), and
        # flushing each session on its own schedule called the drafter on most no-speculation
        # steps of a batch (4 sessions out of phase, flush every 8 rows: ~every other step).
        groups = {p: [i for i, must, may in c if must or may] for p, c in candidates.items()
                  if any(must for _, must, _ in c)}
        for idx in groups.values():
            proposer = jobs[idx[0]].req.proposer
            if not any(ks[i] for i in idx) and hasattr(proposer, "send_context"):
                self._send_context(proposer, [jobs[i] for i in idx], [lens[i] for i in idx])
                for i in idx:
                    results[i] = ([], None, None, True)
                continue
            prs = []
            for i in idx:
                s = jobs[i].session
                start = s.drafter_len
                prs.append(ProposalRequest(
                    session_id=s.id, context_start=start, context=s.tap_rows(start),
                    anchor_token=anchors[i], block_size=ks[i] + 1, sampling=jobs[i].req.sampling,
                    trace_context=jobs[i].trace_context))
            try:
                res = proposer.propose(prs)
            except Exception as e:  # the drafter must never fail the request
                res = [DraftError("exception", repr(e))] * len(prs)
            for i, r in zip(idx, res):
                s, k = jobs[i].session, ks[i]
                reason = self._malformed(r, k)
                if reason:
                    s.reset_drafter()  # resend the whole context once a drafter is healthy again
                    log.info("session %s: drafter fallback (%s)", s.id, reason)
                    results[i] = ([], None, reason if k else None, True)
                else:
                    s.drafter_len = lens[i]
                    results[i] = (r.tokens.tolist(), r.probs, None, True)
        return results

    def _send_context(self, proposer, jobs, lens) -> None:
        """Context-only update of ``jobs`` that nothing this step waits for (a remote drafter).

        ``drafter_len`` advances now; a failed update (reported later by the client's reader
        thread) resets the session's drafter context at the next step (unless it was reset
        since), so its whole context is resent before the drafter drafts for it again; a
        draft request that overtakes the news fails with ``context_gap`` and falls back.
        """
        prs, epochs = [], {}
        for j in jobs:
            epochs[j.session.id] = j.session.drafter_epoch
            start = j.session.drafter_len
            prs.append(ProposalRequest(
                session_id=j.session.id, context_start=start, context=j.session.tap_rows(start),
                anchor_token=j.session.tokens[-1], block_size=1, sampling=j.req.sampling,
                trace_context=j.trace_context))

        def failed(ids: list[str]) -> None:
            log.info("context update failed for %d session(s); resending", len(ids))
            with self._lock:
                self._context_failed.update((i, epochs[i]) for i in ids if i in epochs)

        try:
            proposer.send_context(prs, failed)
        except Exception as e:  # the drafter must never fail the request
            log.info("context update raised %r; resending", e)
            failed([p.session_id for p in prs])
        for j, n in zip(jobs, lens):
            j.session.drafter_len = n

    def close(self) -> None:
        """Stop the scheduler thread (requests still running fail)."""
        self.scheduler.stop()

    def _malformed(self, res: Proposal | DraftError, k: int) -> str | None:
        if isinstance(res, DraftError):
            return res.reason
        v = self.target.vocab_size
        toks = res.tokens
        if toks.dim() != 1 or toks.numel() != k:
            return "malformed_block"
        if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= v):
            return "out_of_vocab"
        if res.probs is not None:
            p = res.probs
            if p.shape != (k, v) or not torch.isfinite(p).all() or (p < 0).any():
                return "malformed_probs"
        return None

    def _verify(self, block: list[int], logits: torch.Tensor, draft_probs: torch.Tensor | None,
                sampling: Sampling, gen: torch.Generator) -> tuple[int, list[int]]:
        """Acceptance for one sequence via the ``kernels`` entry points."""
        k = len(block) - 1
        drafts = torch.tensor([block[1:]], dtype=torch.int64)
        if sampling.greedy:
            acc, out = kernels.greedy_accept(drafts, logits[None])
        else:
            p = probs_from_logits(logits, sampling)[None]                    # [1, K+1, V]
            q = draft_probs[None].float() if draft_probs is not None else \
                torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
            u = torch.rand((1, k), generator=gen)
            e = torch.empty_like(p).exponential_(generator=gen)
            acc, out = kernels.rejection_sample(drafts, q, p, u, e)
        a = int(acc[0])
        return a, out[0, :a + 1].tolist()

    def _sample(self, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        return int(sample_from(probs_from_logits(logits[-1], sampling), gen))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
