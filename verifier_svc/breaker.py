"""The circuit breaker that takes a drafter out of the step path: its configuration
(:class:`BreakerConfig`), its count of misses (:class:`CircuitBreaker`) and why it opened
(:class:`TripReason`).

A :class:`CircuitBreaker` per drafter takes one that is too slow or keeps failing out of the
step path: after ``failures`` consecutive misses or failed calls it opens, with the reason of
the last one ("slow": a budget-derived deadline missed; "failing": ``timeout_s`` missed, an
error, the stream down). Every call then fails at once with ``DraftError(FallbackReason.CIRCUIT_OPEN)`` (its
sessions run without speculation, no step waits for it), and a background prober sends one
tiny draft every ``probe_interval_s`` until one is answered within the deadline it tripped on
(``timeout_s`` for "failing"); then it closes and the sessions' context is resent. The calls,
the misses and the prober are ``verifier_svc.drafter_client.RemoteProposer``'s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from enum import StrEnum


class TripReason(StrEnum):
    """Why a breaker opened (the ``reason`` label of its trips; a fallback's reason is a
    :class:`~dflash.core.proposer.FallbackReason`)."""

    SLOW = "slow"          # budget-derived deadlines missed (each such step fell back LATE)
    FAILING = "failing"    # --draft-timeout missed, an error, the stream down


SLOW, FAILING = TripReason.SLOW, TripReason.FAILING


@dataclasses.dataclass(frozen=True)
class BreakerConfig:
    """``failures``: consecutive misses / failed calls that open the breaker (0 = never opens);
    ``probe_interval_s``: seconds between probes while open; ``deadline_floor_s``: the least a
    step waits for a drafter whatever its budget (a reply this fast is never held against
    it: timing noise, a cost model still learning). Raises ValueError on a negative count or
    a non-positive interval or floor."""

    failures: int = 3
    probe_interval_s: float = 1.0
    deadline_floor_s: float = 0.05

    def __post_init__(self):
        if self.failures < 0:
            raise ValueError(f"breaker failures: must be >= 0, got {self.failures}")
        if not self.probe_interval_s > 0:
            raise ValueError(f"breaker probe_interval_s: must be > 0, got {self.probe_interval_s}")
        if not self.deadline_floor_s > 0:
            raise ValueError(f"breaker deadline_floor_s: must be > 0, got {self.deadline_floor_s}")


class CircuitBreaker:
    """Consecutive-miss count of one drafter (thread-safe).

    ``failure(reason, readmit_s)`` returns True when that miss opened it (``reason`` SLOW or
    FAILING; a probe must then answer within ``readmit_s``); ``success`` resets the count (a
    reply within the deadline); ``close`` ends an open period (a probe was answered in time).
    ``trips`` counts openings, ``trips_by_reason`` per reason; ``reason`` and ``opened_at``
    (``time.monotonic()``) are the last opening's.
    """

    def __init__(self, failures: int):
        self.limit = failures
        self._lock = threading.Lock()
        self.consecutive = 0
        self.is_open = False
        self.trips = 0
        self.trips_by_reason: dict[TripReason, int] = {SLOW: 0, FAILING: 0}
        self.reason: TripReason | str = ""   # "": never opened
        self.readmit_s = 0.0
        self.opened_at = 0.0

    def success(self) -> None:
        with self._lock:
            self.consecutive = 0

    def failure(self, reason: TripReason = FAILING, readmit_s: float = 0.0) -> bool:
        with self._lock:
            self.consecutive += 1
            if self.is_open or not self.limit or self.consecutive < self.limit:
                return False
            self.is_open, self.opened_at = True, time.monotonic()
            self.reason, self.readmit_s = reason, readmit_s
            self.trips += 1
            self.trips_by_reason[reason] = self.trips_by_reason.get(reason, 0) + 1
            return True

    def close(self) -> float:
        """Close it; returns the seconds it was open."""
        with self._lock:
            self.is_open, self.consecutive = False, 0
            return time.monotonic() - self.opened_at
