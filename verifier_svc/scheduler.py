"""Continuous batching: one scheduler thread owns the decode loop of every running request.

Each iteration, between steps:

1. requests that were cancelled (the client went away) or closed (the reader stopped) leave
   the batch; a cancelled one gets a last ``finish="cancelled"`` event;
2. waiting requests are prefilled, at most ``prefill_chunk`` prompt tokens per iteration in
   all (long prompts take several iterations), so a new prompt never stalls the running
   sessions for more than one chunk; a request joins the batch once its prompt is in;
3. one decode step for the whole batch (``StepRunner.decode_step`` with a :class:`StepPlan`).

The loop never waits for readers: events go to each request's queue and a slow client only
slows itself. A reader that leaves more than ``max_unread`` events unread is cancelled with
:class:`~verifier_svc.request.SlowConsumer`, so a stalled client holds no batch slot (its
session's K/V stays resident until its reader unwinds, when the session is freed).

Admission (:class:`Admission`): the running set is bounded by ``max_batch``; past it requests
wait, at most ``max_waiting`` of them (and, when set, ``max_waiting_tokens`` prompt tokens not
yet prefilled). A request past those bounds is refused at once with :class:`Overloaded` (the
servicer's RESOURCE_EXHAUSTED, with a retry hint) instead of queueing without bound.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from dflash.core.finish import FINISH_CANCELLED
from dflash.core.logits_processors import LogitsProcessor
from dflash.core.speculation import MODE_OFF
from dflash.core.stats import AcceptanceCounter
from dflash.serving.threads import claim
from verifier_svc.request import Request, SlowConsumer, StepEvent
from verifier_svc.sessions import Session

log = logging.getLogger("dflash.verifier.scheduler")

MIN_RETRY_MS = 100        # retry hints are never shorter: a refused client should back off
MAX_RETRY_MS = 30_000


class Overloaded(RuntimeError):
    """Admission refused a request. ``retry_after_ms``: when a retry may be admitted (the
    recent mean queue wait, clamped to [MIN_RETRY_MS, MAX_RETRY_MS])."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(f"{message}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass(frozen=True)
class Admission:
    """Bounds on the requests waiting for a batch slot (``--max-waiting``,
    ``--max-waiting-tokens``).

    ``max_waiting``: requests admitted but not in the batch, beyond the batch's free slots
    (a request that gets a slot at once never counts); >= 0. ``max_waiting_tokens``: prompt
    tokens not yet prefilled over all waiting requests, 0 = unbounded; a request is admitted
    when nothing waits, whatever its length (the context window bounds it).
    Raises ValueError on a negative bound.
    """

    max_waiting: int = 256
    max_waiting_tokens: int = 0

    def __post_init__(self):
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if self.max_waiting_tokens < 0:
            raise ValueError(f"max_waiting_tokens: must be >= 0, got {self.max_waiting_tokens}")


@dataclasses.dataclass(eq=False)
class Job:
    """One request inside the scheduler (decode state filled in by ``StepRunner.start_job``)."""

    req: Request
    session: Session
    cancelled: Callable[[], bool]
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    closed: bool = False                     # the reader is gone: drop without an event
    gone: threading.Event = dataclasses.field(default_factory=threading.Event)
    started: bool = False
    reuse: int = 0                           # prompt positions reused from the session's cache
    shared: int = 0                          # prompt positions copied from a group's session
    prefilled: int = 0
    prefill_seconds: float = 0.0
    gen: torch.Generator | None = None
    processor: LogitsProcessor | None = None  # the request's penalties; None: none asked
    stops: frozenset[int] = frozenset()
    stats: AcceptanceCounter = dataclasses.field(default_factory=AcceptanceCounter)
    mode: str = MODE_OFF                     # speculation mode of this request
    block_limit: int = 1                     # largest block (anchor + drafts) it may verify
    tree_budget: int = 0                     # largest tree (nodes) it may verify; 0: chains only
    suffix_limit: int = 0                    # deepest suffix candidate it may verify; 0: none
    emitted: int = 0
    steps: int = 0                           # decode steps so far
    submitted: float = 0.0                   # time.monotonic() at admission


def _unprefilled(job: Job) -> int:
    return len(job.req.prompt) - job.prefilled


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One decode step's make-up."""

    jobs: list[Job]                          # the batch, in the order of its events
    waiting: int = 0                         # prompts waiting for prefill behind this step
    fresh_cycle: bool = False                # a prefill chunk ran or the loop was idle since
                                             # the last step: this cycle is not a step's cost


class StepRunner(Protocol):
    """What the scheduler drives (``verifier_svc.engine.VerifierEngine``)."""

    threads: int

    def start_job(self, job: Job) -> None: ...

    def prefill_chunk(self, job: Job, budget: int) -> StepEvent | None: ...

    def decode_step(self, plan: StepPlan) -> list[StepEvent]: ...

    def notify(self, job: Job, ev: StepEvent) -> None: ...


class Scheduler:
    """The decode-loop thread of a step runner.

    Args:
        runner: provides ``start_job``, ``prefill_chunk``, ``decode_step`` and ``notify``.
        prefill_chunk: prompt tokens prefilled per iteration, over all waiting requests.
        max_batch: sessions per decode step (the rest wait their turn, oldest first).
        max_unread: events a reader may leave unread before its request is cancelled.
        admission: bounds on waiting requests (may be replaced before requests arrive).

    ``queue_wait_listeners`` are called with each request's queue wait in seconds (admission
    to its first prefill chunk; on the scheduler thread); ``refused`` counts refusals by reason.
    """

    QUEUE_WAIT_EMA = 0.2      # weight of the newest queue wait in the retry hint

    def __init__(self, runner: StepRunner, *, prefill_chunk: int = 256, max_batch: int = 64,
                 max_unread: int = 4096, admission: Admission | None = None):
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.max_unread = max_unread
        self.admission = admission or Admission()
        self.queue_wait_listeners: list[Callable[[float], None]] = []
        self.refused: dict[str, int] = {"max_waiting": 0, "max_waiting_tokens": 0}
        self._queue_wait_ema = 0.0
        self._cv = threading.Condition()
        self._incoming: list[Job] = []
        self._waiting: list[Job] = []        # prefilling, oldest first
        self._running: list[Job] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self._idle = True                    # nothing ran since the loop last waited
        self._calls: list[tuple[Callable[[], object], Future]] = []   # run_on_loop

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests admitted and not in the batch yet (vLLM's ``num_requests_waiting``)."""
        with self._cv:
            return len(self._incoming) + len(self._waiting)

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting requests not prefilled yet."""
        with self._cv:
            return sum(map(_unprefilled, self._incoming + list(self._waiting)))

    def check_admission(self, prompt_tokens: int) -> None:
        """Raise :class:`Overloaded` if a request of ``prompt_tokens`` would be refused now
        (``submit`` decides; this lets a caller refuse before touching a session)."""
        with self._cv:
            refusal = self._admit_locked(prompt_tokens)
        if refusal is not None:
            raise refusal

    def _admit_locked(self, prompt_tokens: int) -> Overloaded | None:
        """Why a request of ``prompt_tokens`` cannot wait now (None: admitted). The loop thread
        shrinks ``_waiting`` and grows ``_running`` outside the lock, so a count read here is at
        worst one iteration old: a refusal near the bound is conservative, never an excess."""
        a = self.admission
        waiting = list(self._incoming) + list(self._waiting)
        free = max(0, self.max_batch - len(self._running))
        if len(waiting) - free >= a.max_waiting:
            return self._overloaded("max_waiting",
                                    f"{len(waiting)} requests waiting (max_waiting {a.max_waiting}, "
                                    f"max_batch {self.max_batch})")
        if a.max_waiting_tokens and waiting:
            tokens = sum(map(_unprefilled, waiting))
            if tokens + prompt_tokens > a.max_waiting_tokens:
                return self._overloaded(
                    "max_waiting_tokens", f"{tokens} prompt tokens waiting for prefill "
                    f"(max_waiting_tokens {a.max_waiting_tokens})")
        return None

    def _overloaded(self, reason: str, detail: str) -> Overloaded:
        self.refused[reason] += 1
        ms = int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, 1e3 * self._queue_wait_ema)))
        return Overloaded(f"verifier overloaded: {detail}", ms)

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="verifier-scheduler")
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` for its prefill; a refusal (:class:`Overloaded`, or the loop stopped)
        is the job's only event."""
        with self._cv:
            if self._stop:
                self._fail(job, RuntimeError("verifier engine stopped"))
                return
            refusal = self._admit_locked(len(job.req.prompt))
            if refusal is not None:
                self._fail(job, refusal)
                return
            job.submitted = time.monotonic()
            self._start_locked()
            self._incoming.append(job)
            self._cv.notify()

    def run_on_loop(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the scheduler thread (the one that owns the torch threads and runs
        every forward) between iterations; returns its result or raises its exception."""
        fut: Future = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("verifier engine stopped")
            self._start_locked()
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result()

    def wait_gone(self, job: Job) -> None:
        """Block until the scheduler no longer touches ``job`` (its session is free)."""
        with self._cv:
            self._cv.notify()
        while not job.gone.wait(0.5):
            if self._thread is None or not self._thread.is_alive():
                return

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        if self.runner.threads:
            claim(self.runner.threads)       # the one thread that runs forwards multi-threaded
        while True:
            with self._cv:
                while not (self._incoming or self._waiting or self._running or self._stop
                           or self._calls):
                    self._idle = True
                    self._cv.wait()
                if self._stop:
                    for j in self._incoming + self._waiting + self._running:
                        self._fail(j, RuntimeError("verifier engine stopped"))
                    for _, fut in self._calls:
                        fut.set_exception(RuntimeError("verifier engine stopped"))
                    self._incoming, self._waiting, self._running, self._calls = [], [], [], []
                    return
                self._waiting += self._incoming
                self._incoming = []
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
            if calls and not (self._waiting or self._running):
                continue
            try:
                self._iteration()
            except Exception as e:  # a failed forward fails the requests in it, not the loop
                log.exception("scheduler iteration failed")
                for j in self._waiting + self._running:
                    self._fail(j, e)
                self._waiting, self._running = [], []

    def _iteration(self) -> None:
        self._waiting = [j for j in self._waiting if self._keep(j)]
        self._running = [j for j in self._running if self._keep(j)]
        budget = self.prefill_chunk
        fresh = bool(self._waiting) or self._idle
        self._idle = False
        while self._waiting and budget > 0 and len(self._running) < self.max_batch:
            job = self._waiting[0]
            if not job.started:
                self._queue_wait(time.monotonic() - job.submitted)
                self.runner.start_job(job)
                job.started = True
            before = job.prefilled
            ev = self.runner.prefill_chunk(job, budget)
            budget -= job.prefilled - before
            if ev is None:
                break  # a long prompt: its next chunk after the running sessions' next step
            self._waiting.pop(0)
            if self._emit(job, ev) and not ev.finish:
                self._running.append(job)
        if self._running:
            jobs = list(self._running)
            events = self.runner.decode_step(StepPlan(jobs=jobs, waiting=len(self._waiting),
                                                      fresh_cycle=fresh))
            if len(events) != len(jobs):   # a reader without its event would wait forever
                raise RuntimeError(f"decode_step returned {len(events)} events for {len(jobs)} jobs")
            kept = [job for job, ev in zip(jobs, events) if self._emit(job, ev) and not ev.finish]
            self._running = kept

    def _queue_wait(self, seconds: float) -> None:
        self._queue_wait_ema += self.QUEUE_WAIT_EMA * (seconds - self._queue_wait_ema)
        for listener in self.queue_wait_listeners:
            try:
                listener(seconds)
            except Exception:  # observers never fail a request
                log.exception("queue wait listener failed")

    def _keep(self, job: Job) -> bool:
        if job.closed:
            job.gone.set()
            return False
        try:
            cancelled = job.cancelled()
        except Exception:
            cancelled = True
        if cancelled:
            self._emit(job, StepEvent(tokens=[], finish=FINISH_CANCELLED, stats=job.stats))
            return False
        return True

    def _emit(self, job: Job, ev: StepEvent) -> bool:
        """Queue ``ev`` for the reader; False when the job leaves (finished, or too far behind)."""
        if job.closed:
            job.gone.set()
            return False
        if job.events.qsize() >= self.max_unread and not ev.finish:
            log.warning("request %s: %d events unread; cancelled", job.req.request_id,
                        job.events.qsize())
            self._fail(job, SlowConsumer(f"the client read none of the last {self.max_unread} "
                                         "events; request cancelled"))
            return False
        try:
            self.runner.notify(job, ev)
        except Exception:  # observers never fail a request
            log.exception("step listener failed")
        job.events.put(ev)
        if ev.finish:
            job.gone.set()
            return False
        return True

    @staticmethod
    def _fail(job: Job, e: BaseException) -> None:
        job.events.put(e)
        job.gone.set()
