"""Whole speculation modes as the arms of a bandit: adaptive is never beaten by a mode a user
could have pinned (``verifier_svc/policy.py``; docs/batching.md, "The mode race").

The per-step cost-model choice (the policy's own ``adaptive`` arm) values shapes by *predicted*
tokens per *predicted* second; where either prediction is off (the drafter's time at 32
sessions, a calibration that lags the text) it can lose to a fixed mode by a few per cent, or
to no speculation at all. This race measures instead: each arm is a mode (``off``, ``fixed``,
``tree:n``, ``hybrid:n``, ``suffix`` or ``adaptive`` itself), played by every adaptive job of
a step, and its reward is the tokens those jobs committed per second of the step (verify,
draft and the cycle's overhead), per batch-size bucket. Per bucket:

* **race**: the arms are played in blocks of consecutive steps (at least ``block_rows``
  session-steps and ``min_block_steps`` steps: a block at batch 32 is two steps, at batch 1
  ``block_rows`` steps), round-robin, the least measured first. After its first block an arm
  below ``first_look`` times the best is out; later, an arm whose estimate plus its standard
  error is below the best's minus its own is out (successive elimination: what exploring a
  close arm costs is small because the arm is close). The race ends with one arm left, or when
  every arm left has ``max_blocks`` blocks: the best estimate leads.
* **exploit**: the leader plays. A *recheck* (one block of the best other arm by its last
  estimate) comes ``recheck_blocks`` leader blocks after the race, then at gaps doubling up to
  ``max_recheck_blocks``: exploration's share is bounded by the first gap's inverse. A recheck
  that beats the leader, or a leader whose recent blocks fall below another arm's estimate
  (acceptance dropped), reopens the race among those arms.

An arm's estimate is its last ``window`` blocks' tokens over their seconds (a ratio of sums:
what playing it gives). Only the scheduler thread calls it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

#: Session-steps of one block (a step of B sessions counts B).
DEFAULT_BLOCK_ROWS = 12
#: Steps of one block at least (timing noise is per step, whatever the batch).
DEFAULT_MIN_BLOCK_STEPS = 2
#: After its first block an arm below this fraction of the best leaves the race.
DEFAULT_FIRST_LOOK = 0.85
#: Blocks per arm after which the race is decided on the estimates alone.
DEFAULT_MAX_BLOCKS = 3
#: Leader blocks before the first recheck, and the longest gap between rechecks.
DEFAULT_RECHECK_BLOCKS = 8
DEFAULT_MAX_RECHECK_BLOCKS = 64
#: Blocks an estimate is made of.
WINDOW = 4
#: A leader is raced again once another arm's estimate beats its own by this fraction.
DRIFT_MARGIN = 0.03
#: Relative standard error of an estimate from one block (timing and text noise).
ONE_BLOCK_NOISE = 0.10


@dataclasses.dataclass
class _Arm:
    """One arm's blocks in one bucket: closed ``(tokens, seconds)`` blocks and the open one."""

    blocks: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    fresh: int = 0                      # blocks closed since the current race began
    tokens: float = 0.0                 # the open block's
    seconds: float = 0.0
    steps: int = 0
    rows: int = 0

    def estimate(self) -> float | None:
        """Tokens per second of the last blocks (None: none closed)."""
        if not self.blocks:
            return None
        return sum(t for t, _ in self.blocks) / max(sum(s for _, s in self.blocks), 1e-12)

    def stderr(self) -> float:
        """Standard error of :meth:`estimate` (tokens/s): the spread of the block rates over
        the root of their count, at least :data:`ONE_BLOCK_NOISE` of the estimate per block."""
        est = self.estimate() or 0.0
        rates = [t / max(s, 1e-12) for t, s in self.blocks]
        n = len(rates)
        sd = (sum((r - sum(rates) / n) ** 2 for r in rates) / (n - 1)) ** 0.5 if n > 1 else 0.0
        return max(sd, ONE_BLOCK_NOISE * est) / math.sqrt(max(n, 1))


@dataclasses.dataclass
class _Bucket:
    arms: dict[str, _Arm] = dataclasses.field(default_factory=dict)
    racing: list[str] = dataclasses.field(default_factory=list)   # empty: exploiting
    leader: str | None = None
    open: str | None = None             # the arm whose block is open
    avail: tuple[str, ...] = ()         # the arms the last step could play
    recheck_gap: int = DEFAULT_RECHECK_BLOCKS
    since_recheck: int = 0              # leader blocks since the race or the last recheck
    rechecks: int = 0

    def arm(self, name: str) -> _Arm:
        return self.arms.setdefault(name, _Arm())


@dataclasses.dataclass
class RaceStats:
    """What the race did (for metrics and ``dflash bench``): steps per arm, the steps that
    explored (played an arm other than the bucket's leader, or while racing its best
    estimate), and what they cost: the
    tokens the best arm's rate would have committed in their seconds, less what they
    committed (negative: exploring paid)."""

    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    explored_steps: int = 0
    explored_seconds: float = 0.0
    explore_cost_tokens: float = 0.0
    total_steps: int = 0
    total_seconds: float = 0.0


class ModeRace:
    """The race of one policy over its buckets.

    Args:
        arms: the arms in order of preference (ties and the race's first blocks follow it).
        block_rows, min_block_steps, first_look, max_blocks, recheck_blocks,
            max_recheck_blocks: the schedule above. Raise ValueError out of range.
    """

    def __init__(self, arms: Sequence[str], *, block_rows: int = DEFAULT_BLOCK_ROWS,
                 min_block_steps: int = DEFAULT_MIN_BLOCK_STEPS, first_look: float = DEFAULT_FIRST_LOOK,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, recheck_blocks: int = DEFAULT_RECHECK_BLOCKS,
                 max_recheck_blocks: int = DEFAULT_MAX_RECHECK_BLOCKS):
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"race_arms: a non-empty list of distinct modes, got {list(arms)}")
        if block_rows < 1 or min_block_steps < 1 or max_blocks < 1 or recheck_blocks < 1:
            raise ValueError("block_rows, min_block_steps, max_blocks, recheck_blocks: each must be >= 1")
        if not 0.0 < first_look <= 1.0:
            raise ValueError(f"first_look: must be in (0, 1], got {first_look}")
        if max_recheck_blocks < recheck_blocks:
            raise ValueError("max_recheck_blocks: must be >= recheck_blocks")
        self.order = tuple(arms)
        self.block_rows, self.min_block_steps = block_rows, min_block_steps
        self.first_look, self.max_blocks = first_look, max_blocks
        self.recheck_blocks, self.max_recheck_blocks = recheck_blocks, max_recheck_blocks
        self.buckets: dict[int, _Bucket] = {}
        self.stats = RaceStats()

    # ------------------------------------------------------------------ choice
    def pick(self, b: int, available: Sequence[str]) -> tuple[str, bool]:
        """The arm the adaptive jobs of a step at bucket ``b`` play, of ``available`` (a
        subset of the arms, non-empty), and whether that explores."""
        avail = [a for a in self.order if a in available]
        if not avail:
            raise ValueError(f"available: none of the race's arms {list(self.order)}")
        st = self._bucket(b)
        st.avail = tuple(avail)
        arm = self._next(st, avail)
        # exploiting, the leader's steps are not exploration even while a close arm's older
        # estimate is a little higher
        ref = st.leader if not st.racing and st.leader in avail else self.best(b, avail)
        return arm, arm != ref

    def _next(self, st: _Bucket, avail: list[str]) -> str:
        if st.open in avail:            # a block runs to its end: consecutive steps
            return st.open
        racing = [a for a in st.racing if a in avail]
        if racing:                      # the least measured first, in order of preference
            return min(racing, key=lambda a: (st.arm(a).fresh, self.order.index(a)))
        if st.since_recheck >= st.recheck_gap:
            others = [a for a in avail if a != st.leader and st.arm(a).estimate() is not None]
            if others:
                # rotate through the others, the best estimates most often (every other recheck)
                by = sorted(others, key=lambda a: -(st.arm(a).estimate() or 0.0))
                return by[0] if st.rechecks % 2 == 0 or len(by) == 1 else by[1 + (st.rechecks // 2) % (len(by) - 1)]
        if st.leader in avail:
            return st.leader
        unmeasured = [a for a in avail if st.arm(a).estimate() is None]
        return unmeasured[0] if unmeasured else max(avail, key=lambda a: st.arm(a).estimate() or 0.0)

    def best(self, b: int, available: Sequence[str] | None = None) -> str | None:
        """The arm of bucket ``b`` with the best estimate (of ``available``); None: none measured."""
        st = self._bucket(b)
        cands = [a for a in self.order if (available is None or a in available)
                 and st.arm(a).estimate() is not None]
        return max(cands, key=lambda a: st.arm(a).estimate() or 0.0) if cands else None

    def leader(self, b: int) -> str | None:
        """Bucket ``b``'s leader (None: racing, and no race ended yet)."""
        st = self.buckets.get(b)
        return st.leader if st is not None and not st.racing else None

    def estimates(self, b: int) -> dict[str, float]:
        """Arm -> tokens per second at bucket ``b`` (measured arms only)."""
        st = self.buckets.get(b)
        return {} if st is None else {a: e for a, arm in list(st.arms.items())
                                      if (e := arm.estimate()) is not None}

    def _bucket(self, b: int) -> _Bucket:
        st = self.buckets.get(b)
        if st is None:
            st = self.buckets[b] = _Bucket(racing=list(self._start_order(b)))
        return st

    def _start_order(self, b: int) -> list[str]:
        """A new bucket's race: the nearest measured bucket's leader first (its neighbour's
        best is the likeliest best), then the order of preference."""
        near = sorted((abs(math.log2(b2) - math.log2(b)), b2, st.leader)
                      for b2, st in self.buckets.items() if st.leader is not None)
        first = [near[0][2]] if near else []
        return list(dict.fromkeys([*first, *self.order]))

    # ------------------------------------------------------------------ feedback
    def observe(self, b: int, arm: str, tokens: float, seconds: float, rows: int,
                explored: bool = False) -> None:
        """One step at bucket ``b`` in which ``rows`` adaptive jobs played ``arm`` and
        committed ``tokens`` in ``seconds`` (``explored``: as :meth:`pick` said)."""
        st = self._bucket(b)
        s = self.stats
        s.steps[arm] = s.steps.get(arm, 0) + 1
        s.total_steps += 1
        s.total_seconds += seconds
        if explored:
            s.explored_steps += 1
            s.explored_seconds += seconds
            best = self.best(b)
            ref = st.arm(best).estimate() if best is not None else None
            if ref is not None:
                s.explore_cost_tokens += ref * seconds - tokens
        a = st.arm(arm)
        if st.open not in (None, arm):  # a block cut short (its arm unavailable): dropped
            self._reset_open(st.arm(st.open))
        st.open = arm
        a.tokens += tokens
        a.seconds += seconds
        a.steps += 1
        a.rows += rows
        if a.rows >= self.block_rows and a.steps >= self.min_block_steps:
            a.blocks.append((a.tokens, a.seconds))
            a.fresh += 1
            self._reset_open(a)
            st.open = None
            self._closed(st, arm)

    @staticmethod
    def _reset_open(a: _Arm) -> None:
        a.tokens = a.seconds = 0.0
        a.steps = a.rows = 0

    def _closed(self, st: _Bucket, arm: str) -> None:
        """A block of ``arm`` closed: update the race, or the leader's schedule."""
        if st.racing:
            if arm in st.racing:
                self._eliminate(st)
            return
        est = {a: e for a, x in st.arms.items() if (e := x.estimate()) is not None}
        lead = st.leader
        if arm == lead:
            st.since_recheck += 1
            # beyond the margin and both estimates' noise: close arms would trade the lead
            # back and forth, a race each time
            se = st.arm(lead).stderr()
            better = [a for a, e in est.items() if a != lead
                      and e - st.arm(a).stderr() > max((1 + DRIFT_MARGIN) * est[lead], est[lead] + se)]
            if better:                  # the leader fell below another arm's estimate
                self._race(st, [lead, *better])
            return
        # a recheck
        st.rechecks += 1
        st.since_recheck = 0
        if lead is None or est[arm] > est.get(lead, 0.0):
            self._race(st, [a for a in (lead, arm) if a is not None])
        else:
            st.recheck_gap = min(2 * st.recheck_gap, self.max_recheck_blocks)

    def _race(self, st: _Bucket, arms: list[str]) -> None:
        st.racing = list(dict.fromkeys(arms))
        for a in st.racing:
            st.arm(a).fresh = 0

    def _eliminate(self, st: _Bucket) -> None:
        measured = [a for a in st.racing if st.arm(a).fresh]
        if not measured:
            return
        est = {a: st.arm(a).estimate() or 0.0 for a in measured}
        top = max(measured, key=lambda a: est[a])
        floor = est[top] - st.arm(top).stderr()
        for a in measured:
            if a == top:
                continue
            x = st.arm(a)
            if (x.fresh == 1 and est[a] < self.first_look * est[top]) or est[a] + x.stderr() < floor:
                st.racing.remove(a)
        # an arm the steps cannot play now (no suffix candidates) does not hold the race open
        playable = [a for a in st.racing if a in st.avail]
        if len(st.racing) == 1 or all(st.arm(a).fresh >= self.max_blocks for a in playable):
            st.leader = max((a for a in st.racing if st.arm(a).fresh),
                            key=lambda a: st.arm(a).estimate() or 0.0)
            st.racing = []
            st.since_recheck = 0
            st.recheck_gap = self.recheck_blocks
