"""Speculation policy: how many drafts each session verifies this step (0 = no speculation),
and in which shape (chain, DDTree tree, suffix candidates, both).

Modes, per deployment (``--spec-mode``) and per request (``SpeculationParams.mode``): ``off``,
``fixed`` (the request's block), ``tree`` (a tree of the node budget), ``suffix`` (the session's
suffix candidates, ``verifier_svc/suffix_drafts.py``), ``hybrid`` (a tree with the suffix
candidates merged in) and ``adaptive``: per step, the shape that maximises the batch's expected
committed tokens per second, ``argmax_k sum_i (1 + accuracy * (E_i[k] - 1)) / cost(B, K)``,
from the online acceptance (``verifier_svc/acceptance.py``) and cost (``verifier_svc/cost_model.py``)
estimates, with exploration (``verifier_svc/exploration.py``), and optionally a race of whole
modes (``verifier_svc/mode_race.py``). ``k = 0`` still sends the drafter its context. While
prompts wait for prefill, adaptive sessions do not speculate. The derivation, the priors and
the measurements behind each rule: docs/batching.md and docs/trees.md.

What a step teaches the policy arrives in one :class:`StepFeedback`, fed to
:meth:`SpeculationPolicy.observe`. The inputs of every decision (``Decision``) travel on the
step's ``StepEvent`` to metrics and spans. Thread model: only the scheduler thread calls
``choose`` / ``observe*``.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

from dflash.core.speculation import MODES, SpecMode
from verifier_svc import suffix_value
from verifier_svc.acceptance import SESSION_PRIOR_STEPS, AcceptanceEstimator, Family, session_table
from verifier_svc.arms import Arms, Batch, Expectations, family, limits
from verifier_svc.cost_model import Fit, StepCostModel, _Cell, bucket
from verifier_svc.decision import Decision, StepMode
from verifier_svc.exploration import DEFAULT_EXPLORE_BACKOFF, Exploration
from verifier_svc.mode_race import ModeRace
from verifier_svc.race_arms import DEFAULT_RACE_ARMS, available, mode_shape, race_arms as race_arms_of, split_arm
from verifier_svc.shapes import CANDIDATES, Arm, PolicyJob, Shape, StepChoice, StepFeedback
from verifier_svc.suffix_drafts import SuffixOffer

__all__ = ["MODES", "StepMode", "CANDIDATES", "DEFAULT_RACE_ARMS", "SESSION_PRIOR_STEPS", "Arm", "Decision",
           "PolicyJob", "Shape", "split_arm", "SpeculationPolicy", "StepChoice", "StepFeedback", "bucket", "session_table"]

#: Node budgets the adaptive policy tries (``--tree-budgets``): small enough that a verify
#: stays within a few decodes' cost; the policy keeps only those that pay on the deployment.
#: With the anchor a tree of n nodes is n + 1 rows: 4, 8 and 16 rows suit a CPU's vector
#: kernels, one row more costs up to a third more (docs/bench/trees-history/README.md, "Row counts").
DEFAULT_TREE_BUDGETS = (3, 7, 15)
#: Nodes of a tree in mode "tree" when the request names none (``--tree-budget``): 16 rows.
DEFAULT_TREE_BUDGET = 15
#: Largest batch whose adaptive steps may verify trees (``--tree-max-batch``; 0: any).
DEFAULT_TREE_MAX_BATCH = 1


class SpeculationPolicy:
    """Chooses per-step block lengths from an :class:`AcceptanceEstimator` and a
    :class:`StepCostModel`, both learnt online.

    Args:
        mode: the deployment default, one of ``MODES``.
        alpha: EMA weight of a new observation.
        explore_every, explore_backoff: the exploration schedule's first and longest gap
            around a best arm (:class:`verifier_svc.exploration.Exploration`, the policy's
            ``explore``; 0: never explore).
        tree_budgets: node budgets adaptive jobs may verify as trees (empty: chains only).
        tree_max_batch: adaptive steps of more sessions than this verify chains only (0: any
            batch): where every row is compute, the extra rows of trees can cost more than they
            commit (docs/bench/trees-history/README.md, "Measurements").
        race: race whole modes per batch bucket (:class:`verifier_svc.mode_race.ModeRace`,
            the policy's ``race``): adaptive jobs play the mode with the most measured tokens
            per second, the per-step choice being one of them. ``race_arms``: the modes raced
            (``off``, ``fixed``, ``tree:n``, ``hybrid:n``, ``suffix``, ``adaptive``; ``{N}``:
            the largest tree budget); ``race_kw``: the schedule's settings. Raises ValueError
            for an arm that is no mode.
    """

    def __init__(self, mode: str = SpecMode.FIXED, *, alpha: float = 0.05, explore_every: int = 25,
                 explore_backoff: int = DEFAULT_EXPLORE_BACKOFF,
                 tree_budgets: Sequence[int] = DEFAULT_TREE_BUDGETS,
                 tree_max_batch: int = DEFAULT_TREE_MAX_BATCH, race: bool = False,
                 race_arms: Sequence[str] = DEFAULT_RACE_ARMS, race_kw: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"spec_mode: {mode!r} not one of {', '.join(MODES)}")
        if any(n < 1 for n in tree_budgets):
            raise ValueError(f"tree_budgets: every budget must be >= 1, got {list(tree_budgets)}")
        if tree_max_batch < 0:
            raise ValueError(f"tree_max_batch: must be >= 0, got {tree_max_batch}")
        self.mode = SpecMode(mode)
        self.tree_budgets = tuple(sorted(set(tree_budgets)))
        self.tree_max_batch = tree_max_batch
        self.alpha = alpha
        self.explore = Exploration(explore_every, explore_backoff)
        self.acceptance = AcceptanceEstimator(alpha)
        self.costs = StepCostModel(alpha)
        self._steps = 0
        self.race: ModeRace | None = None
        if race:
            arms = race_arms_of(race_arms, max(self.tree_budgets, default=0))
            self.race = ModeRace(arms, **(race_kw or {}))
        # the race's step about to run: (bucket, arm, adaptive job indices, explored)
        self._race_step: tuple[int, str, tuple[int, ...], bool] | None = None

    # ------------------------------------------------------------------ inputs
    def observe(self, fb: StepFeedback) -> None:
        """Everything one step teaches: its verify seconds (always: the drafters' deadline is
        derived from them), its cost (if ``record_cost``), each drafter's acceptance, the
        calibration outcome, the cycle overhead (if known), the race's reward. Through the
        ``observe_*`` methods, so a wrapper on one of them sees the step."""
        self.observe_race(fb)
        self.observe_verify(fb.batch, fb.k, fb.verify_seconds)
        if fb.record_cost:
            self.observe_step(fb.batch, fb.k, fb.verify_seconds, fb.draft_seconds)
        for label, label_blocks in fb.blocks.items():
            self.observe_acceptance(label, label_blocks)
        for label, rows in fb.trees.items():
            self.acceptance.observe_trees(label, rows)
        for label, gains in fb.hybrid.items():
            self.acceptance.observe_hybrid(label, gains)
        self.observe_outcome(fb.committed, fb.fell_back)
        if fb.cycle_overhead is not None:
            self.observe_overhead(fb.cycle_overhead)

    def observe_race(self, fb: StepFeedback) -> None:
        """The race's reward for the step just chosen: the tokens its adaptive jobs committed
        over the step's seconds (verify, draft, and the cycle's overhead: its own, else the
        EMA)."""
        step, self._race_step = self._race_step, None
        if step is None or self.race is None:
            return
        b, arm, idx, explored = step
        over = fb.cycle_overhead if fb.cycle_overhead is not None else self.costs.overhead_seconds
        seconds = fb.verify_seconds + fb.draft_seconds + over
        self.race.observe(b, arm, float(sum(fb.committed[i] for i in idx if i < len(fb.committed))),
                          seconds, len(idx), explored)

    def observe_acceptance(self, label: str, blocks: Sequence[tuple[int, int]]) -> None:
        """One step's verified blocks of drafter ``label``: ``(drafts, accepted drafts)`` each."""
        self.acceptance.observe(label, blocks)

    def observe_step(self, batch: int, k: int, verify_s: float, draft_s: float) -> None:
        """One step of ``batch`` sessions whose largest block had ``k`` drafts (seconds)."""
        self.costs.observe_step(batch, k, verify_s + draft_s)

    def observe_verify(self, batch: int, k: int, verify_s: float) -> None:
        """The target's verify of one step of ``batch`` sessions, largest block ``k`` drafts."""
        self.costs.observe_verify(batch, k, verify_s)

    def observe_overhead(self, seconds: float) -> None:
        """Seconds of one decode cycle (step end to step end, no prefill in between) spent
        outside verify and draft."""
        self.costs.observe_overhead(seconds)

    def observe_outcome(self, committed: Sequence[int], fell_back: Collection[int] = ()) -> None:
        """Tokens each job of the step just chosen emitted (bonus token included). Speculative
        adaptive steps feed the calibration :attr:`accuracy`; other steps are ignored, and so
        are the jobs ``fell_back`` (indices) whose drafts never arrived."""
        self.acceptance.observe_outcome(committed, fell_back)

    # ------------------------------------------------------------------ figures
    @property
    def accuracy(self) -> float:
        """Committed / expected drafted tokens of recent speculative adaptive steps."""
        return self.acceptance.accuracy

    @property
    def overhead_seconds(self) -> float:
        return self.costs.overhead_seconds

    def acceptance_table(self) -> dict[str, list[float]]:
        """drafter label -> per-position EMA acceptance (a copy, for metrics)."""
        return self.acceptance.acceptance_table()

    def cost_table(self) -> dict[tuple[int, int], float]:
        """(batch bucket, drafts) -> EMA step seconds (a copy, for metrics)."""
        return self.costs.cost_table()

    def rates(self, label: str) -> list[float]:
        """Per-position unconditional acceptance rates (EMA) of drafter ``label``."""
        return self.acceptance.rates(label)

    def expected_tokens(self, label: str, k: int) -> float:
        """E[committed tokens] of one step with ``k`` drafts of drafter ``label``."""
        return self.acceptance.expected_tokens(label, k)

    def expected_table(self, label: str, top: int) -> list[float]:
        """``[E[0], E[1], ..., E[top]]`` for drafter ``label``."""
        return self.acceptance.expected_table(label, top)

    @property
    def _cost(self) -> dict[tuple[int, int], _Cell]:
        """The cost model's measured cells (tests read them)."""
        return self.costs.cells

    def _cost_model(self) -> Fit | None:
        return self.costs.fit()

    def _estimate(self, b: int, k: int, model: Fit | None) -> float:
        return self.costs.estimate(b, k, model)

    # ------------------------------------------------------------------ choice
    def choose(self, jobs: Sequence[PolicyJob], waiting: int = 0) -> list[int]:
        """Drafts per job this step (same order as ``jobs``); :meth:`choose_shapes` without the
        tree budgets."""
        return self.choose_shapes(jobs, waiting).ks

    def choose_shapes(self, jobs: Sequence[PolicyJob], waiting: int = 0,
                      offers: Sequence[SuffixOffer | None] | None = None) -> StepChoice:
        """Each job's block this step and why. ``waiting``: requests whose prompts wait for
        prefill behind this step; ``offers``: each job's suffix candidates this step (None:
        none)."""
        self.acceptance.clear_expectation()
        self._race_step = None
        batch = Batch.of(jobs, offers)
        shapes = [self._pinned_shape(batch, i) for i in range(len(jobs))]
        if not batch.adaptive:
            modes = set(batch.modes)
            return StepChoice(shapes, Decision(mode=batch.modes[0] if len(modes) == 1 else StepMode.MIXED,
                                               k=-1, batch=len(jobs)))
        if waiting:
            return StepChoice(shapes, Decision(mode=SpecMode.ADAPTIVE, k=0, batch=len(jobs),
                                               waiting=waiting))
        if self.race is not None:
            arm, race_explored = self.race.pick(batch.bucket, available(self.race.order, batch))
            self._race_step = (batch.bucket, arm, tuple(batch.adaptive), race_explored)
            if arm != SpecMode.ADAPTIVE:
                return self._race_choice(batch, shapes, arm, race_explored)
        ex = Expectations(self.acceptance, jobs, batch.limits)
        arms = Arms(batch, shapes, ex, acceptance=self.acceptance, costs=self.costs,
                    tree_budgets=self.tree_budgets, tree_max_batch=self.tree_max_batch)
        best, explored = self._pick(arms)
        for i in batch.adaptive:
            shapes[i] = batch.adaptive_shape(i, best)
        # a speculative arm valued by measurements teaches its family's calibration; a tree
        # not yet measured is valued by the chain's prior, which would skew the ratio for good
        if (best.k > 0 or best.budget) and not (family(best) == Family.TREE and arms.untried(best)):
            self.acceptance.expect(batch.adaptive, arms.raw(best), family(best))
        d = arms.decision(best, explored)
        if self._race_step is not None:
            d = dataclasses.replace(d, arm=SpecMode.ADAPTIVE, explored=explored or self._race_step[3])
        return StepChoice(shapes, d, ex)

    def _race_choice(self, batch: Batch, shapes: list[Shape], arm: str, explored: bool) -> StepChoice:
        for i in batch.adaptive:
            shapes[i] = self.arm_shape(arm, batch, i)
        played = [shapes[i] for i in batch.adaptive]
        return StepChoice(shapes, Decision(
            mode=SpecMode.ADAPTIVE, k=max(sh.k for sh in played), batch=len(shapes),
            explored=explored, budget=max(sh.budget for sh in played),
            suffix=all(sh.suffix and not sh.k for sh in played if sh.budget), arm=arm))

    def _pinned_shape(self, batch: Batch, i: int) -> Shape:
        """Job ``i``'s shape when its mode fixes it (an adaptive job's placeholder: no drafts)."""
        return mode_shape(batch.modes[i], batch.budgets[i], batch, i, self.suffix_shape)

    def arm_shape(self, arm: str, batch: Batch, i: int) -> Shape:
        """Adaptive job ``i``'s shape when the step plays race arm ``arm``: the shape the
        job would have pinned in that mode."""
        mode, n = split_arm(arm)
        return mode_shape(mode, n or batch.budgets[i] if mode == SpecMode.SUFFIX else n, batch, i,
                          self.suffix_shape)

    def _pick(self, arms: Arms) -> tuple[Arm, bool]:
        """The arm this step runs and whether it was chosen to measure it: every chain length
        first (until the cost model has a fit), then the bucket's baseline, then the best rate,
        each tree budget once, and at the steps :attr:`explore` names a neighbour of the
        best."""
        if arms.unmeasured and arms.model is None:
            return Arm(arms.unmeasured[0]), True
        if not self.costs.measured(arms.bucket, arms.floor):
            # The step without (further) speculation is the baseline every other k must beat
            # and the cheapest step to try: measure it in every batch bucket rather than
            # extrapolate it (otherwise a large bucket can run k > 0 without ever trying k = 0).
            return Arm(0), True
        best = max(arms.chains + arms.trees + arms.suffix, key=arms.rate)
        explored = best.k in arms.unmeasured if not best.budget else False
        untried = [a for a in arms.trees if arms.untried(a)]
        self._steps += 1
        if untried:   # each budget is measured once, early: explorations of their own
            self.explore.took(self._steps)
            return untried[0], True
        if self.explore.now(self._steps, best, arms.bucket):
            nb = self._neighbour(arms, best)
            return nb, nb != best
        return best, explored

    def _neighbour(self, arms: Arms, best: Arm) -> Arm:
        """Alternately the next larger and the next smaller arm by rows verified, a tree of n
        nodes just after the chain of n drafts (its neighbours are the chains of about its
        cost: listed after every chain, a small tree's neighbours were the longest chain and
        the next tree, and the chains it beat were never measured again); at either end the one neighbour every time (from k = 0 the alternation would
        make every other exploration a k = 0 step). A suffix-only tree's neighbours are its
        drafter arm nearest its size's."""
        by_size = sorted(arms.chains + arms.trees, key=lambda a: (a.rows, a.budget > 0))
        if best.suffix_only:   # sized freely: the drafter arm of the nearest size stands in
            best = min(by_size, key=lambda a: (abs(a.rows - best.rows), a.budget == 0))
        i = by_size.index(best)
        up = self.explore.count % 2 == 1 or i == 0
        return by_size[min(i + 1, len(by_size) - 1)] if up and i + 1 < len(by_size) \
            else by_size[max(i - 1, 0)]

    # ------------------------------------------------------------------ suffix candidates
    def suffix_shape(self, offer: SuffixOffer | None, b: int, budget: int, limit: int) -> Shape:
        """Mode ``suffix``'s shape for one job: a tree of the ``n <= budget`` best candidates
        (no deeper than ``limit``) for the ``n`` with the most expected tokens per second,
        ``Shape(0)`` when that is none."""
        n = self.suffix_size(offer, b, budget, limit)
        return Shape(0, n, True) if n else Shape(0)

    def suffix_size(self, offer: SuffixOffer | None, b: int, budget: int, limit: int) -> int:
        """How many of ``offer``'s candidates to verify alone at batch bucket ``b``
        (:func:`verifier_svc.suffix_value.suffix_size`)."""
        return suffix_value.suffix_size(self.costs, offer, b, budget, limit)

    def suffix_cost(self, b: int, n: int, model: Fit | None) -> float:
        """Seconds of one cycle at bucket ``b`` verifying ``n`` suffix nodes without drafts
        (:func:`verifier_svc.suffix_value.suffix_cost`)."""
        return suffix_value.suffix_cost(self.costs, b, n, model)

    def drafter_node_value(self, label: str, budget: int, limit: int) -> float:
        """Expected tokens per node of the drafter's last nodes of a ``budget``-node tree
        (:func:`verifier_svc.suffix_value.drafter_node_value`)."""
        return suffix_value.drafter_node_value(self.acceptance, self.tree_budgets, label, budget, limit)

    def hybrid_gain(self, offer: SuffixOffer | None, label: str, budget: int, limit: int) -> float:
        """What ``offer``'s candidates add to a ``budget``-node drafter tree
        (:func:`verifier_svc.suffix_value.hybrid_gain`)."""
        return suffix_value.hybrid_gain(self.acceptance, self.tree_budgets, offer, label, budget, limit)

    # ------------------------------------------------------------------ the drafters' deadline
    def draft_budget(self, jobs: Sequence[PolicyJob], shapes: Sequence[Shape],
                     expectations: Expectations | None = None) -> float | None:
        """Seconds this step's drafter calls may take before speculating costs more than not
        speculating: :meth:`StepCostModel.draft_budget` at the step's batch and largest block,
        with each job's expected committed tokens for its shape (1 for a job not speculating),
        as the choice of blocks values them (``expectations``, a :class:`StepChoice`'s). None when the step drafts nothing or the cost
        model has no verify cell for the batch's bucket yet (the caller then waits up to its
        own cap)."""
        k = max((sh.verified for sh in shapes), default=0)
        if not jobs or not k:
            return None
        # the choice's own figures when it made them (adaptive jobs); otherwise the drafters'
        # tables alone: a per-request table for every session of a large batch costs too much
        # for a deadline estimate
        ex = expectations or Expectations(self.acceptance, jobs, limits(jobs), per_request=False)
        tokens = sum(ex.shape(i, sh) for i, sh in enumerate(shapes)) / len(jobs)
        return self.costs.draft_budget(len(jobs), k, tokens)
