"""Whole speculation modes as the arms of a bandit: adaptive is never beaten by a mode a user
could have pinned (``verifier_svc/policy.py``; docs/batching.md, "The mode race").

The per-step cost-model choice (the policy's own ``adaptive`` arm) values shapes by *predicted*
tokens per *predicted* second; where either prediction is off (the drafter's time at 32
sessions, a calibration that lags the text) it can lose to a fixed mode by a few per cent, or
to no speculation at all. This race measures instead: each arm is a mode (``off``, ``fixed``,
``tree:n``, ``hybrid:n``, ``suffix`` or ``adaptive`` itself), played by every adaptive job of
a step, and its reward is the tokens those jobs committed per second of the step (verify,
draft and the cycle's overhead), per batch-size bucket.

Arms are compared on the same text only. A mode's tokens per second follow the text by large
factors (acceptance is the text's), alike for every mode, so a rate measured on one prompt says
nothing about another mode's on the next. Each bucket has a *reference* arm (the leader; in a
race its best arm so far): a block of another arm is played between two of the reference's,
and its sample is its rate over theirs (a log-ratio). Its variance is the blocks' own (from
their steps' spread) plus half the move of the reference's rate between its two blocks (the
text changed inside the three). An arm's relative rate is the inverse-variance mean of its
last ``REL_WINDOW`` samples. Per bucket:

* **race**: the arms are played in blocks of consecutive steps (at least ``block_rows``
  session-steps and ``min_block_steps`` steps: a block at batch 32 is two steps, at batch 1
  ``block_rows`` steps), each between two blocks of the reference, the least measured first.
  After its first sample an arm below ``first_look`` times the best even one standard error up
  is out; later, one below the best by ``OUT_Z`` standard errors (successive elimination: what
  exploring a close arm costs is small because the arm is close). The race ends with one arm
  left, or when every arm left has ``max_blocks`` samples since it began: the best leads.
* **exploit**: the leader plays. A *recheck* (one block of the best other arm by relative
  rate, every other one of the rest in turn, between two leader blocks) comes
  ``recheck_blocks`` leader blocks after a new leader, then at gaps doubling up to
  ``max_recheck_blocks`` (longer for an arm whose blocks last longer): exploration's share of
  steps and seconds is bounded by the first gap's inverse. A recheck whose relative rate beats
  the leader's reopens the race between the two, on all their samples; one whose sample jumps
  above the leader and the arm's earlier samples (a ratio changed) reopens it from that sample,
  with the arms close to the leader too.
* **drift**: a leader whose last two blocks fall below its own level by ``DRIFT_Z`` times its usual
  swing (acceptance dropped, or only a hard prompt) has its best challenger rechecked at once,
  on that text. The lead is only ever decided on the same text.

:meth:`ModeRace.estimates` are absolute (each arm's last blocks' tokens over their seconds).
Only the scheduler thread calls it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from verifier_svc.race_state import (
    DEFAULT_RECHECK_BLOCKS,
    REL_WINDOW,
    Block,
    LeaderLevel,
    OpenBlock,
    RaceBucket,
    RaceStats,
    pair_sample,
)

#: Session-steps of one block (a step of B sessions counts B).
DEFAULT_BLOCK_ROWS = 12
#: Steps of one block at least (timing noise is per step, whatever the batch).
DEFAULT_MIN_BLOCK_STEPS = 2
#: After its first sample an arm below this fraction of the best leaves the race.
DEFAULT_FIRST_LOOK = 0.85
#: Samples per arm after which the race is decided on the relative rates alone.
DEFAULT_MAX_BLOCKS = 3
#: The longest gap between rechecks, in leader blocks (the first: ``DEFAULT_RECHECK_BLOCKS``).
DEFAULT_MAX_RECHECK_BLOCKS = 64
#: A racing arm is out once below the best by this many standard errors of their difference.
OUT_Z = 2.0

__all__ = ["DEFAULT_BLOCK_ROWS", "DEFAULT_FIRST_LOOK", "DEFAULT_MAX_BLOCKS", "DEFAULT_MAX_RECHECK_BLOCKS",
           "DEFAULT_MIN_BLOCK_STEPS", "DEFAULT_RECHECK_BLOCKS", "ModeRace", "RaceStats"]


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
        self.buckets: dict[int, RaceBucket] = {}
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
        # relative rate is a little higher
        ref = st.leader if not st.racing and st.leader in avail else self.best(b, avail)
        return arm, arm != ref

    def _next(self, st: RaceBucket, avail: list[str]) -> str:
        if st.open in avail:            # a block runs to its end: consecutive steps
            return st.open
        if st.racing:
            return self._next_racing(st, avail)
        if st.leader in avail and st.pending:
            return st.leader            # the block after a recheck's
        if not st.pending:
            st.probe = self._probe(st, avail)
            if st.probe is not None:
                return st.probe
        return st.leader if st.leader in avail else self._fallback(st, avail)

    def _next_racing(self, st: RaceBucket, avail: list[str]) -> str:
        racing = [a for a in st.racing if a in avail]
        if not racing:
            return self._fallback(st, avail)
        if st.ref not in avail:         # e.g. no suffix candidates this step
            self._move_ref(st, racing)
        if st.ref in avail and (st.pending or st.last_ref is None):
            return st.ref               # every other block is the reference's
        others = [a for a in racing if a != st.ref]
        if others:                      # the least measured first, in order of preference
            return min(others, key=lambda a: (st.arm(a).fresh, self.order.index(a)))
        return st.ref if st.ref in avail else racing[0]

    def _probe(self, st: RaceBucket, avail: list[str]) -> str | None:
        """The arm a recheck plays now (None: no recheck due)."""
        if st.due in avail and st.due != st.leader:
            return st.due
        if st.since_recheck < st.recheck_gap:
            return None
        others = [a for a in avail if a != st.leader and st.arm(a).blocks]
        if not others:
            return None
        # rotate through the others, the best relative rates most often (every other recheck)
        by = sorted(others, key=lambda a: v if (v := st.value(a)) is not None else -math.inf, reverse=True)
        arm = by[0] if st.rechecks % 2 == 0 or len(by) == 1 else by[1 + (st.rechecks // 2) % (len(by) - 1)]
        # a block of an arm with longer steps lasts longer (a tree's at batch 32, many decodes'
        # worth): its gap grows alike, so exploration's share of seconds stays bounded too
        lead = st.arm(st.leader).block_seconds() if st.leader is not None else 0.0
        longer = st.arm(arm).block_seconds() / lead if lead else 1.0
        return arm if st.since_recheck >= st.recheck_gap * max(1.0, longer) else None

    def _fallback(self, st: RaceBucket, avail: list[str]) -> str:
        """Neither the leader nor a racing arm can play: the best measured, else the first unmeasured."""
        best = self._best_of(st, avail)
        unmeasured = [a for a in avail if not st.arm(a).blocks]
        return best if best is not None else unmeasured[0] if unmeasured else avail[0]

    def best(self, b: int, available: Sequence[str] | None = None) -> str | None:
        """The arm of bucket ``b`` with the best relative rate (of ``available``); where none
        has one, the best estimate; None: none measured."""
        return self._best_of(self._bucket(b), available)

    def _best_of(self, st: RaceBucket, available: Sequence[str] | None) -> str | None:
        cands = [a for a in self.order if available is None or a in available]
        valued = [a for a in cands if st.value(a) is not None]
        if valued:
            return max(valued, key=lambda a: st.value(a) or 0.0)
        measured = [a for a in cands if st.arm(a).blocks]
        return max(measured, key=lambda a: st.arm(a).estimate() or 0.0) if measured else None

    def leader(self, b: int) -> str | None:
        """Bucket ``b``'s leader (None: while a race is open)."""
        st = self.buckets.get(b)
        return st.leader if st is not None and not st.racing else None

    def estimates(self, b: int) -> dict[str, float]:
        """Arm -> tokens per second at bucket ``b`` (measured arms only; each on its own text)."""
        st = self.buckets.get(b)
        return {} if st is None else {a: e for a, arm in list(st.arms.items())
                                      if (e := arm.estimate()) is not None}

    def relative(self, b: int) -> dict[str, float]:
        """Arm -> its tokens per second over the reference's on the same text, at bucket ``b``
        (the reference 1.0; arms with samples only)."""
        st = self.buckets.get(b)
        return {} if st is None else {a: math.exp(v) for a in list(st.arms)
                                      if (v := st.value(a)) is not None}

    def _bucket(self, b: int) -> RaceBucket:
        st = self.buckets.get(b)
        if st is None:
            order = self._start_order(b)
            st = self.buckets[b] = RaceBucket(racing=order, ref=order[0])
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
            s.explore_cost_tokens += self._explore_cost(st, arm, tokens, seconds)
        a = st.arm(arm)
        if st.open not in (None, arm):  # a block cut short (its arm unavailable): dropped
            st.arm(st.open).current = OpenBlock()
        st.open = arm
        a.current.add(tokens, seconds, rows)
        if a.current.rows >= self.block_rows and a.current.steps >= self.min_block_steps:
            block = a.current.close()
            a.current = OpenBlock()
            a.blocks.append(block)
            st.open = None
            self._closed(st, arm, block)

    def _explore_cost(self, st: RaceBucket, arm: str, tokens: float, seconds: float) -> float:
        best = self._best_of(st, None)
        if best is None:
            return 0.0
        vb, va = st.value(best), st.value(arm)
        if vb is not None and va is not None:
            return tokens * (math.exp(vb - va) - 1.0)
        ref = st.arm(best).estimate()
        return ref * seconds - tokens if ref is not None else 0.0

    def _closed(self, st: RaceBucket, arm: str, block: Block) -> None:
        """A block of ``arm`` closed: pair it, and update the race or the leader's schedule."""
        if arm == st.ref:
            st.last_ref = block
            sampled = self._pair(st, block)
            if st.racing:
                if sampled:
                    self._eliminate(st)
            elif sampled:
                self._judge(st, sampled)
            else:
                st.since_recheck += 1
                self._drift(st, block)
            return
        if (st.racing and arm in st.racing) or arm == st.probe:
            st.pending.append((arm, block, st.last_ref))
        if arm == st.probe:
            st.probe = st.due = None
            st.rechecks += 1
            st.since_recheck = 0

    def _pair(self, st: RaceBucket, after: Block) -> list[str]:
        """The pending blocks' samples against the reference's blocks around them."""
        sampled = []
        for arm, block, before in st.pending:
            x = st.arm(arm)
            x.rel.append(pair_sample(block, before, after))
            x.fresh += 1
            sampled.append(arm)
        st.pending = []
        return list(dict.fromkeys(sampled))

    def _judge(self, st: RaceBucket, sampled: list[str]) -> None:
        """Rechecks measured, on the leader's text. One whose relative rate beats the leader
        reopens the race between the two, on all their samples; none: the next recheck comes
        at twice the gap. One that jumped (``RaceArm.jumped``) says a ratio changed (the
        leader's drafter degraded, the text is of another kind): the race reopens from that
        sample alone, with the arms the leader's ratios put close to it, from new samples."""
        jumped = [a for a in sampled if st.arm(a).jumped()]
        better = [a for a in sampled if a in jumped or (st.value(a) or 0.0) > 0.0]
        if not better:
            st.recheck_gap = min(2 * st.recheck_gap, self.max_recheck_blocks)
            return
        near = [a for a in self.order if jumped and (v := st.value(a)) is not None
                and v >= math.log(self.first_look)]
        self._race(st, [a for a in (st.ref, *better, *near) if a is not None], restart=jumped)

    def _drift(self, st: RaceBucket, block: Block) -> None:
        """A leader block closed: where the leader's last two blocks fell below its level by
        more than its usual swing (acceptance dropped, or the text is only harder), its best
        challenger's recheck comes now, on this text."""
        if st.leader is None:
            return
        last = list(st.arm(st.leader).blocks)[-2:]
        recent = sum(b.tokens for b in last) / max(sum(b.seconds for b in last), 1e-12)
        if st.level.dropped(math.log(block.rate()), math.log(max(recent, 1e-12))) and st.due is None:
            st.due = self._challenger(st)

    def _challenger(self, st: RaceBucket) -> str | None:
        others = [a for a in st.avail if a != st.leader and st.value(a) is not None]
        return max(others, key=lambda a: st.value(a) or 0.0) if others else None

    def _race(self, st: RaceBucket, arms: list[str], restart: Sequence[str] = ()) -> None:
        """Reopen the race among ``arms`` (the reference first), decided on ``max_blocks``
        samples of each taken from now on, with the older ones of the window. Where an arm of
        ``restart`` jumped, the ratios may have changed: every racing arm's older samples are
        dropped, but the jump itself."""
        st.racing = list(dict.fromkeys(arms))
        st.probe = st.due = None
        for a in st.racing:
            x = st.arm(a)
            if restart:
                x.rel = collections.deque(list(x.rel)[-1:] if a in restart else [], maxlen=REL_WINDOW)
            x.fresh = len(x.rel) if restart else 0

    def _out(self, st: RaceBucket, a: str, top: str) -> bool:
        """Whether racing arm ``a`` is eliminated by ``top``: after one sample, where even one
        standard error of their difference up it is below ``first_look`` times ``top``; later,
        where it is below ``top`` by :data:`OUT_Z` of them."""
        gap = (st.value(a) or 0.0) - (st.value(top) or 0.0)
        fresh = st.arm(top).fresh if a == st.ref else st.arm(a).fresh
        se = math.hypot(st.value_se(a), st.value_se(top))
        return (fresh == 1 and gap + se < math.log(self.first_look)) or gap + OUT_Z * se < 0.0

    def _eliminate(self, st: RaceBucket) -> None:
        measured = [a for a in st.racing if st.value(a) is not None and (a == st.ref or st.arm(a).fresh)]
        if not measured:
            return
        top = max(measured, key=lambda a: st.value(a) or 0.0)
        if top != st.ref:               # the best so far is the cheapest arm to measure against
            self._rebase(st, top)
        for a in measured:
            if a != top and self._out(st, a, top):
                st.racing.remove(a)
        # an arm the steps cannot play now (no suffix candidates) does not hold the race open
        playable = [a for a in st.racing if a in st.avail and a != st.ref]
        if len(st.racing) == 1 or all(st.arm(a).fresh >= self.max_blocks for a in playable):
            if st.ref != st.leader:     # a new leader is rechecked soon; one confirmed, less often
                st.leader, st.level = st.ref, LeaderLevel()
                st.recheck_gap = self.recheck_blocks
            st.racing = []
            st.since_recheck = 0

    def _rebase(self, st: RaceBucket, new: str) -> None:
        """``new`` becomes the reference: every sample is re-expressed against it (the old
        reference's are ``new``'s, inverted; the others' carry ``new``'s uncertainty too)."""
        shift, var = st.value(new) or 0.0, st.value_se(new) ** 2
        old, n = st.ref, st.arm(new)
        for a, x in st.arms.items():
            if a not in (new, old):
                x.rel = collections.deque(((v - shift, w + var) for v, w in x.rel), maxlen=REL_WINDOW)
        if old is not None:
            o = st.arm(old)
            o.rel = collections.deque(((-v, w) for v, w in n.rel), maxlen=REL_WINDOW)
            o.fresh = n.fresh
        n.rel.clear()
        st.ref, st.last_ref = new, None
        st.pending = []

    def _move_ref(self, st: RaceBucket, racing: list[str]) -> None:
        """The reference cannot play: the best racing arm that can takes over (its samples
        re-expressed; with none, every sample starts again against it)."""
        valued = [a for a in racing if st.value(a) is not None]
        if valued:
            self._rebase(st, max(valued, key=lambda a: st.value(a) or 0.0))
            return
        for x in st.arms.values():
            x.rel.clear()
            x.fresh = 0
        st.ref, st.last_ref, st.pending = racing[0], None, []
