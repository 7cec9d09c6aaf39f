"""Acceptance estimation for the speculation policy: how many tokens a block of ``k`` drafts is
expected to commit.

* per drafter label (the drafter version): an EMA of each draft position's unconditional
  acceptance rate, one update per step (:meth:`AcceptanceEstimator.observe`);
* ``E[k] = 1 + sum_{p <= k} rate_p``: expected committed tokens of one block with ``k`` drafts,
  the bonus token included (:meth:`AcceptanceEstimator.expected_table`);
* per request: the drafter's table moved towards the request's own per-position counts, the
  drafter's rates weighing as ``SESSION_PRIOR_STEPS`` steps (:func:`session_table`);
* calibration: per drafter arm family (``Family.CHAIN``, ``Family.TREE``: the drafter's trees,
  hybrid or not), committed / expected extra tokens of the recent adaptive steps that ran one
  of them, by which the policy scales that family's expected extra tokens
  (:meth:`AcceptanceEstimator.accuracy_of`; ``accuracy`` is the chains'). An arm is run when
  its estimate is high, so its steps commit less than estimated on average (the winner's
  curse; docs/suffix.md). Suffix trees alone (``Family.SUFFIX``) are calibrated by their
  candidates' own cells instead (``verifier_svc.suffix_drafts.SuffixCalibration``, per match
  length, depth, support and share, scaled per session), which condition on what the choice
  selects by; a family ratio on top counted the same shortfall twice;
* trees (DDTree, ``verifier_svc/tree.py``): per drafter label and node budget, an EMA of the
  tokens one tree step commits (:meth:`AcceptanceEstimator.observe_trees`). A chain's
  per-position rates say nothing about the siblings a tree adds, so a tree budget is measured
  as a whole rather than derived;
* hybrid trees: per drafter label, EMAs of the gain the suffix candidates were predicted to add
  to a drafter's tree (before calibration) and of what they added (committed tokens beyond the
  drafter's own nodes of the path); their ratio scales every predicted gain
  (:meth:`AcceptanceEstimator.hybrid_factor`). A candidate the drafter's tree already holds
  adds nothing, and the prediction, made before the drafter has drafted, cannot know which.

How the policy weighs these against step cost: ``verifier_svc/policy.py``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Collection, Protocol, Sequence

from verifier_svc.cost_model import EMA

# How many steps of its own a request's acceptance needs to weigh as much as the drafter's EMA.
SESSION_PRIOR_STEPS = 4.0
# Tree steps of one (label, budget) before its measured mean replaces the chain-based prior.
TREE_MEASURED_STEPS = 3


class Family(StrEnum):
    """An arm's calibration family. The drafter's (chains, trees) are each calibrated on the
    adaptive steps that ran one of their arms; suffix trees alone by their candidates' cells
    (SuffixCalibration), not twice."""

    CHAIN = "chain"
    TREE = "tree"
    SUFFIX = "suffix"


ARM_FAMILIES = tuple(Family)
# Adaptive steps of one arm family before its committed / expected ratio scales its arms, and
# the ratio's floor (a family is never valued at less than a quarter of its estimate).
CALIBRATION_MIN_STEPS, CALIBRATION_FLOOR = 5, 0.25
# Hybrid tree steps of one label before their realized / predicted gain scales the prediction.
HYBRID_MEASURED_STEPS = 5


class PositionCounts(Protocol):
    """A request's acceptance counts (``dflash.core.stats.AcceptanceCounter``): index ``i`` counts
    the steps that drafted / accepted draft position ``i + 1``."""

    accepted_per_position: list[int]
    drafted_per_position: list[int]


def session_table(prior: list[float], stats: PositionCounts | None,
                  strength: float = SESSION_PRIOR_STEPS) -> list[float]:
    """``[E[0], ..., E[top]]`` for one request: ``prior`` (the drafter's table, same form) moved
    towards the request's own acceptance.

    Per position p (1-based) the request's rate is ``(accepted_p + strength * prior_p) /
    (drafted_p + strength)``: the prior counts as ``strength`` steps (a shrinkage estimate, as a
    Beta prior on each position's rate would give). Positions the request never drafted scale
    the last one it did by the prior's decay from there; no rate exceeds the one before it.
    Per request because acceptance differs several-fold between prompts and falls within an
    answer, which a drafter-wide EMA follows too late. ``stats`` None (or with nothing drafted)
    returns ``prior``."""
    if stats is None or not stats.drafted_per_position:
        return prior
    acc, tried = stats.accepted_per_position, stats.drafted_per_position
    table, total, last, last_prior = [1.0], 1.0, None, None
    for p in range(len(prior) - 1):
        base = prior[p + 1] - prior[p]
        n = tried[p] if p < len(tried) else 0
        if n:
            a = acc[p] if p < len(acc) else 0
            r = (a + strength * base) / (n + strength)
        else:
            r = last * base / last_prior if last is not None and last_prior else base
        if last is not None:
            r = min(r, last)      # unconditional rates never rise with the position
        last, last_prior = r, base
        total += r
        table.append(total)
    return table


def ema_ratio(num: EMA, den: EMA, min_steps: int, low: float, high: float = 1.5) -> float:
    """``num / den`` clamped to ``[low, high]``; 1.0 until ``den`` has seen ``min_steps``
    steps or while it is not positive (a calibration's neutral value)."""
    if den.n < min_steps or den.value <= 0:
        return 1.0
    return min(high, max(low, num.value / den.value))


class AcceptanceEstimator:
    """Per-drafter-label acceptance rates and the calibration of what they predict.

    Args:
        alpha: EMA weight of a new observation (a step).
    """

    def __init__(self, alpha: float = 0.05):
        self.alpha = alpha
        self._rates: dict[str, list[EMA]] = {}   # label -> per-position unconditional acceptance
        # calibration, per arm family: extra tokens the steps were expected to add
        # (uncalibrated) and what they committed beyond the bonus token, EMAs per step
        self._calibration = {f: (EMA(alpha), EMA(alpha)) for f in (Family.CHAIN, Family.TREE)}
        # the step about to run: its family and, per job index, its expected extra tokens
        self._pending: tuple[Family, dict[int, float]] | None = None
        self._trees: dict[tuple[str, int], EMA] = {}   # (label, budget) -> committed per tree step
        self._hybrid: dict[str, tuple[EMA, EMA]] = {}   # label -> (predicted, realized) gain per step

    # ------------------------------------------------------------------ rates
    def observe(self, label: str, blocks: Sequence[tuple[int, int]]) -> None:
        """One step's verified blocks of drafter ``label``: ``(drafts, accepted drafts)`` each.

        One EMA update per position per step, with the fraction of the step's blocks that
        drafted the position and accepted it: the EMA then remembers a number of steps whatever
        the batch size (per block, one step of 32 sessions would move it as far as 32 steps)."""
        blocks = [(d, a) for d, a in blocks if d > 0]
        if not blocks:
            return
        rates = self._rates.setdefault(label, [])
        top = max(d for d, _ in blocks)
        while len(rates) < top:
            rates.append(EMA(self.alpha))
        for p in range(top):
            drafted = [a for d, a in blocks if d > p]
            rates[p].add(sum(a > p for a in drafted) / len(drafted))

    def rates(self, label: str) -> list[float]:
        """Per-position unconditional acceptance rates (EMA) of drafter ``label``."""
        return [e.value for e in self._rates.get(label, [])]

    def acceptance_table(self) -> dict[str, list[float]]:
        """drafter label -> per-position EMA acceptance (a copy, for metrics)."""
        return {label: [e.value for e in v] for label, v in list(self._rates.items())}

    def expected_table(self, label: str, top: int) -> list[float]:
        """``[E[0], E[1], ..., E[top]]`` tokens for drafter ``label``: ``E[k] = 1 + sum of the
        first k rates``. Positions never measured extrapolate geometrically from the last
        measured conditional rate (an optimistic 0.9 before anything was measured)."""
        rates = self._rates.get(label, [])
        table, total, prev, cond = [1.0], 1.0, 1.0, 0.9
        for p in range(top):
            if p < len(rates):
                r = rates[p].value
                cond = r / prev if prev > 0 else 0.0
            else:
                r = prev * min(cond, 1.0)
            prev = r
            total += r
            table.append(total)
        return table

    def expected_tokens(self, label: str, k: int) -> float:
        """E[committed tokens] of one step with ``k`` drafts of drafter ``label``."""
        return self.expected_table(label, k)[k]

    # ------------------------------------------------------------------ trees
    def observe_trees(self, label: str, rows: Sequence[tuple[int, int]]) -> None:
        """One step's tree rows of drafter ``label``: ``(budget, committed tokens)`` each (the
        bonus token included). One EMA update per budget per step with the step's mean."""
        by_budget: dict[int, list[int]] = {}
        for budget, committed in rows:
            by_budget.setdefault(budget, []).append(committed)
        for budget, got in by_budget.items():
            self._trees.setdefault((label, budget), EMA(self.alpha)).add(sum(got) / len(got))

    def tree_expected(self, label: str, budget: int) -> float | None:
        """E[committed tokens] of one tree step with ``budget`` nodes of drafter ``label``, or
        None until ``TREE_MEASURED_STEPS`` steps were seen."""
        e = self._trees.get((label, budget))
        return e.value if e is not None and e.n >= TREE_MEASURED_STEPS else None

    def tree_table(self) -> dict[tuple[str, int], float]:
        """(label, budget) -> EMA committed tokens per tree step (a copy, for metrics)."""
        return {key: e.value for key, e in list(self._trees.items())}

    def observe_hybrid(self, label: str, rows: Sequence[tuple[float, float]]) -> None:
        """One step's hybrid trees of drafter ``label``: ``(predicted, realized)`` gain each, in
        tokens: the suffix candidates' predicted gain before calibration
        (``Sourced.gain``), and the tokens committed beyond what the drafter's own nodes of the
        path commit. One EMA update of each sum per step."""
        if not rows:
            return
        pred, real = self._hybrid.setdefault(label, (EMA(self.alpha), EMA(self.alpha)))
        pred.add(sum(p for p, _ in rows))
        real.add(sum(r for _, r in rows))

    def hybrid_factor(self, label: str) -> float:
        """Realized / predicted gain of drafter ``label``'s recent hybrid trees, in [0, 1.5];
        1.0 until ``HYBRID_MEASURED_STEPS`` steps were seen."""
        e = self._hybrid.get(label)
        return ema_ratio(e[1], e[0], HYBRID_MEASURED_STEPS, 0.0) if e is not None else 1.0

    def hybrid_table(self) -> dict[str, float]:
        """drafter label -> :meth:`hybrid_factor` (for metrics)."""
        return {label: self.hybrid_factor(label) for label in list(self._hybrid)}

    # ------------------------------------------------------------------ calibration
    def expect(self, indices: Sequence[int], extra: float | Sequence[float],
               family: Family = Family.CHAIN) -> None:
        """The step about to run is speculative with an arm of ``family``: jobs ``indices``
        (positions in the step's job list) are expected to commit ``extra`` tokens beyond the
        bonus (before this family's calibration): a total spread evenly over them, or one
        figure per job in the order of ``indices``; a ``Family.SUFFIX`` step teaches nothing here
        (its candidates' cells learn from the walk). Raises ValueError for another family."""
        if self._calibrated(family) is None:
            self._pending = None
            return
        each = [extra / len(indices)] * len(indices) if isinstance(extra, (int, float)) \
            else list(extra)
        self._pending = (family, dict(zip(indices, each)))

    def clear_expectation(self) -> None:
        """The step about to run feeds no calibration (no speculative adaptive job)."""
        self._pending = None

    def observe_outcome(self, committed: Sequence[int], skip: Collection[int] = ()) -> None:
        """Tokens each job of the step just run emitted (bonus token included), indexed like the
        step's jobs. Only a step announced by :meth:`expect` counts, without the jobs ``skip``
        (their drafts never arrived: a failed or cut-off drafter is not a wrong estimate); the
        expectation is used up."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        family, expected = pending
        idx = [i for i in expected if i not in skip]
        if not idx:
            return
        exp_e, com_e = self._calibration[family]
        exp_e.add(sum(expected[i] for i in idx))
        com_e.add(sum(max(committed[i] - 1, 0) for i in idx))

    def accuracy_of(self, family: Family) -> float:
        """Committed / expected extra tokens of the recent adaptive steps that ran an arm of
        ``family`` (1.0 until ``CALIBRATION_MIN_STEPS`` were seen), clamped to
        [``CALIBRATION_FLOOR``, 1.5]. Per-request estimates run
        above what steps commit under load (acceptance falls within an answer faster than its
        counts follow), by as much as the margin between speculating and not. 1.0 for
        ``Family.SUFFIX`` (calibrated per candidate cell)."""
        emas = self._calibrated(family)
        if emas is None:
            return 1.0
        exp_e, com_e = emas
        return ema_ratio(com_e, exp_e, CALIBRATION_MIN_STEPS, CALIBRATION_FLOOR)

    def _calibrated(self, family: Family) -> tuple[EMA, EMA] | None:
        """``family``'s (expected, committed) EMAs; None for ``Family.SUFFIX``, which has none.
        Raises ValueError for a name not in :data:`ARM_FAMILIES`."""
        if family not in ARM_FAMILIES:
            raise ValueError(f"family: one of {', '.join(ARM_FAMILIES)}, got {family!r}")
        return self._calibration.get(family)

    @property
    def accuracy(self) -> float:
        """The chains' calibration (:meth:`accuracy_of` ``Family.CHAIN``)."""
        return self.accuracy_of(Family.CHAIN)
