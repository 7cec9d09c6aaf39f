"""What the speculation policy takes and gives, per step (``verifier_svc.policy``): the
jobs it reads (:class:`PolicyJob`), the shapes it chooses (:class:`Shape`, :class:`Arm`), its
:class:`Decision` and :class:`StepChoice`, and what a step teaches it (:class:`StepFeedback`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from dflash.core.speculation import SpecMode
from verifier_svc.acceptance import PositionCounts
from verifier_svc.decision import Decision

if TYPE_CHECKING:
    from verifier_svc.arms import Expectations

# Candidate draft counts: dense where acceptance changes fastest, sparse in the tail.
CANDIDATES = (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 15, 23, 31, 47, 63)


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
    expectations: Expectations | None = None

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
    # drafter label -> (predicted, realized) gain of the suffix candidates per hybrid tree
    hybrid: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
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

    mode: SpecMode                  # the request's mode
    block_limit: int                # the request's block size (drafts + 1)
    emitted: int                    # tokens emitted so far
    @property
    def req(self) -> _Request: ...                  # read-only: a Job's is a full Request

    @property
    def stats(self) -> PositionCounts | None: ...   # the request's acceptance counts (session_table)

    tree_budget: int                # largest tree it may verify (0: chains only)
    suffix_limit: int               # deepest suffix candidate it may verify (0: none)
