"""Continuous batching: one scheduler thread owns the decode loop of every running request.

Each iteration, between steps:

1. requests that were cancelled (the client went away) or closed (the reader stopped) leave
   the batch; a cancelled one gets a last ``finish="cancelled"`` event;
2. waiting requests are prefilled, at most ``prefill_chunk`` prompt tokens per iteration in
   all (long prompts take several iterations), so a new prompt never stalls the running
   sessions for more than one chunk; a request joins the batch once its prompt is in;
3. one decode step for the whole batch (``VerifierEngine.decode_step``): one drafter call per
   drafter with every session's new context features and anchor, one target forward over all
   sessions' blocks.

Events go to each request's queue; ``VerifierEngine.generate`` reads them in the caller's
thread (so per-request listeners and trace spans keep their one-thread-per-request shape).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from dflash.stats import AcceptanceCounter
from dflash.threads import claim

log = logging.getLogger("dflash.verifier.scheduler")


@dataclasses.dataclass(eq=False)
class Job:
    """One request inside the scheduler (decode state filled in by ``VerifierEngine.start_job``)."""

    req: object                              # verifier_svc.engine.Request
    session: object                          # verifier_svc.engine.Session
    cancelled: Callable[[], bool]
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    closed: bool = False                     # the reader is gone: drop without an event
    demand: bool = False                     # the reader waits for the next event
    gone: threading.Event = dataclasses.field(default_factory=threading.Event)
    trace_context: dict = dataclasses.field(default_factory=dict)
    started: bool = False
    tap_ids: tuple[int, ...] = ()
    reuse: int = 0
    prefilled: int = 0
    prefill_seconds: float = 0.0
    gen: torch.Generator | None = None
    stops: set[int] = dataclasses.field(default_factory=set)
    stats: object = None
    mode: str = "fixed"
    block_limit: int = 1
    emitted: int = 0
    emitted_at: float = 0.0                  # monotonic time of the last step event
    turnaround: float = 0.0                  # EWMA seconds from a step event to the next ask


class Scheduler:
    """The decode-loop thread of a ``VerifierEngine``.

    Args:
        engine: provides ``start_job``, ``prefill_chunk`` and ``decode_step``.
        prefill_chunk: prompt tokens prefilled per iteration, over all waiting requests.
        max_batch: sessions per decode step (the rest wait their turn, oldest first).
        demand_wait_s: least time a step waits for readers that have not asked yet.
        max_demand_wait_s: most time a step waits for them; a reader slower than this on
            average (a slow client) is never waited for.

    A reader comes back only after its event went out through gRPC (milliseconds to tens of
    milliseconds under load); a step that left it behind would run the batch as alternating
    singletons (measured on SmolLM2, 2 CPU cores, 2 clients: 11.9 tok/s aggregate vs 12.3 for one).
    So each step waits for each missing reader up to twice its own measured turnaround.
    """

    def __init__(self, engine, *, prefill_chunk: int = 256, max_batch: int = 64,
                 demand_wait_s: float = 0.01, max_demand_wait_s: float = 0.1):
        self.engine = engine
        self.demand_wait_s = demand_wait_s
        self.max_demand_wait_s = max_demand_wait_s
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self._cv = threading.Condition()
        self._incoming: list[Job] = []
        self._waiting: list[Job] = []        # prefilling, oldest first
        self._running: list[Job] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self._last_step_end = 0.0            # for the policy's per-cycle overhead
        self._calls: list[tuple[Callable[[], object], Future]] = []   # run_on_loop

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="verifier-scheduler")
            self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._start_locked()
            self._incoming.append(job)
            self._cv.notify()

    def run_on_loop(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the scheduler thread (the one that owns the torch threads and runs
        every forward) between iterations; returns its result or raises its exception."""
        fut: Future = Future()
        with self._cv:
            self._start_locked()
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result()

    def want_next(self, job: Job, trace_context: dict) -> None:
        """The reader of ``job`` asks for its next event (from its current span).

        A running request takes part in a step only once its reader asked: steps run inside the
        reader's ``next()`` (where its step span is current) and a slow reader is not run ahead.
        """
        with self._cv:
            if job.emitted_at:
                dt = time.monotonic() - job.emitted_at
                job.turnaround = dt if not job.turnaround else 0.7 * job.turnaround + 0.3 * dt
            job.trace_context = trace_context
            job.demand = True
            self._cv.notify()

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
        if getattr(self.engine, "threads", 0):
            claim(self.engine.threads)       # the one thread that runs forwards multi-threaded
        while True:
            with self._cv:
                while not (self._incoming or self._waiting or self._stop or self._calls
                           or any(j.demand or j.closed for j in self._running)):
                    if not self._running:          # idle, not just waiting for a reader:
                        self._last_step_end = 0.0  # the next cycle is not a per-step cost
                    self._cv.wait()
                if self._stop:
                    for j in self._incoming + self._waiting + self._running:
                        self._fail(j, RuntimeError("verifier engine stopped"))
                    for _, fut in self._calls:
                        fut.set_exception(RuntimeError("verifier engine stopped"))
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
        prefilled = bool(self._waiting)
        while self._waiting and budget > 0 and len(self._running) < self.max_batch:
            job = self._waiting[0]
            if not job.started:
                self.engine.start_job(job)
                job.started = True
            before = job.prefilled
            ev = self.engine.prefill_chunk(job, budget)
            budget -= job.prefilled - before
            if ev is None:
                break  # a long prompt: its next chunk after the running sessions' next step
            self._waiting.pop(0)
            job.demand = False          # answered by this event (the reader asks again after it)
            self._emit(job, ev, notify=False)
            if not ev.finish:
                self._running.append(job)
        ready = self._ready()
        if ready:
            events = self.engine.decode_step(ready, len(self._waiting))
            if len(events) != len(ready):   # a reader without its event would wait forever
                raise RuntimeError(f"decode_step returned {len(events)} events for {len(ready)} jobs")
            self._observe_cycle(events, prefilled)
            for job, ev in zip(ready, events):
                self._emit(job, ev, notify=True)
            self._running = [j for j in self._running if not j.gone.is_set()]

    def _observe_cycle(self, events, prefilled: bool) -> None:
        """Tell the policy how long a decode cycle took outside verify and draft (cycles with a
        prefill chunk, or after the loop went idle, are skipped: they are not per-step costs)."""
        now = time.monotonic()
        policy = getattr(self.engine, "policy", None)
        last, self._last_step_end = self._last_step_end, now
        if policy is None or prefilled or not last or not events:
            return
        ev = events[0]
        policy.observe_overhead(now - last - ev.verify_seconds - ev.draft_seconds)

    def _ready(self) -> list[Job]:
        """Running jobs whose readers asked for a step (waiting for stragglers: each missing
        reader up to twice its measured turnaround, all within ``max_demand_wait_s``)."""
        now = time.monotonic()
        deadline = now + self.demand_wait_s
        with self._cv:
            for j in self._running:
                if not j.demand and j.emitted_at and j.turnaround <= self.max_demand_wait_s:
                    deadline = max(deadline, j.emitted_at + 2 * j.turnaround + self.demand_wait_s)
            deadline = min(deadline, now + self.max_demand_wait_s)
            while not all(j.demand for j in self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            ready = [j for j in self._running if j.demand and not j.closed]
            for j in ready:
                j.demand = False
        return ready

    def _keep(self, job: Job) -> bool:
        if job.closed:
            job.gone.set()
            return False
        try:
            cancelled = job.cancelled()
        except Exception:
            cancelled = True
        if cancelled:
            from verifier_svc.engine import StepEvent

            self._emit(job, StepEvent(tokens=[], finish="cancelled",
                                      stats=job.stats or AcceptanceCounter()), notify=False)
            return False
        return True

    @staticmethod
    def _emit(job: Job, ev, *, notify: bool) -> None:
        job.emitted_at = time.monotonic()
        job.events.put((ev, notify))
        if ev.finish:
            job.gone.set()

    @staticmethod
    def _fail(job: Job, e: BaseException) -> None:
        job.events.put(e)
        job.gone.set()
