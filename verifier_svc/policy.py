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


@dataclasses.dataclass(frozen=True)
class Arm:
    """One candidate block shape for a step's adaptive jobs: a chain of ``k`` drafts
    (``budget`` 0), a tree of ``budget`` nodes from the drafter's top-k with the suffix
    candidates worth more merged in (``k`` 0), or, ``suffix_only``, a tree of ``budget`` suffix
    candidates without the drafter."""

    k: int = 0
    budget: int = 0
    suffix_only: bool = False

    @property
    def rows(self) -> int:
        """Tokens after the anchor the target verifies (before the batch's fixed blocks)."""
        return self.k or self.budget


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """What :meth:`SpeculationPolicy.choose_shapes` decided for one step."""

    shapes: list[Shape]                 # per job, in the order of the jobs
    decision: Decision
    # the expectations the choice valued its arms with (adaptive jobs; None: none made), which
    # the drafters' deadline of the same step reuses (:meth:`SpeculationPolicy.draft_budget`)
    expectations: _Expectations | None = None

    @property
    def ks(self) -> list[int]:
        return [sh.k for sh in self.shapes]


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
        return self.choose_shapes(jobs, waiting).ks

    def choose_shapes(self, jobs: Sequence[PolicyJob], waiting: int = 0,
                      offers: Sequence[SuffixOffer | None] | None = None) -> StepChoice:
        """Each job's block this step and why. ``waiting``: requests whose prompts wait for
        prefill behind this step; ``offers``: each job's suffix candidates this step (None:
        none)."""
        self.acceptance.clear_expectation()
        batch = _Batch.of(jobs, offers)
        shapes = [self._pinned_shape(batch, i) for i in range(len(jobs))]
        if not batch.adaptive:
            modes = set(batch.modes)
            return StepChoice(shapes, Decision(mode=batch.modes[0] if len(modes) == 1 else MIXED,
                                               k=-1, batch=len(jobs)))
        if waiting:
            return StepChoice(shapes, Decision(mode=MODE_ADAPTIVE, k=0, batch=len(jobs),
                                               waiting=waiting))
        ex = _Expectations(self, jobs, batch.limits)
        arms = _Arms(self, batch, shapes, ex)
        best, explored = self._pick(arms)
        for i in batch.adaptive:
            shapes[i] = batch.adaptive_shape(i, best)
        if best.k > 0 and not best.budget:
            self.acceptance.expect(batch.adaptive, [ex.raw(i, shapes[i].k) - 1.0 for i in batch.adaptive])
        return StepChoice(shapes, arms.decision(best, explored), ex)

    def _pinned_shape(self, batch: _Batch, i: int) -> Shape:
        """Job ``i``'s shape when its mode fixes it (an adaptive job's placeholder: no drafts)."""
        m, lim, budget, offer = batch.modes[i], batch.limits[i], batch.budgets[i], batch.offers[i]
        if m == MODE_FIXED:
            return Shape(lim)
        if m == MODE_TREE:
            return _tree_shape(lim, budget)
        if m == MODE_HYBRID:
            return _hybrid_shape(lim, budget, offer is not None)
        if m == MODE_SUFFIX:
            return self.suffix_shape(offer, batch.bucket, budget, batch.suffix_limits[i])
        return Shape(0)

    def _pick(self, arms: _Arms) -> tuple[Arm, bool]:
        """The arm this step runs and whether it was chosen to measure it: every chain length
        first (until the cost model has a fit), then the bucket's baseline, then the best rate,
        each tree budget once, and every ``explore_every`` steps a neighbour of the best."""
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
        if untried:
            return untried[0], True               # each budget is measured once, early
        if self.explore_every and self._steps % self.explore_every == 0:
            nb = self._neighbour(arms, best)
            return nb, nb != best
        return best, explored

    def _neighbour(self, arms: _Arms, best: Arm) -> Arm:
        """Alternately the next larger and the next smaller arm by rows verified, a tree of n
        nodes just after the chain of n drafts (its neighbours are the chains of about its
        cost: listed after every chain, a small tree's neighbours were the longest chain and
        the next tree, and the chains it beat were never measured again, docs/trees.md "Under
        load"); at either end the one neighbour every time (from k = 0 the alternation would
        make every other exploration a k = 0 step). A suffix-only tree's neighbours are its
        drafter tree's."""
        by_size = sorted(arms.chains + arms.trees, key=lambda a: (a.rows, a.budget > 0))
        i = by_size.index(Arm(budget=best.budget) if best.suffix_only else best)
        up = (self._steps // self.explore_every) % 2 == 1 or i == 0
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

    def _hybrid_gain(self, offer: SuffixOffer | None, label: str, budget: int, limit: int) -> float:
        """What ``offer``'s candidates add to a ``budget``-node drafter tree: each one worth
        more than the drafter's marginal node adds the difference."""
        if offer is None or not limit:
            return 0.0
        theta = self.drafter_node_value(label, budget, limit)
        return sum(offer.probs[j] - theta for j in offer.above(theta, limit)[:budget])

    # ------------------------------------------------------------------ the drafters' deadline
    def draft_budget(self, jobs: Sequence[PolicyJob], shapes: Sequence[Shape],
                     expectations: _Expectations | None = None) -> float | None:
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
        ex = expectations or _Expectations(self, jobs, _limits(jobs), per_request=False)
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


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One step's jobs as the choice reads them, per job: its block limit, tree budget, suffix
    depth, candidates and mode this step; the adaptive ones (indices); the batch bucket."""

    limits: list[int]
    budgets: list[int]
    suffix_limits: list[int]
    offers: list[SuffixOffer | None]
    modes: list[str]
    adaptive: list[int]
    bucket: int

    @classmethod
    def of(cls, jobs: Sequence[PolicyJob], offers: Sequence[SuffixOffer | None] | None) -> _Batch:
        slimits = _suffix_limits(jobs)
        modes = [_job_mode(j, slimits[i]) for i, j in enumerate(jobs)]
        return cls(_limits(jobs), [j.tree_budget for j in jobs], slimits,
                   list(offers) if offers is not None else [None] * len(jobs), modes,
                   [i for i, m in enumerate(modes) if m == MODE_ADAPTIVE], bucket(len(jobs)))

    def adaptive_shape(self, i: int, arm: Arm) -> Shape:
        """Adaptive job ``i``'s shape under ``arm`` (within its own limits)."""
        if arm.suffix_only:
            return Shape(0, arm.budget, True) if self.offers[i] is not None and self.suffix_limits[i] \
                else Shape(0)
        if arm.budget and self.limits[i]:
            return _hybrid_shape(self.limits[i], arm.budget, self.offers[i] is not None)
        return Shape(0 if arm.budget else min(arm.k, self.limits[i]))


class _Arms:
    """The arms open to one step's adaptive jobs, each valued (expected committed tokens of the
    whole batch) and priced (seconds of the step) at the batch's bucket. Every adaptive job
    runs the same arm (one shape per step); the fixed jobs' blocks set its ``floor``."""

    def __init__(self, policy: SpeculationPolicy, batch: _Batch, shapes: list[Shape],
                 ex: _Expectations):
        self.policy, self.batch, self.ex, self.costs = policy, batch, ex, policy.costs
        self.bucket, adaptive = batch.bucket, batch.adaptive
        self.floor = max(sh.verified for sh in shapes)
        self.top = max(batch.limits[i] for i in adaptive)
        self.fixed_tokens = sum(ex.shape(i, sh) for i, sh in enumerate(shapes)
                                if batch.modes[i] != MODE_ADAPTIVE)
        self.model = self.costs.fit()
        cands = [k for k in CANDIDATES if k <= self.top] + ([self.top] if self.top not in CANDIDATES else [])
        self.chains = [Arm(k) for k in cands]
        self.unmeasured = [k for k in cands if not self.costs.measured(self.bucket, max(k, self.floor))]
        # trees only when every adaptive job may verify that budget; a tree arm is priced by the
        # fit, or by its own measured cell until there is a fit
        cap = min(batch.budgets[i] for i in adaptive)
        trees_ok = self.top and (not policy.tree_max_batch or len(shapes) <= policy.tree_max_batch)
        budgets = [n for n in policy.tree_budgets if n <= cap and self._priced(n)] if trees_ok else []
        self.trees = [Arm(budget=n) for n in budgets]
        # suffix-only arms: valued from this step's candidates, never explored
        offered = any(batch.offers[i] is not None and batch.suffix_limits[i] for i in adaptive)
        self.suffix = [Arm(budget=n, suffix_only=True) for n in budgets] if offered else []

    def _priced(self, rows: int) -> bool:
        return self.model is not None or self.costs.measured(self.bucket, max(rows, self.floor))

    def size(self, arm: Arm) -> int:
        """Tokens after the anchor of the step's largest block under ``arm``."""
        return max(arm.rows, self.floor)

    def gain(self, arm: Arm) -> float:
        """Expected committed tokens of the whole batch under ``arm``."""
        b, ex, n = self.batch, self.ex, arm.budget
        if arm.suffix_only:
            return self.fixed_tokens + sum(_offered(b.offers[i], n) for i in b.adaptive)
        if n:
            return self.fixed_tokens + sum(ex.tree(i, n) + self.policy._hybrid_gain(
                b.offers[i], ex.label(i), n, b.suffix_limits[i]) for i in b.adaptive)
        return self.fixed_tokens + sum(ex.chain(i, min(arm.k, b.limits[i])) for i in b.adaptive)

    def price(self, arm: Arm) -> float:
        """Estimated seconds of the step under ``arm`` (a suffix-only tree: no drafter time)."""
        if arm.suffix_only:
            return self.policy.suffix_cost(self.bucket, self.size(arm), self.model)
        return self.costs.estimate(self.bucket, self.size(arm), self.model)

    def rate(self, arm: Arm) -> float:
        return self.gain(arm) / max(self.price(arm), 1e-9)

    def untried(self, arm: Arm) -> bool:
        """Whether some adaptive job's drafter has no measured value for tree ``arm``."""
        return any(self.policy.acceptance.tree_expected(self.ex.label(i), arm.budget) is None
                   for i in self.batch.adaptive)

    def decision(self, best: Arm, explored: bool) -> Decision:
        cost = self.price(best) if self._priced(best.rows) else 0.0
        return Decision(mode=MODE_ADAPTIVE, k=best.k if not best.budget else self.top,
                        batch=len(self.batch.limits), expected_tokens=self.gain(best),
                        cost_seconds=cost, explored=explored, budget=best.budget,
                        suffix=best.suffix_only)


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
