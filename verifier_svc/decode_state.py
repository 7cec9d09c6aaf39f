"""What the engine keeps of a running request (:class:`DecodeState`) and of one job in one decode
step (:class:`StepRow`).

The scheduler's ``Job`` carries a ``DecodeState`` without reading it: the engine sets it up
before the first prefill chunk and advances it as tokens commit. A ``StepRow`` is filled stage
by stage within one step (shape, drafts, tree, target output, verification) and dropped at its
end: the step's data in one object per job instead of parallel lists.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.core.grammar import GrammarState
from dflash.core.logits_processors import LogitsProcessor
from dflash.core.speculation import SpecMode
from dflash.core.stats import AcceptanceCounter
from verifier_svc.decision import Decision
from verifier_svc.drafter_sync import NONE, DraftOutcome
from verifier_svc.request import Request
from verifier_svc.sessions import Session
from verifier_svc.shapes import Shape
from verifier_svc.suffix_drafts import Sourced, SuffixOffer
from verifier_svc.tree import DraftTree
from verifier_svc.verification import Verified


@dataclasses.dataclass(eq=False)
class DecodeState:
    """One request's decode state (what ``verifier_svc.policy.PolicyJob`` reads, too)."""

    req: Request
    session: Session
    gen: torch.Generator | None = None       # on the target's device; None: greedy or seeded
    processor: LogitsProcessor | None = None  # the request's penalties; None: none asked
    grammar: GrammarState | None = None      # its output constraint's matcher; None: none asked
    stops: frozenset[int] = frozenset()
    mode: SpecMode = SpecMode.OFF            # speculation mode of this request
    block_limit: int = 1                     # largest block (anchor + drafts) it may verify
    tree_budget: int = 0                     # largest tree (nodes) it may verify; 0: chains only
    suffix_limit: int = 0                    # deepest suffix candidate it may verify; 0: none
    reuse: int = 0                           # prompt positions reused from the session's cache
    shared: int = 0                          # prompt positions copied from a group's session
    hit: int = 0                             # prompt positions copied from the prefix cache
    prefilled: int = 0                       # prompt positions in the cache
    prefill_seconds: float = 0.0
    emitted: int = 0
    steps: int = 0                           # decode steps so far
    stats: AcceptanceCounter = dataclasses.field(default_factory=AcceptanceCounter)


@dataclasses.dataclass(eq=False, slots=True)
class StepRow:
    """One job in one decode step."""

    state: DecodeState
    cached: int                              # target positions cached before the step
    shape: Shape                             # the policy's choice for it
    offer: SuffixOffer | None                # its suffix candidates this step
    draft: DraftOutcome = NONE               # its drafts (tokens: int64 [k])
    sourced: Sourced | None = None           # the tree it verifies with its nodes' sources
    block: list[int] = dataclasses.field(default_factory=list)   # [anchor] + drafts or tree nodes
    logits: torch.Tensor | None = None       # [len(block), V] float, the target's, raw
    taps: torch.Tensor | None = None         # [len(block), taps * H]; None: no taps asked
    verified: Verified | None = None
    masks: torch.Tensor | None = None        # [len(block), V] bool, its grammar's; None: no grammar
    forced: list[int] | None = None          # tokens its grammar forces this step (None: none asked)
    grammar_nodes: int = 0                   # block tokens only its grammar proposed (forced)
    grammar_seconds: float = 0.0             # this step's seconds on its grammar (grammar_rows.GrammarTime)

    @property
    def tree(self) -> DraftTree | None:
        """The tree it verifies (None: a chain)."""
        return self.sourced.tree if self.sourced is not None else None


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """What every row of one step shares: its seconds, its batch and the policy's decision."""

    draft_seconds: float
    verify_seconds: float
    batch: int
    decision: Decision
