"""Speculation policy: how many drafts each session verifies this step (0 = no speculation).

Modes, per deployment (``--spec-mode``) and per request (``SpeculationParams.mode``):

* ``off``: never speculate (the drafter is not called; plain autoregressive steps).
* ``fixed``: always the request's block size (``block_size - 1`` drafts).
* ``adaptive``: per step, the ``k`` that maximises expected committed tokens per second of the
  whole batch::

      k* = argmax_k  sum_i (1 + accuracy * (E_i[k] - 1)) / cost(B, K)

  ``E_i[k]``: expected committed tokens of request ``i`` with ``k`` drafts, bonus included, and
  ``accuracy``, the calibration of those expectations (``verifier_svc/acceptance.py``);
  ``cost(B, K)``: seconds of one cycle of ``B`` sessions whose largest block has ``K = max(k,
  fixed blocks)`` drafts, the per-cycle overhead included (``verifier_svc/cost_model.py``).

  The overhead outside verify and draft is paid once per step whatever k is; leaving it out
  would favour short blocks and no speculation.

  ``k = 0`` is "no speculation": the drafter still receives the new context features (a block
  of size 1 = context update only), so its context stays current and acceptance does not
  collapse when speculation resumes. In each batch bucket ``k = 0`` is measured first: it is
  the baseline the others must beat, and the cheapest step to try. Until the cost model has a
  fit, unmeasured candidates are tried in order; now and then a neighbour of the best k is
  re-measured, so the estimates follow load and acceptance, ever less often around a best arm
  that keeps its lead (``verifier_svc/exploration.py``).

  Trees (``verifier_svc/tree.py``, DDTree): when the target and the job allow them, each node
  budget ``N`` of ``tree_budgets`` is one more candidate, priced like a chain of ``N`` drafts
  (the verify forward carries ``N + 1`` tokens either way) and valued by the measured tokens a
  tree step of that budget commits (``AcceptanceEstimator.tree_expected``; until measured, the
  chain's ``E[min(N, limit)]``, a floor: a best-first tree of ``N`` nodes holds the drafter's
  top-1 chain as deep as its budget reaches). Each budget is tried until measured, then
  re-measured when exploration falls on it.

* ``tree``: always a tree of the request's (or the deployment's) node budget.
* ``suffix``: a tree of the session's suffix candidates (``verifier_svc/suffix_drafts.py``),
  ``n`` nodes for the ``n`` that maximises ``expected(n) / cost(n)``: the candidates' calibrated
  probabilities against the verify cost of ``n`` more rows (no drafter time); ``n = 0`` (plain
  decoding) when no candidate pays. Jobs of a speculating mode without a drafter speculate so.
* ``hybrid``: a tree as in ``tree`` mode with the suffix candidates worth more than the
  drafter's marginal node merged in (:meth:`SpeculationPolicy.drafter_node_value`).

  Adaptive trees are hybrid, their value the tree's plus what the suffix nodes add over the
  drafter nodes they displace; suffix-only trees of every size up to the largest budget are
  more arms, priced without the drafter's time by the verify cells (steps that verified suffix
  candidates alone feed no step cell: theirs has no draft time). Both need ``tree_budgets`` and
  a batch within ``tree_max_batch``.

  While prompts wait for prefill, adaptive sessions do not speculate: the scheduler runs one
  prefill chunk per step, so a longer step holds every waiting request out of the batch for
  longer, and a bigger batch decodes each token more cheaply than speculation on a smaller one.

What a step teaches the policy arrives in one :class:`StepFeedback`, fed to
:meth:`SpeculationPolicy.observe`. The inputs of every decision (``Decision``) travel on the step's ``StepEvent`` to
metrics and spans. Thread model: only the scheduler thread calls ``choose`` / ``observe*``.
"""

from __future__ import annotations

from typing import Collection, Sequence

from dflash.core.speculation import (
    MODE_ADAPTIVE,
    MODE_FIXED,
    MODE_HYBRID,
    MODE_SUFFIX,
    MODE_TREE,
    MODES,
)
from verifier_svc.acceptance import SESSION_PRIOR_STEPS, TREE, AcceptanceEstimator, session_table
from verifier_svc.arms import Arms, Batch, Expectations, family, hybrid_shape, limits, tree_shape
from verifier_svc.cost_model import Fit, StepCostModel, _Cell, bucket, relative_rows
from verifier_svc.exploration import DEFAULT_EXPLORE_BACKOFF, Exploration
from verifier_svc.shapes import CANDIDATES, MIXED, Arm, Decision, PolicyJob, Shape, StepChoice, StepFeedback
from verifier_svc.suffix_drafts import SuffixOffer, suffix_gain

__all__ = ["MODES", "MIXED", "CANDIDATES", "SESSION_PRIOR_STEPS", "Arm", "Decision", "PolicyJob",
           "Shape", "SpeculationPolicy", "StepChoice", "StepFeedback", "bucket", "session_table"]

#: Node budgets the adaptive policy tries (``--tree-budgets``): small enough that a verify
#: stays within a few decodes' cost; the policy keeps only those that pay on the deployment.
#: With the anchor a tree of n nodes is n + 1 rows: 4, 8 and 16 rows suit a CPU's vector
#: kernels, one row more costs up to a third more (docs/trees.md, "Row counts").
DEFAULT_TREE_BUDGETS = (3, 7, 15)
#: Nodes of a tree in mode "tree" when the request names none (``--tree-budget``): 16 rows.
DEFAULT_TREE_BUDGET = 15
#: Largest batch whose adaptive steps may verify trees (``--tree-max-batch``; 0: any).
DEFAULT_TREE_MAX_BATCH = 1
#: Floor of the drafter's marginal node value (expected tokens per node): a suffix candidate
#: below it never displaces a drafter node.
MIN_NODE_VALUE = 0.02


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
            batch). On the CPUs measured trees paid at batch 1 and cost 3-7% against chains at
            8 and 32 sessions, where every row is compute (docs/trees.md, "Under load").
    """

    def __init__(self, mode: str = MODE_FIXED, *, alpha: float = 0.05, explore_every: int = 25,
                 explore_backoff: int = DEFAULT_EXPLORE_BACKOFF,
                 tree_budgets: Sequence[int] = DEFAULT_TREE_BUDGETS,
                 tree_max_batch: int = DEFAULT_TREE_MAX_BATCH):
        if mode not in MODES:
            raise ValueError(f"spec_mode: {mode!r} not one of {', '.join(MODES)}")
        if any(n < 1 for n in tree_budgets):
            raise ValueError(f"tree_budgets: every budget must be >= 1, got {list(tree_budgets)}")
        if tree_max_batch < 0:
            raise ValueError(f"tree_max_batch: must be >= 0, got {tree_max_batch}")
        self.mode = mode
        self.tree_budgets = tuple(sorted(set(tree_budgets)))
        self.tree_max_batch = tree_max_batch
        self.alpha = alpha
        self.explore = Exploration(explore_every, explore_backoff)
        self.acceptance = AcceptanceEstimator(alpha)
        self.costs = StepCostModel(alpha)
        self._steps = 0

    # ------------------------------------------------------------------ inputs
    def observe(self, fb: StepFeedback) -> None:
        """Everything one step teaches: its verify seconds (always: the drafters' deadline is
        derived from them), its cost (if ``record_cost``), each drafter's acceptance, the
        calibration outcome, the cycle overhead (if known). Through the ``observe_*`` methods,
        so a wrapper on one of them sees the step."""
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
        batch = Batch.of(jobs, offers)
        shapes = [self._pinned_shape(batch, i) for i in range(len(jobs))]
        if not batch.adaptive:
            modes = set(batch.modes)
            return StepChoice(shapes, Decision(mode=batch.modes[0] if len(modes) == 1 else MIXED,
                                               k=-1, batch=len(jobs)))
        if waiting:
            return StepChoice(shapes, Decision(mode=MODE_ADAPTIVE, k=0, batch=len(jobs),
                                               waiting=waiting))
        ex = Expectations(self, jobs, batch.limits)
        arms = Arms(self, batch, shapes, ex)
        best, explored = self._pick(arms)
        for i in batch.adaptive:
            shapes[i] = batch.adaptive_shape(i, best)
        # a speculative arm valued by measurements teaches its family's calibration; a tree
        # not yet measured is valued by the chain's prior, which would skew the ratio for good
        if (best.k > 0 or best.budget) and not (family(best) == TREE and arms.untried(best)):
            self.acceptance.expect(batch.adaptive, arms.raw(best), family(best))
        return StepChoice(shapes, arms.decision(best, explored), ex)

    def _pinned_shape(self, batch: Batch, i: int) -> Shape:
        """Job ``i``'s shape when its mode fixes it (an adaptive job's placeholder: no drafts)."""
        m, lim, budget, offer = batch.modes[i], batch.limits[i], batch.budgets[i], batch.offers[i]
        if m == MODE_FIXED:
            return Shape(lim)
        if m == MODE_TREE:
            return tree_shape(lim, budget)
        if m == MODE_HYBRID:
            return hybrid_shape(lim, budget, offer is not None)
        if m == MODE_SUFFIX:
            return self.suffix_shape(offer, batch.bucket, budget, batch.suffix_limits[i])
        return Shape(0)

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
        the next tree, and the chains it beat were never measured again, docs/trees.md "Under
        load"); at either end the one neighbour every time (from k = 0 the alternation would
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
        """How many of ``offer``'s candidates to verify alone at batch bucket ``b``:
        ``argmax_n expected(n) / suffix_cost(b, n)`` over ``0..budget`` (0: none pays)."""
        if offer is None or not limit or not budget:
            return 0
        depths = offer.trie.depths
        usable = sum(1 for j in offer.order[:budget] if depths[j] <= limit)
        model = self.costs.fit()
        best, best_rate = 0, 1.0 / max(self.suffix_cost(b, 0, model), 1e-9)
        for n in range(1, usable + 1):
            r = offer.expected(n) / max(self.suffix_cost(b, n, model), 1e-9)
            if r > best_rate:
                best, best_rate = n, r
        return best

    def suffix_cost(self, b: int, n: int, model: Fit | None) -> float:
        """Seconds of one cycle at bucket ``b`` verifying ``n`` suffix nodes without drafts:
        the step without speculation plus the verify rows ``n`` adds
        (:meth:`StepCostModel.verify_estimate`). Unmeasured, relative units of the same scale
        (:func:`verifier_svc.cost_model.relative_rows`)."""
        v0, vn = self.costs.verify_estimate(b, 0), self.costs.verify_estimate(b, n)
        if v0 is None or vn is None or not (self.costs.measured(b, 0) or model is not None):
            return relative_rows(n)
        return self.costs.estimate(b, 0, model) + max(0.0, vn - v0)

    def drafter_node_value(self, label: str, budget: int, limit: int) -> float:
        """Expected tokens the drafter's last nodes of a ``budget``-node tree add, per node:
        the measured tree values' slope below ``budget``, else the chain's at ``min(budget,
        limit)`` (a suffix candidate displaces such a node only when it is worth more)."""
        e_n = self.acceptance.tree_expected(label, budget)
        if e_n is not None:
            lower = [(n, self.acceptance.tree_expected(label, n)) for n in self.tree_budgets if n < budget]
            known = [(n, v) for n, v in lower if v is not None]
            n0, v0 = known[-1] if known else (0, 1.0)
            return max(MIN_NODE_VALUE, (e_n - v0) / (budget - n0))
        k = max(1, min(budget, limit))
        table = self.acceptance.expected_table(label, k)
        return max(MIN_NODE_VALUE, table[k] - table[k - 1])

    def hybrid_gain(self, offer: SuffixOffer | None, label: str, budget: int, limit: int) -> float:
        """What ``offer``'s candidates add to a ``budget``-node drafter tree: each one worth
        more than the drafter's marginal node adds the difference (``suffix_gain``), scaled by
        what recent hybrid trees realized of their prediction (``hybrid_factor``)."""
        if offer is None or not limit:
            return 0.0
        theta = self.drafter_node_value(label, budget, limit)
        return self.acceptance.hybrid_factor(label) * suffix_gain(offer, theta, limit, budget)

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
        ex = expectations or Expectations(self, jobs, limits(jobs), per_request=False)
        tokens = sum(ex.shape(i, sh) for i, sh in enumerate(shapes)) / len(jobs)
        return self.costs.draft_budget(len(jobs), k, tokens)
