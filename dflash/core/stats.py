"""Acceptance statistics: one object, several sinks (response, log line, Prometheus, spans).

Definitions (written once; the same meaning as vLLM's spec-decoding counters):

* ``drafts``: verify steps that carried a draft block (vLLM ``num_drafts``).
* ``draft_tokens``: proposed tokens in those blocks (vLLM ``num_draft_tokens``).
* ``accepted_tokens``: proposed tokens accepted *and emitted*; an EOS / stop / max_tokens cut
  inside an accepted block ends the count there (vLLM ``num_accepted_tokens``).
* ``accepted_per_position[i]``: steps whose draft position ``i + 1`` was accepted.
* ``drafted_per_position[i]``: steps whose block reached draft position ``i + 1`` (with blocks
  of varying length, ``accepted_per_position[i] / drafted_per_position[i]`` is position
  ``i + 1``'s acceptance where it was tried; the speculation policy reads it per request).
* mean acceptance length ``tau = 1 + accepted_tokens / drafts`` (the bonus token included;
  DFlash paper's tau, SGLang's ``accept len``).
* per-position acceptance rate ``i = accepted_per_position[i] / drafts``.
* draft acceptance rate ``= accepted_tokens / draft_tokens``.
* trees (DDTree): ``tree_drafts`` steps verified a tree of ``tree_nodes`` nodes in all; such a
  step counts in ``drafts`` as well, with the tree's depth as its draft tokens and the accepted
  path's length as its accepted tokens, so tau and per-position (= per-depth) rates compare
  with chains, and nodes per tree step is ``tree_nodes / tree_drafts``.
* sources (suffix drafts, ``verifier_svc/suffix_drafts.py``): ``suffix_drafts`` steps verified
  ``suffix_nodes`` suffix candidates in all; ``suffix_accepted_tokens`` of the accepted tokens
  were proposed by the suffix index alone; the rest (``drafter_accepted_tokens``) by a drafter,
  a candidate both proposed included. Grammar-forced drafts (``dflash/core/grammar.py``):
  ``grammar_drafts`` steps verified ``grammar_nodes`` forced tokens no other source proposed,
  of which ``grammar_accepted_tokens`` were accepted and emitted. The three sources' accepted
  tokens sum to ``accepted_tokens``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AcceptanceCounter:
    """Running counts; ``record`` one verify step at a time."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    fallback_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    tree_drafts: int = 0
    tree_nodes: int = 0
    suffix_drafts: int = 0
    suffix_nodes: int = 0
    suffix_accepted_tokens: int = 0
    grammar_drafts: int = 0
    grammar_nodes: int = 0
    grammar_accepted_tokens: int = 0

    def record_grammar(self, nodes: int, accepted: int) -> None:
        """The step just recorded verified ``nodes`` grammar-forced tokens no other source
        proposed, of which ``accepted`` were accepted and emitted."""
        self.grammar_drafts += 1
        self.grammar_nodes += nodes
        self.grammar_accepted_tokens += accepted

    def record_suffix(self, nodes: int, accepted: int) -> None:
        """The step just recorded verified ``nodes`` suffix candidates of which ``accepted``,
        proposed by no drafter, were accepted and emitted."""
        self.suffix_drafts += 1
        self.suffix_nodes += nodes
        self.suffix_accepted_tokens += accepted

    @property
    def drafter_accepted_tokens(self) -> int:
        """Accepted tokens a drafter proposed (a suffix candidate or forced token it also
        proposed counts here)."""
        return self.accepted_tokens - self.suffix_accepted_tokens - self.grammar_accepted_tokens

    def record_tree(self, nodes: int) -> None:
        """The step just recorded verified a tree of ``nodes`` nodes."""
        self.tree_drafts += 1
        self.tree_nodes += nodes

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One step that verified ``num_draft_tokens`` drafts of which the first ``num_accepted``
        were accepted and emitted. Steps with no drafts are not drafts (tau ignores them)."""
        if num_draft_tokens <= 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        if len(self.drafted_per_position) < num_draft_tokens:
            self.drafted_per_position += [0] * (num_draft_tokens - len(self.drafted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        for i in range(num_draft_tokens):
            self.drafted_per_position[i] += 1

    def merge(self, other: "AcceptanceCounter") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.accepted_per_position = _add(self.accepted_per_position, other.accepted_per_position)
        self.drafted_per_position = _add(self.drafted_per_position, other.drafted_per_position)
        self.fallback_steps += other.fallback_steps
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.tree_drafts += other.tree_drafts
        self.tree_nodes += other.tree_nodes
        self.suffix_drafts += other.suffix_drafts
        self.suffix_nodes += other.suffix_nodes
        self.suffix_accepted_tokens += other.suffix_accepted_tokens
        self.grammar_drafts += other.grammar_drafts
        self.grammar_nodes += other.grammar_nodes
        self.grammar_accepted_tokens += other.grammar_accepted_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
