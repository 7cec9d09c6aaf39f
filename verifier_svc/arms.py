"""The adaptive choice's working parts (``SpeculationPolicy.choose_shapes``): one step's jobs as
the choice reads them (:class:`Batch`), the arms open to them, valued and priced
(:class:`Arms`), and the expected tokens they are valued with (:class:`Expectations`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dflash.core.speculation import SUFFIX_MODES, SpecMode, suffix_depth
from verifier_svc.acceptance import AcceptanceEstimator, Family, session_table
from verifier_svc.cost_model import StepCostModel, bucket
from verifier_svc.decision import Decision
from verifier_svc.shapes import CANDIDATES, Arm, PolicyJob, Shape
from verifier_svc.suffix_drafts import SuffixOffer
from verifier_svc.suffix_value import hybrid_gain, suffix_cost


def tree_shape(limit: int, budget: int) -> Shape:
    """A tree of ``budget`` nodes for a job whose block allows ``limit`` drafts: no deeper than
    ``budget`` (each node's parent is in the tree), so the drafter is asked for
    ``min(limit, budget)`` positions, not the whole block (a smaller, cheaper drafter block)."""
    return Shape(min(limit, budget), budget) if limit and budget else Shape(limit)


def offered(offer: SuffixOffer | None, n: int) -> float:
    """Expected tokens of a tree of ``offer``'s ``n`` best candidates (1: none)."""
    return offer.expected(n) if offer is not None else 1.0


def family(arm: Arm) -> Family:
    """The calibration family of ``arm`` (``verifier_svc.acceptance``): suffix trees alone,
    the drafter's trees, or chains."""
    return Family.SUFFIX if arm.suffix_only else Family.TREE if arm.budget else Family.CHAIN


def hybrid_shape(limit: int, budget: int, suffix: bool) -> Shape:
    """Mode ``hybrid``'s shape: the drafter's tree (as in ``tree`` mode), with the suffix
    candidates when the job has some this step."""
    sh = tree_shape(limit, budget)
    return Shape(sh.k, sh.budget, True) if sh.budget and suffix else sh


def job_mode(j: PolicyJob, suffix_limit: int) -> SpecMode:
    """The mode a job speculates in this step: a job without a drafter speculates from suffix
    candidates in the modes that may (``SUFFIX_MODES``), else not at all."""
    if j.req.proposer is not None:
        return j.mode
    return SpecMode.SUFFIX if j.mode in SUFFIX_MODES and suffix_limit else SpecMode.OFF


def suffix_limits(jobs: Sequence[PolicyJob]) -> list[int]:
    """Deepest suffix candidate each job may verify this step (its tokens left)."""
    return [suffix_depth(j.suffix_limit, j.req.max_tokens, j.emitted) for j in jobs]


def limits(jobs: Sequence[PolicyJob]) -> list[int]:
    """Most drafts each job may verify this step (its block size, and its tokens left)."""
    return [max(0, min(j.block_limit - 1, j.req.max_tokens - j.emitted - 1)) for j in jobs]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's jobs as the choice reads them, per job: its block limit, tree budget, suffix
    depth, candidates and mode this step; the adaptive ones (indices); the batch bucket."""

    limits: list[int]
    budgets: list[int]
    suffix_limits: list[int]
    offers: list[SuffixOffer | None]
    modes: list[SpecMode]
    adaptive: list[int]
    bucket: int

    @classmethod
    def of(cls, jobs: Sequence[PolicyJob], offers: Sequence[SuffixOffer | None] | None) -> Batch:
        slimits = suffix_limits(jobs)
        modes = [job_mode(j, slimits[i]) for i, j in enumerate(jobs)]
        return cls(limits(jobs), [j.tree_budget for j in jobs], slimits,
                   list(offers) if offers is not None else [None] * len(jobs), modes,
                   [i for i, m in enumerate(modes) if m == SpecMode.ADAPTIVE], bucket(len(jobs)))

    def adaptive_shape(self, i: int, arm: Arm) -> Shape:
        """Adaptive job ``i``'s shape under ``arm`` (within its own limits)."""
        if arm.suffix_only:
            return Shape(0, arm.budget, True) if self.offers[i] is not None and self.suffix_limits[i] \
                else Shape(0)
        if arm.budget and self.limits[i]:
            return hybrid_shape(self.limits[i], arm.budget, self.offers[i] is not None)
        return Shape(0 if arm.budget else min(arm.k, self.limits[i]))


class Arms:
    """The arms open to one step's adaptive jobs, each valued (expected committed tokens of the
    whole batch) and priced (seconds of the step) at the batch's bucket. Every adaptive job
    runs the same arm (one shape per step); the fixed jobs' blocks set its ``floor``.

    Args:
        batch, shapes: the step's jobs and their pinned shapes (an adaptive job's: no drafts).
        ex: the expected tokens the arms are valued with.
        acceptance, costs: the policy's estimates (calibration, measured trees; step seconds).
        tree_budgets: node budgets the tree arms may take; ``tree_max_batch``: steps of more
            jobs than this get no tree arms (0: any).
    """

    def __init__(self, batch: Batch, shapes: list[Shape], ex: Expectations, *,
                 acceptance: AcceptanceEstimator, costs: StepCostModel,
                 tree_budgets: Sequence[int], tree_max_batch: int):
        self.batch, self.ex, self.acceptance, self.costs = batch, ex, acceptance, costs
        self.tree_budgets = tuple(tree_budgets)
        self.bucket, adaptive = batch.bucket, batch.adaptive
        self.floor = max(sh.verified for sh in shapes)
        self.top = max(batch.limits[i] for i in adaptive)
        self.fixed_tokens = sum(ex.shape(i, sh) for i, sh in enumerate(shapes)
                                if batch.modes[i] != SpecMode.ADAPTIVE)
        self.model = self.costs.fit()
        cands = [k for k in CANDIDATES if k <= self.top] + ([self.top] if self.top not in CANDIDATES else [])
        self.chains = [Arm(k) for k in cands]
        self.unmeasured = [k for k in cands if not self.costs.measured(self.bucket, max(k, self.floor))]
        # trees only when every adaptive job may verify that budget; a tree arm is priced by the
        # fit, or by its own measured cell until there is a fit
        cap = min(batch.budgets[i] for i in adaptive)
        trees_ok = self.top and (not tree_max_batch or len(shapes) <= tree_max_batch)
        budgets = [n for n in self.tree_budgets if n <= cap and self._priced(n)] if trees_ok else []
        self.trees = [Arm(budget=n) for n in budgets]
        # suffix-only arms, valued from this step's candidates and never explored: every size up
        # to the largest tree budget, as mode suffix sizes its trees (SpeculationPolicy.
        # suffix_size): the few rows that usually pay are seldom a tree budget
        offered = any(batch.offers[i] is not None and batch.suffix_limits[i] for i in adaptive)
        top_n = min(cap, max(self.tree_budgets, default=0)) if trees_ok else 0
        self.suffix = [Arm(budget=n, suffix_only=True) for n in range(1, top_n + 1)
                       if self._priced(n)] if offered else []

    def _priced(self, rows: int) -> bool:
        return self.model is not None or self.costs.measured(self.bucket, max(rows, self.floor))

    def size(self, arm: Arm) -> int:
        """Tokens after the anchor of the step's largest block under ``arm``."""
        return max(arm.rows, self.floor)

    def gain(self, arm: Arm) -> float:
        """Expected committed tokens of the whole batch under ``arm``: each adaptive job's
        :meth:`raw` extra tokens scaled by the calibration of the arm's family."""
        acc = self.acceptance.accuracy_of(family(arm))
        return self.fixed_tokens + sum(1.0 + acc * x for x in self.raw(arm))

    def raw(self, arm: Arm) -> list[float]:
        """Per adaptive job, the extra tokens (beyond the bonus) ``arm`` is expected to commit
        before its family's calibration."""
        b, ex, n = self.batch, self.ex, arm.budget
        if arm.suffix_only:
            return [offered(b.offers[i], n) - 1.0 for i in b.adaptive]
        if n:
            return [ex.tree(i, n, calibrated=False) - 1.0
                    + hybrid_gain(self.acceptance, self.tree_budgets, b.offers[i], ex.label(i), n,
                                  b.suffix_limits[i])
                    for i in b.adaptive]
        return [ex.raw(i, min(arm.k, b.limits[i])) - 1.0 for i in b.adaptive]

    def price(self, arm: Arm) -> float:
        """Estimated seconds of the step under ``arm`` (a suffix-only tree: no drafter time)."""
        if arm.suffix_only:
            return suffix_cost(self.costs, self.bucket, self.size(arm), self.model)
        return self.costs.estimate(self.bucket, self.size(arm), self.model)

    def rate(self, arm: Arm) -> float:
        return self.gain(arm) / max(self.price(arm), 1e-9)

    def untried(self, arm: Arm) -> bool:
        """Whether some adaptive job's drafter has no measured value for tree ``arm``."""
        return any(self.acceptance.tree_expected(self.ex.label(i), arm.budget) is None
                   for i in self.batch.adaptive)

    def decision(self, best: Arm, explored: bool) -> Decision:
        cost = self.price(best) if self._priced(best.rows) else 0.0
        return Decision(mode=SpecMode.ADAPTIVE, k=best.k if not best.budget else self.top,
                        batch=len(self.batch.limits), expected_tokens=self.gain(best),
                        cost_seconds=cost, explored=explored, budget=best.budget,
                        suffix=best.suffix_only)


class Expectations:
    """Expected committed tokens (bonus included) of one step's jobs, per block shape:

    ``raw(i, k)``: the request's table (the drafter's, moved towards the request's own counts,
    :func:`session_table`) at ``k`` drafts; ``chain(i, k)``: that scaled by the policy's
    calibration (the chains', read once), ``1 + accuracy * (raw - 1)``; ``tree(i, n)``: a tree of ``n`` nodes, measured
    per drafter and budget, else the chain of ``min(n, limit)`` drafts. Tables are built once
    per drafter and job (``per_request`` False: the drafter's table for every job). The
    policy's choice of blocks and the drafters' deadline (:meth:`SpeculationPolicy.
    draft_budget`) both read them."""

    def __init__(self, acceptance: AcceptanceEstimator, jobs: Sequence[PolicyJob], limits: list[int],
                 per_request: bool = True):
        self.acceptance, self.accuracy = acceptance, acceptance.accuracy
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

    def tree(self, i: int, n: int, calibrated: bool = True) -> float:
        """A tree of ``n`` nodes: measured, else the chain of ``min(n, limit)`` drafts, with
        the chains' calibration (``calibrated``) or without it (:meth:`raw`, for a value the
        trees' own calibration scales: both would scale it twice)."""
        if not self.limits[i]:
            return 1.0
        measured = self.acceptance.tree_expected(self.label(i), n)
        if measured is not None:
            return measured
        k = min(n, self.limits[i])
        return self.chain(i, k) if calibrated else self.raw(i, k)

    def shape(self, i: int, sh: Shape) -> float:
        """Job ``i``'s expected tokens with block ``sh`` (1 without drafts)."""
        if not sh.k:
            return 1.0
        return self.tree(i, sh.budget) if sh.budget else self.chain(i, sh.k)
