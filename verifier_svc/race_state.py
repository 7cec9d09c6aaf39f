"""The mode race's bookkeeping per batch bucket: each arm's blocks and paired samples, the
bucket's schedule and its leader's level, and what the race did (``verifier_svc/mode_race.py``;
docs/batching.md, "The mode race")."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple

#: Leader blocks before the first recheck (the default of ``ModeRace(recheck_blocks=)``).
DEFAULT_RECHECK_BLOCKS = 8
#: Blocks an estimate is made of (a rate follows the text: the recent blocks).
WINDOW = 4
#: Samples a relative rate is made of (a ratio does not follow the text: more samples).
REL_WINDOW = 8
#: The prior of one block's relative noise, and the steps it weighs as against the spread of
#: the block's own steps (timing and acceptance noise).
ONE_BLOCK_NOISE = 0.10
PRIOR_STEPS = 2
#: A leader's drop is this many swings below its level, the level and the swing being moving
#: averages over about ``1 / DRIFT_EMA`` of its blocks.
DRIFT_Z = 1.5
DRIFT_EMA = 1.0 / 32
_TINY = 1e-12

#: One paired sample: (log-ratio to the reference, its variance).
Sample = tuple[float, float]


class Block(NamedTuple):
    """One closed block: its tokens, seconds and the variance of its log-rate."""

    tokens: float
    seconds: float
    var: float

    def rate(self) -> float:
        """Tokens per second (a floor on both: the log of a ratio stays finite)."""
        return max(self.tokens, _TINY) / max(self.seconds, _TINY)


@dataclasses.dataclass
class OpenBlock:
    """The block being played: sums over its steps' tokens ``t`` and seconds ``s``."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    rows: int = 0
    tt: float = 0.0                     # sum of t * t
    ts: float = 0.0                     # sum of t * s
    ss: float = 0.0                     # sum of s * s

    def add(self, tokens: float, seconds: float, rows: int) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1
        self.rows += rows
        self.tt += tokens * tokens
        self.ts += tokens * seconds
        self.ss += seconds * seconds

    def close(self) -> Block:
        """The block, its log-rate's variance from its steps' spread around its rate (the
        ratio estimator's), shrunk towards :data:`ONE_BLOCK_NOISE` with the weight of
        :data:`PRIOR_STEPS` steps: a block of two steps says little about its own noise."""
        n, t = self.steps, max(self.tokens, _TINY)
        r = t / max(self.seconds, _TINY)
        resid = max(self.tt - 2 * r * self.ts + r * r * self.ss, 0.0)
        seen = resid / (t * t) * n / (n - 1) if n > 1 else 0.0
        var = (PRIOR_STEPS * ONE_BLOCK_NOISE ** 2 + (n - 1) * seen) / (PRIOR_STEPS + n - 1)
        return Block(self.tokens, self.seconds, var)


def pair_sample(block: Block, before: Block | None, after: Block) -> Sample:
    """One paired sample: ``block``'s rate over the reference's blocks around it. Where the
    reference's rate moved between them the text changed inside the three blocks and
    ``block`` may have run on either side of the change: half the move is added to the
    sample's deviation (without a block before, the noise is doubled)."""
    if before is None:
        return math.log(block.rate() / after.rate()), 4 * (block.var + after.var)
    ref = Block(before.tokens + after.tokens, before.seconds + after.seconds, 0.0)
    move = math.log(after.rate() / before.rate())
    var = block.var + (before.var + after.var) / 4 + (move / 2) ** 2
    return math.log(block.rate() / ref.rate()), var


def _sd(xs: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    m = sum(xs) / n
    return (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5


def _samples() -> collections.deque[Sample]:
    return collections.deque(maxlen=REL_WINDOW)


@dataclasses.dataclass
class RaceArm:
    """One arm's blocks in one bucket: its last closed blocks, its paired samples against the
    bucket's reference, and the block being played."""

    blocks: collections.deque[Block] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=WINDOW))
    rel: collections.deque[Sample] = dataclasses.field(default_factory=_samples)
    fresh: int = 0                      # samples since the current race began
    current: OpenBlock = dataclasses.field(default_factory=OpenBlock)

    def estimate(self) -> float | None:
        """Tokens per second of the last blocks, on whatever text they ran (None: none closed)."""
        if not self.blocks:
            return None
        return sum(b.tokens for b in self.blocks) / max(sum(b.seconds for b in self.blocks), _TINY)

    def block_seconds(self) -> float:
        """Mean seconds of the last blocks (0.0: none closed)."""
        return sum(b.seconds for b in self.blocks) / len(self.blocks) if self.blocks else 0.0

    def relative(self) -> float | None:
        """The samples' log-ratio to the reference, each weighted by the inverse of its
        variance (None: no sample)."""
        if not self.rel:
            return None
        return sum(x / v for x, v in self.rel) / sum(1.0 / v for _, v in self.rel)

    def rel_stderr(self) -> float:
        """Standard error of :meth:`relative` (log units): from the samples' variances, at
        least their spread over the root of their count (noise the blocks did not show)."""
        n = len(self.rel)
        if not n:
            return math.inf
        return max(sum(1.0 / v for _, v in self.rel) ** -0.5, _sd([x for x, _ in self.rel]) / math.sqrt(n))

    def jumped(self) -> bool:
        """Whether the last sample beats the reference and its arm's earlier samples (none:
        the reference alone) by twice its noise (its own, or their spread where larger): the
        ratio changed."""
        if not self.rel:
            return False
        x, var = self.rel[-1]
        earlier = list(self.rel)[:-1]
        base = sum(y / v for y, v in earlier) / sum(1.0 / v for _, v in earlier) if earlier else 0.0
        return x > 0.0 and x - base > 2 * max(math.sqrt(var), _sd([y for y, _ in earlier]))


@dataclasses.dataclass
class LeaderLevel:
    """A leader's usual rate: moving averages of its blocks' log-rates (the *level*) and of
    their squared deviation from it (the *swing*: on real text mostly the text's own), each
    deviation clipped at two swings so that one drop neither drags nor widens them much."""

    level: float | None = None          # None: no block yet
    swing: float = ONE_BLOCK_NOISE ** 2
    blocks: int = 0
    low: bool = False                   # a drop was reported and has not ended

    def dropped(self, x: float, recent: float) -> bool:
        """Take the log-rate ``x`` of the leader's block just closed; whether ``recent`` (the
        log-rate of its last blocks together) fell more than :data:`DRIFT_Z` swings below the
        level. A drop is reported once, not at every block it lasts: again only after the
        rate came back."""
        if self.level is None:
            self.level, self.blocks = x, 1
            return False
        swing = max(math.sqrt(self.swing), ONE_BLOCK_NOISE)
        below = recent - self.level < -DRIFT_Z * swing
        report, self.low = below and not self.low, below
        dev = min(max(x - self.level, -2 * swing), 2 * swing)
        self.blocks += 1                # a mean of the first blocks, then a moving average
        w = max(1.0 / self.blocks, DRIFT_EMA)
        self.swing += w * (dev ** 2 - self.swing)
        self.level += w * dev
        return report


@dataclasses.dataclass
class RaceBucket:
    """One batch bucket's race: its arms, the race or the leader, the reference and the
    blocks waiting for it, the recheck schedule and the leader's level."""

    arms: dict[str, RaceArm] = dataclasses.field(default_factory=dict)
    racing: list[str] = dataclasses.field(default_factory=list)   # empty: exploiting
    leader: str | None = None
    ref: str | None = None              # the arm the others' samples are measured against
    open: str | None = None             # the arm whose block is being played
    avail: tuple[str, ...] = ()         # the arms the last step could play
    recheck_gap: int = DEFAULT_RECHECK_BLOCKS
    since_recheck: int = 0              # leader blocks since the race or the last recheck
    rechecks: int = 0
    # closed blocks of other arms waiting for the reference's next block: (arm, block, the
    # reference's block before it)
    pending: list[tuple[str, Block, Block | None]] = dataclasses.field(default_factory=list)
    last_ref: Block | None = None       # the reference's last block (None: since it changed)
    probe: str | None = None            # the arm a recheck plays
    due: str | None = None              # an arm whose recheck the drift rule brought forward
    level: LeaderLevel = dataclasses.field(default_factory=LeaderLevel)

    def arm(self, name: str) -> RaceArm:
        return self.arms.setdefault(name, RaceArm())

    def value(self, name: str) -> float | None:
        """``name``'s log-rate over the reference's (the reference: 0 once it has a block;
        None: no sample)."""
        if name == self.ref:
            return 0.0 if self.arm(name).blocks else None
        return self.arm(name).relative()

    def value_se(self, name: str) -> float:
        """Standard error of :meth:`value` (the reference: 0; no sample: inf)."""
        return 0.0 if name == self.ref else self.arm(name).rel_stderr()


@dataclasses.dataclass
class RaceStats:
    """What the race did (for metrics and ``dflash bench``): steps per arm, the steps that
    explored (played an arm other than the bucket's leader, or while racing its best
    relative rate), and what they cost: the tokens the best arm would have committed on the
    same text in their seconds (the explored arm's tokens over its relative rate to the best;
    the best's estimate times the seconds while the arm has none), less what they committed
    (negative: exploring paid)."""

    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    explored_steps: int = 0
    explored_seconds: float = 0.0
    explore_cost_tokens: float = 0.0
    total_steps: int = 0
    total_seconds: float = 0.0
