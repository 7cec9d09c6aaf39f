"""Continuous batching: which requests run, wait, or leave, between the decode steps.

The scheduler decides; it runs nothing and calls nobody. The engine core's loop
(``verifier_svc.core``) asks it, runs what it says on the engine, and tells it the outcome.
Each iteration, between steps:

1. requests that were cancelled (the client went away) or closed (the reader stopped) leave
   the batch; a cancelled one gets a last ``finish="cancelled"`` event;
2. waiting requests are prefilled, at most ``prefill_chunk`` prompt tokens per iteration in
   all (long prompts take several iterations), so a new prompt never stalls the running
   sessions for more than one chunk; a request joins the batch once its prompt is in;
3. one decode step for the whole batch (a :class:`StepPlan`).

It imports no torch (tests/test_scheduler.py): the engine's per-request state
(``verifier_svc.decode_state.DecodeState``) rides on each :class:`Job` unread.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # types only: the engine's modules import torch
    from verifier_svc.decode_state import DecodeState
    from verifier_svc.request import Request, StepEvent

log = logging.getLogger("dflash.verifier.scheduler")

MIN_RETRY_MS = 100        # retry hints are never shorter: a refused client should back off
MAX_RETRY_MS = 30_000


class SlowConsumer(RuntimeError):
    """The request's reader left more than the allowed number of events unread; the request
    was cancelled so a stalled client holds no batch slot (maps to RESOURCE_EXHAUSTED)."""


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
    """One request inside the scheduler: where it stands and where its events go."""

    req: Request
    decode: DecodeState                      # the engine's; the scheduler never reads it
    cancelled: Callable[[], bool]
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    closed: bool = False                     # the reader is gone: drop without an event
    gone: threading.Event = dataclasses.field(default_factory=threading.Event)
    started: bool = False                    # its first prefill chunk was scheduled
    prefilled: int = 0                       # prompt positions in the cache (the engine's count)
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


class Scheduler:
    """The requests' queues and the batch, with admission (thread-safe: requests arrive on the
    servicer's threads; the engine core's loop is the one caller of the rest).

    Args:
        prefill_chunk: prompt tokens prefilled per iteration, over all waiting requests.
        max_batch: sessions per decode step (the rest wait their turn, oldest first).
        max_unread: events a reader may leave unread before its request is cancelled.
        admission: bounds on waiting requests (may be replaced before requests arrive).

    ``queue_wait_listeners`` are called with each request's queue wait in seconds (admission
    to its first prefill chunk; on the loop's thread); ``refused`` counts refusals by reason.
    ``cv`` guards the queues; the loop waits on it for work.
    """

    QUEUE_WAIT_EMA = 0.2      # weight of the newest queue wait in the retry hint

    def __init__(self, *, prefill_chunk: int = 256, max_batch: int = 64, max_unread: int = 4096,
                 admission: Admission | None = None):
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.max_unread = max_unread
        self.admission = admission or Admission()
        self.queue_wait_listeners: list[Callable[[float], None]] = []
        self.refused: dict[str, int] = {"max_waiting": 0, "max_waiting_tokens": 0}
        self._queue_wait_ema = 0.0
        self.cv = threading.Condition()
        self._incoming: list[Job] = []
        self._waiting: list[Job] = []        # prefilling, oldest first
        self._running: list[Job] = []
        self._idle = True                    # nothing ran since the loop last waited

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests admitted and not in the batch yet (vLLM's ``num_requests_waiting``)."""
        with self.cv:
            return len(self._incoming) + len(self._waiting)

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting requests not prefilled yet."""
        with self.cv:
            return sum(map(_unprefilled, self._incoming + list(self._waiting)))

    def load(self) -> tuple[int, int, int]:
        """(waiting, running, positions the running requests may hold: prompt + max_tokens
        each), read together: what a router scores this replica by."""
        with self.cv:
            running = list(self._running)
            waiting = len(self._incoming) + len(self._waiting)
        return waiting, len(running), sum(len(j.req.prompt) + j.req.max_tokens for j in running)

    # ------------------------------------------------------------------ admission
    def check_admission(self, prompt_tokens: int) -> None:
        """Raise :class:`Overloaded` if a request of ``prompt_tokens`` would be refused now
        (``admit`` decides; this lets a caller refuse before touching a session)."""
        with self.cv:
            refusal = self._refusal(prompt_tokens)
        if refusal is not None:
            raise refusal

    def _refusal(self, prompt_tokens: int) -> Overloaded | None:
        """Why a request of ``prompt_tokens`` cannot wait now (None: admitted; ``cv`` held).
        The loop shrinks ``_waiting`` and grows ``_running`` outside the lock, so a count read
        here is at worst one iteration old: a refusal near the bound is conservative, never an
        excess."""
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

    def admit(self, job: Job) -> bool:
        """Queue ``job`` for its prefill (``cv`` held); False when refused (:class:`Overloaded`
        is then its only event)."""
        refusal = self._refusal(len(job.req.prompt))
        if refusal is not None:
            self.fail(job, refusal)
            return False
        job.submitted = time.monotonic()
        self._incoming.append(job)
        self.cv.notify()
        return True

    # ------------------------------------------------------------------ the loop's questions
    def has_work(self) -> bool:
        """Whether anything waits or runs (``cv`` held)."""
        return bool(self._incoming or self._waiting or self._running)

    def active(self) -> bool:
        """Whether a job is prefilling or in the batch (an iteration has something to run)."""
        return bool(self._waiting or self._running)

    def rest(self) -> None:
        """The loop waits for work now (``cv`` held): its next cycle is not a step's cost."""
        self._idle = True

    def take_incoming(self) -> None:
        """Admitted requests join the prefill queue (``cv`` held)."""
        self._waiting += self._incoming
        self._incoming = []

    def drain(self) -> list[Job]:
        """Every job, which leaves (``cv`` held): the loop stops."""
        jobs = self._incoming + self._waiting + self._running
        self._incoming, self._waiting, self._running = [], [], []
        return jobs

    def leave(self) -> list[Job]:
        """Drop the jobs whose reader is gone (silently) or that were cancelled; returns the
        cancelled ones, which owe their reader a last event."""
        cancelled: list[Job] = []
        self._waiting = [j for j in self._waiting if self._stays(j, cancelled)]
        self._running = [j for j in self._running if self._stays(j, cancelled)]
        return cancelled

    @staticmethod
    def _stays(job: Job, cancelled: list[Job]) -> bool:
        if job.closed:
            job.gone.set()
            return False
        try:
            gone = job.cancelled()
        except Exception:
            gone = True
        if gone:
            cancelled.append(job)
        return not gone

    def fresh_cycle(self) -> bool:
        """Whether this iteration's step is not what a steady step costs: a prompt will be
        prefilled before it, or the loop waited since the last one."""
        fresh = bool(self._waiting) or self._idle
        self._idle = False
        return fresh

    def next_prefill(self, budget: int) -> Job | None:
        """The job whose prompt to prefill next with ``budget`` tokens left this iteration
        (None: none now)."""
        if not (self._waiting and budget > 0 and len(self._running) < self.max_batch):
            return None
        return self._waiting[0]

    def started(self, job: Job) -> None:
        """``job``'s first prefill chunk is about to run: its queue wait ends."""
        self._queue_wait(time.monotonic() - job.submitted)
        job.started = True

    def prefilled(self, job: Job, joins: bool) -> None:
        """``job``'s prompt is in; it joins the batch unless it already left (finished)."""
        self._waiting.remove(job)
        if joins:
            self._running.append(job)

    def plan(self, fresh: bool) -> StepPlan | None:
        """The next decode step (None: nothing runs)."""
        if not self._running:
            return None
        return StepPlan(jobs=list(self._running), waiting=len(self._waiting), fresh_cycle=fresh)

    def stepped(self, plan: StepPlan, stays: list[bool]) -> None:
        """After ``plan``'s step: the jobs that stay in the batch (one flag per job)."""
        self._running = [j for j, keep in zip(plan.jobs, stays) if keep]

    def fail_all(self, e: BaseException) -> None:
        """An iteration failed: every waiting and running job fails with ``e``."""
        for j in self._waiting + self._running:
            self.fail(j, e)
        self._waiting, self._running = [], []

    # ------------------------------------------------------------------ events
    def admits(self, job: Job, ev: StepEvent) -> bool:
        """Whether ``ev`` may go to ``job``'s reader: False when the reader is gone, or too far
        behind (the job then fails with :class:`SlowConsumer`)."""
        if job.closed:
            job.gone.set()
            return False
        if job.events.qsize() >= self.max_unread and not ev.finish:
            log.warning("request %s: %d events unread; cancelled", job.req.request_id,
                        job.events.qsize())
            self.fail(job, SlowConsumer(f"the client read none of the last {self.max_unread} "
                                        "events; request cancelled"))
            return False
        return True

    def deliver(self, job: Job, ev: StepEvent) -> bool:
        """Queue ``ev`` for the reader (never waits); False when the job leaves (finished)."""
        job.events.put(ev)
        if ev.finish:
            job.gone.set()
            return False
        return True

    def _queue_wait(self, seconds: float) -> None:
        self._queue_wait_ema += self.QUEUE_WAIT_EMA * (seconds - self._queue_wait_ema)
        for listener in self.queue_wait_listeners:
            try:
                listener(seconds)
            except Exception:  # observers never fail a request
                log.exception("queue wait listener failed")

    @staticmethod
    def fail(job: Job, e: BaseException) -> None:
        job.events.put(e)
        job.gone.set()
