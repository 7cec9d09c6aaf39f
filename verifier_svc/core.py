"""The engine core: one loop sequences every iteration of the verifier, schedule -> step -> emit.

Like vLLM v1's ``EngineCore``: the scheduler (``verifier_svc.scheduler``) says what runs, the
engine (``verifier_svc.engine``) runs it and returns its events, and this loop hands each event
to its reader and tells the scheduler the outcome. Nothing calls back up:

    leave   (the scheduler drops closed and cancelled jobs; a cancelled one gets its last event)
    prefill (while the scheduler names a job: the engine prefills one chunk of its prompt)
    step    (the scheduler's StepPlan: the engine's decode step, one event per job)
    emit    (listeners and the trace, then the reader's queue; the scheduler learns who stays)

The loop runs on one thread, the process's only multi-threaded torch thread
(``dflash.serving.threads.claim``), which also runs :meth:`EngineCore.run_on_loop` calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from dflash.core.finish import FINISH_CANCELLED
from dflash.serving.threads import claim
from verifier_svc.decode_state import DecodeState
from verifier_svc.request import Request, StepEvent
from verifier_svc.scheduler import Job, Scheduler, StepPlan

log = logging.getLogger("dflash.verifier.scheduler")


class StepRunner(Protocol):
    """What the loop runs (``verifier_svc.engine.VerifierEngine``)."""

    threads: int                        # torch threads of the loop's thread (0: leave them)

    def start(self, state: DecodeState) -> int:
        """Set up a request's decode state; returns the prompt positions already cached."""

    def prefill_chunk(self, state: DecodeState, budget: int) -> StepEvent | None:
        """Prefill up to ``budget`` prompt tokens; the first token's event once all are in."""

    def decode_step(self, plan: StepPlan) -> list[StepEvent]:
        """One decode step of ``plan``'s jobs: one event per job, in order."""

    def notify(self, req: Request, ev: StepEvent) -> None:
        """An event leaves the loop (listeners, the request's trace)."""


class EngineCore:
    """The loop thread over ``scheduler`` and ``runner`` (started by the first request)."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner):
        self.scheduler, self.runner = scheduler, runner
        self._cv = scheduler.cv
        self._thread: threading.Thread | None = None
        self._stop = False
        self._calls: list[tuple[Callable[[], object], Future]] = []   # run_on_loop

    # ------------------------------------------------------------------ other threads
    def submit(self, job: Job) -> None:
        """Queue ``job``; a refusal (:class:`~verifier_svc.scheduler.Overloaded`, or the loop
        stopped) is the job's only event."""
        with self._cv:
            if self._stop:
                Scheduler.fail(job, RuntimeError("verifier engine stopped"))
            elif self.scheduler.admit(job):
                self._start_locked()

    def run_on_loop(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the loop's thread (the one that owns the torch threads and runs every
        forward) between iterations; returns its result or raises its exception."""
        fut: Future = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("verifier engine stopped")
            self._start_locked()
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result()

    def wait_gone(self, job: Job) -> None:
        """Block until the loop no longer touches ``job`` (its session is free)."""
        with self._cv:
            self._cv.notify()
        while not job.gone.wait(0.5):
            if self._thread is None or not self._thread.is_alive():
                return

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="verifier-scheduler")
            self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        if self.runner.threads:
            claim(self.runner.threads)       # the one thread that runs forwards multi-threaded
        sched = self.scheduler
        while True:
            with self._cv:
                while not (sched.has_work() or self._stop or self._calls):
                    sched.rest()
                    self._cv.wait()
                if self._stop:
                    for j in sched.drain():
                        Scheduler.fail(j, RuntimeError("verifier engine stopped"))
                    for _, fut in self._calls:
                        fut.set_exception(RuntimeError("verifier engine stopped"))
                    self._calls = []
                    return
                sched.take_incoming()
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
            if calls and not sched.active():
                continue
            try:
                self._iteration()
            except Exception as e:  # a failed forward fails the requests in it, not the loop
                log.exception("scheduler iteration failed")
                sched.fail_all(e)

    def _iteration(self) -> None:
        sched, runner = self.scheduler, self.runner
        for gone in sched.leave():
            self._emit(gone, StepEvent(tokens=[], finish=FINISH_CANCELLED, stats=gone.decode.stats))
        fresh = sched.fresh_cycle()
        budget = sched.prefill_chunk
        while (job := sched.next_prefill(budget)) is not None:
            if not job.started:
                sched.started(job)
                job.prefilled = runner.start(job.decode)
            before = job.prefilled
            ev = runner.prefill_chunk(job.decode, budget)
            job.prefilled = job.decode.prefilled
            budget -= job.prefilled - before
            if ev is None:
                break  # a long prompt: its next chunk after the running sessions' next step
            sched.prefilled(job, joins=self._emit(job, ev) and not ev.finish)
        plan = sched.plan(fresh)
        if plan is not None:
            events = runner.decode_step(plan)
            if len(events) != len(plan.jobs):   # a reader without its event would wait forever
                raise RuntimeError(f"decode_step returned {len(events)} events for {len(plan.jobs)} jobs")
            sched.stepped(plan, [self._emit(j, ev) and not ev.finish for j, ev in zip(plan.jobs, events)])

    def _emit(self, job: Job, ev: StepEvent) -> bool:
        """Hand ``ev`` to its reader: listeners and trace first, then the queue; False when the
        job leaves (finished, its reader gone, or too far behind)."""
        if not self.scheduler.admits(job, ev):
            return False
        try:
            self.runner.notify(job.req, ev)
        except Exception:  # observers never fail a request
            log.exception("step listener failed")
        return self.scheduler.deliver(job, ev)
