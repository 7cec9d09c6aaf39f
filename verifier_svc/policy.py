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
  fit, unmeasured candidates are tried in order; a neighbour of the best k is re-measured every
  ``explore_every`` steps so the estimates follow load and acceptance.

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
  drafter nodes they displace; a suffix-only tree is one more arm per budget, priced without
  the drafter's time. Both need ``tree_budgets`` and a batch within ``tree_max_batch``.

  While prompts wait for prefill, adaptive sessions do not speculate: the scheduler runs one
  prefill chunk per step, so a longer step holds every waiting request out of the batch for
  longer, and a bigger batch decodes each token more cheaply than speculation on a smaller one.

What a step teaches the policy arrives in one :class:`StepFeedback`, fed to
:meth:`SpeculationPolicy.observe`. The inputs of every decision (``Decision``) travel on the step's ``StepEvent`` to
metrics and spans. Thread model: only the scheduler thread calls ``choose`` / ``observe*``.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Protocol, Sequence

from dflash.core.speculation import (
    MODE_ADAPTIVE,
    MODE_FIXED,
    MODE_HYBRID,
    MODE_OFF,
    MODE_SUFFIX,
    MODE_TREE,
    MODES,
    SUFFIX_MODES,
)
from verifier_svc.acceptance import SESSION_PRIOR_STEPS, AcceptanceEstimator, PositionCounts, session_table
from verifier_svc.cost_model import Fit, StepCostModel, _Cell, bucket, relative_rows
from verifier_svc.suffix_drafts import SuffixOffer

__all__ = ["MODES", "MIXED", "CANDIDATES", "SESSION_PRIOR_STEPS", "Decision", "PolicyJob", "Shape",
           "SpeculationPolicy", "StepFeedback", "bucket", "session_table"]

#: Node budgets the adaptive policy tries (``--tree-budgets``): small enough that a verify
#: stays within a few decodes' cost; the policy keeps only those that pay on the deployment.
#: With the anchor a tree of n nodes is n + 1 rows: 4, 8 and 16 rows suit a CPU's vector
#: kernels, one row more costs up to a third more (docs/trees.md, "Row counts").
DEFAULT_TREE_BUDGETS = (3, 7, 15)
#: Nodes of a tree in mode "tree" when the request names none (``--tree-budget``): 16 rows.
DEFAULT_TREE_BUDGET = 15
#: Largest batch whose adaptive steps may verify trees (``--tree-max-batch``; 0: any).
DEFAULT_TREE_MAX_BATCH = 1
# Candidate draft counts: dense where acceptance changes fastest, sparse in the tail.
CANDIDATES = (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 15, 23, 31, 47, 63)
#: ``Decision.mode`` of a step without adaptive sessions whose sessions' modes differ.
MIXED = "mixed"
#: Floor of the drafter's marginal node value (expected tokens per node): a suffix candidate
#: below it never displaces a drafter node.
MIN_NODE_VALUE = 0.02


@dataclasses.dataclass(frozen=True)
class Shape:
    """One job's block this step: ``k`` drafts asked of the drafter (0: no speculation);
    ``budget`` > 0: verify a DDTree of at most ``budget`` nodes built from the drafter's top-k
    over those ``k`` positions instead of the chain."""

    k: int
    budget: int = 0
    #: suffix candidates join the tree (``k`` > 0: merged into the drafter's, a hybrid tree;
    #: ``k`` = 0: a tree of ``budget`` suffix nodes alone)
    suffix: bool = False

    @property
    def verified(self) -> int:
        """Tokens after the anchor the target verifies (the cost model's ``k``)."""
        return self.budget if self.budget and (self.k or self.suffix) else self.k


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's choice and the figures it was made from (for metrics and spans)."""

    mode: str                       # MODE_ADAPTIVE if any session is adaptive, else the batch's
                                    # mode (MIXED: several)
    k: int                          # drafts chosen for adaptive sessions (-1: none adaptive)
    batch: int
    expected_tokens: float = 0.0    # sum over adaptive sessions of E_i[k]
    cost_seconds: float = 0.0       # estimated step seconds at k
    explored: bool = False
    waiting: int = 0                # prompts waiting for prefill (adaptive: no speculation)
    budget: int = 0                 # tree node budget chosen (0: a chain of k drafts)
    suffix: bool = False            # the chosen tree is of suffix candidates alone


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepFeedback:
    """What one decode step teaches the policy; fed once, to :meth:`SpeculationPolicy.observe`."""

    batch: int                      # sessions in the step
    k: int                          # drafts of the step's largest block
    verify_seconds: float           # the target's forward over every block
    draft_seconds: float = 0.0      # the drafter calls (0 when the step called no drafter)
    record_cost: bool = True        # False: a ramp or joining step, not what a steady step costs
    # drafter label -> (drafts, accepted drafts) per verified block with drafts
    blocks: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    committed: list[int]            # tokens each job emitted (bonus included), in job order
    cycle_overhead: float | None = None   # cycle seconds outside verify + draft; None: not a
                                          # per-step cost (a prefill chunk ran, the loop idled)
    # drafter label -> (node budget, committed tokens) per verified tree (kept out of ``blocks``:
    # a tree's depth acceptance is not a chain's position acceptance)
    trees: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    # jobs (indices) whose wanted block is missing (the drafter failed, or its circuit is open):
    # they say nothing about how well the expectations predict acceptance
    fell_back: frozenset[int] = frozenset()


class _Card(Protocol):
    @property
    def label(self) -> str: ...     # drafter version, the key of its acceptance rates


class _Proposer(Protocol):
    @property
    def card(self) -> _Card: ...


class _Request(Protocol):
    max_tokens: int

    @property
    def proposer(self) -> _Proposer | None: ...     # None: no drafter, the job never speculates


class PolicyJob(Protocol):
    """What :meth:`SpeculationPolicy.choose` reads of a job (``verifier_svc.scheduler.Job``)."""

    mode: str                       # one of MODES
    block_limit: int                # the request's block size (drafts + 1)
    emitted: int                    # tokens emitted so far
    @property
    def req(self) -> _Request: ...                  # read-only: a Job's is a full Request

    @property
    def stats(self) -> PositionCounts | None: ...   # the request's acceptance counts (session_table)

    tree_budget: int                # largest tree it may verify (0: chains only)
    suffix_limit: int               # deepest suffix candidate it may verify (0: none)


class SpeculationPolicy:
    """Chooses per-step block lengths from an :class:`AcceptanceEstimator` and a
    :class:`StepCostModel`, both learnt online.

    Args:
        mode: the deployment default, one of ``MODES``.
        alpha: EMA weight of a new observation.
        explore_every: adaptive steps between re-measurements of a neighbouring k (0: never).
        tree_budgets: node budgets adaptive jobs may verify as trees (empty: chains only).
        tree_max_batch: adaptive steps of more sessions than this verify chains only (0: any
            batch). On the CPUs measured trees paid at batch 1 and cost 3-7% against chains at
            8 and 32 sessions, where every row is compute (docs/trees.md, "Under load").
    """

    def __init__(self, mode: str = MODE_FIXED, *, alpha: float = 0.05, explore_every: int = 25,
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
        self.explore_every = explore_every
        self.acceptance = AcceptanceEstimator(alpha)
        self.costs = StepCostModel(alpha)
        self._steps = 0
        self.last_decision: Decision | None = None
        self._last_expectations: tuple[Sequence[PolicyJob], _Expectations] | None = None

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
        return [sh.k for sh in self.choose_shapes(jobs, waiting)]

    def choose_shapes(self, jobs: Sequence[PolicyJob], waiting: int = 0,
                      offers: Sequence[SuffixOffer | None] | None = None) -> list[Shape]:
        """Each job's block this step (same order as ``jobs``). ``waiting``: requests whose
        prompts wait for prefill behind this step; ``offers``: each job's suffix candidates
        this step (None: none)."""
        self.acceptance.clear_expectation()
        self._last_expectations = None
        limits = _limits(jobs)
        offers = list(offers) if offers is not None else [None] * len(jobs)
        budgets = [j.tree_budget for j in jobs]
        slimits = _suffix_limits(jobs)
        modes = [_job_mode(j, slimits[i]) for i, j in enumerate(jobs)]
        b = bucket(len(jobs))
        shapes = [Shape(lim) if m == MODE_FIXED else
                  _tree_shape(lim, budgets[i]) if m == MODE_TREE else
                  _hybrid_shape(lim, budgets[i], offers[i] is not None) if m == MODE_HYBRID else
                  self.suffix_shape(offers[i], b, budgets[i], slimits[i]) if m == MODE_SUFFIX
                  else Shape(0) for i, (m, lim) in enumerate(zip(modes, limits))]
        adaptive = [i for i, m in enumerate(modes) if m == MODE_ADAPTIVE]
        if not adaptive:
            self.last_decision = Decision(mode=modes[0] if len(set(modes)) == 1 else MIXED,
                                          k=-1, batch=len(jobs))
            return shapes
        if waiting:
            self.last_decision = Decision(mode=MODE_ADAPTIVE, k=0, batch=len(jobs), waiting=waiting)
            return shapes
        floor = max(sh.verified for sh in shapes)   # fixed sessions' blocks set the batch's shape
        top = max(limits[i] for i in adaptive)
        cands = [k for k in CANDIDATES if k <= top] + ([top] if top not in CANDIDATES else [])
        # tree arms: only when every adaptive job may verify that budget (one shape per step)
        tree_cap = min(budgets[i] for i in adaptive)
        trees_ok = top and (not self.tree_max_batch or len(jobs) <= self.tree_max_batch)
        arms = [n for n in self.tree_budgets if n <= tree_cap] if trees_ok else []
        ex = self._expectations(jobs, limits)
        e, e_tree, raw, label = ex.chain, ex.tree, ex.raw, ex.label
        costs = self.costs

        fixed_tokens = sum(ex.shape(i, shapes[i]) for i in range(len(jobs)) if modes[i] != MODE_ADAPTIVE)

        # an arm: (k, 0) = a chain of k drafts; (0, n) = a (hybrid) tree of n nodes; (-1, n) =
        # a tree of n suffix candidates alone
        def gain(arm: tuple[int, int]) -> float:
            k, n = arm
            if k < 0:
                return fixed_tokens + sum(_offered(offers[i], n) for i in adaptive)
            if n:
                return fixed_tokens + sum(e_tree(i, n) + self._hybrid_gain(
                    offers[i], label(i), n, slimits[i]) for i in adaptive)
            return fixed_tokens + sum(e(i, min(k, limits[i])) for i in adaptive)

        def size(arm: tuple[int, int]) -> int:
            return max(arm[1] if arm[0] < 0 else arm[0] or arm[1], floor)

        def price(arm: tuple[int, int]) -> float:
            if arm[0] < 0:
                return self.suffix_cost(b, size(arm), model)
            return costs.estimate(b, size(arm), model)

        model = costs.fit()
        chain_arms = [(k, 0) for k in cands]
        # a tree arm is priced by the fit, or by its own measured cell until there is a fit
        all_arms = chain_arms + [(0, n) for n in arms
                                 if model is not None or costs.measured(b, max(n, floor))]
        # suffix-only arms: valued from this step's candidates, never explored
        suffix_arms = [(-1, n) for n in arms if any(
            offers[i] is not None and slimits[i] for i in adaptive)
            if model is not None or costs.measured(b, max(n, floor))]
        unmeasured = [k for k in cands if not costs.measured(b, max(k, floor))]
        explored = False
        if unmeasured and model is None:
            best, explored = (unmeasured[0], 0), True
        elif not costs.measured(b, floor):
            # The step without (further) speculation is the baseline every other k must beat
            # and the cheapest step to try: measure it in every batch bucket rather than
            # extrapolate it (otherwise a large bucket can run k > 0 without ever trying k = 0).
            best, explored = (0, 0), True
        else:
            best = max(all_arms + suffix_arms, key=lambda a: gain(a) / max(price(a), 1e-9))
            explored = best[0] in unmeasured if not best[1] else False
            untried = [n for _, n in all_arms[len(chain_arms):]
                       if any(self.acceptance.tree_expected(label(i), n) is None for i in adaptive)]
            self._steps += 1
            if untried:
                best, explored = (0, untried[0]), True   # each budget is measured once, early
            elif self.explore_every and self._steps % self.explore_every == 0:
                # alternately the next larger and the next smaller arm by rows verified, a tree
                # of n nodes just after the chain of n drafts (its neighbours are the chains of
                # about its cost: listed after every chain, a small tree's neighbours were the
                # longest chain and the next tree, and the chains it beat were never measured
                # again, docs/trees.md "Under load"); at either end the one neighbour every time
                # (from k = 0 the alternation would make every other exploration a k = 0 step)
                by_size = sorted(all_arms, key=lambda a: (a[0] or a[1], a[1] > 0))
                i = by_size.index(best if best[0] >= 0 else (0, best[1]))
                up = (self._steps // self.explore_every) % 2 == 1 or i == 0
                nb = by_size[min(i + 1, len(by_size) - 1)] if up and i + 1 < len(by_size) \
                    else by_size[max(i - 1, 0)]
                best, explored = nb, nb != best
        priced = model is not None or costs.measured(b, size(best))
        cost = price(best) if priced else 0.0
        k_best, n_best = best
        alone = k_best < 0
        self.last_decision = Decision(mode=MODE_ADAPTIVE, k=k_best if not n_best else top,
                                      batch=len(jobs), expected_tokens=gain(best),
                                      cost_seconds=cost, explored=explored, budget=n_best,
                                      suffix=alone)
        for i in adaptive:
            if alone:
                shapes[i] = Shape(0, n_best, True) if offers[i] is not None and slimits[i] else Shape(0)
            elif n_best and limits[i]:
                shapes[i] = _hybrid_shape(limits[i], n_best, offers[i] is not None)
            else:
                shapes[i] = Shape(0 if n_best else min(k_best, limits[i]))
        if k_best > 0 and not n_best:
            self.acceptance.expect(adaptive, [raw(i, shapes[i].k) - 1.0 for i in adaptive])
        return shapes

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

    def _hybrid_gain(self, offer: SuffixOffer | None, label: str, budget: int, limit: int) -> float:
        """What ``offer``'s candidates add to a ``budget``-node drafter tree: each one worth
        more than the drafter's marginal node adds the difference."""
        if offer is None or not limit:
            return 0.0
        theta = self.drafter_node_value(label, budget, limit)
        return sum(offer.probs[j] - theta for j in offer.above(theta, limit)[:budget])

    def _expectations(self, jobs: Sequence[PolicyJob], limits: list[int]) -> _Expectations:
        """The step's :class:`_Expectations`, kept for :meth:`draft_budget` of the same jobs."""
        ex = _Expectations(self, jobs, limits)
        self._last_expectations = (jobs, ex)
        return ex

    # ------------------------------------------------------------------ the drafters' deadline
    def draft_budget(self, jobs: Sequence[PolicyJob], shapes: Sequence[Shape]) -> float | None:
        """Seconds this step's drafter calls may take before speculating costs more than not
        speculating: :meth:`StepCostModel.draft_budget` at the step's batch and largest block,
        with each job's expected committed tokens for its shape (1 for a job not speculating),
        as the choice of blocks values them. None when the step drafts nothing or the cost
        model has no verify cell for the batch's bucket yet (the caller then waits up to its
        own cap)."""
        k = max((sh.verified for sh in shapes), default=0)
        if not jobs or not k:
            return None
        last = self._last_expectations
        # the choice's own figures when it made them (adaptive jobs); otherwise the drafters'
        # tables alone: a per-request table for every session of a large batch costs too much
        # for a deadline estimate
        ex = last[1] if last is not None and last[0] is jobs else \
            _Expectations(self, jobs, _limits(jobs), per_request=False)
        tokens = sum(ex.shape(i, sh) for i, sh in enumerate(shapes)) / len(jobs)
        return self.costs.draft_budget(len(jobs), k, tokens)


def _tree_shape(limit: int, budget: int) -> Shape:
    """A tree of ``budget`` nodes for a job whose block allows ``limit`` drafts: no deeper than
    ``budget`` (each node's parent is in the tree), so the drafter is asked for
    ``min(limit, budget)`` positions, not the whole block (a smaller, cheaper drafter block)."""
    return Shape(min(limit, budget), budget) if limit and budget else Shape(limit)


def _offered(offer: SuffixOffer | None, n: int) -> float:
    """Expected tokens of a tree of ``offer``'s ``n`` best candidates (1: none)."""
    return offer.expected(n) if offer is not None else 1.0


def _hybrid_shape(limit: int, budget: int, suffix: bool) -> Shape:
    """Mode ``hybrid``'s shape: the drafter's tree (as in ``tree`` mode), with the suffix
    candidates when the job has some this step."""
    sh = _tree_shape(limit, budget)
    return Shape(sh.k, sh.budget, True) if sh.budget and suffix else sh


def _job_mode(j: PolicyJob, suffix_limit: int) -> str:
    """The mode a job speculates in this step: a job without a drafter speculates from suffix
    candidates in the modes that may (``SUFFIX_MODES``), else not at all."""
    if j.req.proposer is not None:
        return j.mode
    return MODE_SUFFIX if j.mode in SUFFIX_MODES and suffix_limit else MODE_OFF


def _suffix_limits(jobs: Sequence[PolicyJob]) -> list[int]:
    """Deepest suffix candidate each job may verify this step (its tokens left)."""
    return [max(0, min(j.suffix_limit, j.req.max_tokens - j.emitted - 1)) for j in jobs]


def _limits(jobs: Sequence[PolicyJob]) -> list[int]:
    """Most drafts each job may verify this step (its block size, and its tokens left)."""
    return [max(0, min(j.block_limit - 1, j.req.max_tokens - j.emitted - 1)) for j in jobs]


class _Expectations:
    """Expected committed tokens (bonus included) of one step's jobs, per block shape:

    ``raw(i, k)``: the request's table (the drafter's, moved towards the request's own counts,
    :func:`session_table`) at ``k`` drafts; ``chain(i, k)``: that scaled by the policy's
    calibration, ``1 + accuracy * (raw - 1)``; ``tree(i, n)``: a tree of ``n`` nodes, measured
    per drafter and budget, else the chain of ``min(n, limit)`` drafts. Tables are built once
    per drafter and job (``per_request`` False: the drafter's table for every job). The
    policy's choice of blocks and the drafters' deadline (:meth:`SpeculationPolicy.
    draft_budget`) both read them."""

    def __init__(self, policy: SpeculationPolicy, jobs: Sequence[PolicyJob], limits: list[int],
                 per_request: bool = True):
        self.acceptance, self.accuracy = policy.acceptance, policy.accuracy
        self.jobs, self.limits, self.per_request = jobs, limits, per_request
        self.top = max(limits, default=0)
        self._priors: dict[str, list[float]] = {}   # drafter label -> its E table
        self._tables: dict[int, list[float]] = {}   # job index -> the request's E table

    def label(self, i: int) -> str:
        proposer = self.jobs[i].req.proposer
        assert proposer is not None       # a speculating job has a drafter
        return proposer.card.label

    def raw(self, i: int, k: int) -> float:
        if i not in self._tables:
            lb = self.label(i)
            if lb not in self._priors:
                self._priors[lb] = self.acceptance.expected_table(lb, self.top)
            stats = self.jobs[i].stats if self.per_request else None
            self._tables[i] = session_table(self._priors[lb], stats)
        return self._tables[i][k]

    def chain(self, i: int, k: int) -> float:
        return 1.0 + self.accuracy * (self.raw(i, k) - 1.0)

    def tree(self, i: int, n: int) -> float:
        if not self.limits[i]:
            return 1.0
        measured = self.acceptance.tree_expected(self.label(i), n)
        return measured if measured is not None else self.chain(i, min(n, self.limits[i]))

    def shape(self, i: int, sh: Shape) -> float:
        """Job ``i``'s expected tokens with block ``sh`` (1 without drafts)."""
        if not sh.k:
            return 1.0
        return self.tree(i, sh.budget) if sh.budget else self.chain(i, sh.k)
