"""Acceptance statistics of what the client received (a stop string may cut the stream)."""

from __future__ import annotations

from dflash.core.convert import stats_to_proto
from dflash.core.stats import AcceptanceCounter
from dflash.v1 import common_pb2, verifier_pb2


class EmittedStats:
    """Acceptance statistics of the tokens the client received, rebuilt from verifier chunks.

    A step emitting tokens ``t_0..t_m``, of which ``t_0..t_{a-1}`` are accepted drafts and
    ``t_a`` the bonus, that is cut after ``c`` tokens (a stop string completed there) accepted
    ``min(a, c)`` emitted drafts; steps after the cut were never emitted and do not count. Its
    draft tokens are all ``drafted`` of the step, as the verifier counts a block cut by EOS.
    The work of every step with an emitted token counts whole (fallback, tree nodes, draft and
    verify seconds: the chunk's share of the verifier's statistics, 0 from a verifier that
    sends none).
    """

    def __init__(self):
        self.counter = AcceptanceCounter()

    def step(self, kept: int, accepted: int, drafted: int, *, fallback: bool = False,
             tree_nodes: int = 0, draft_seconds: float = 0.0, verify_seconds: float = 0.0,
             suffix_nodes: int = 0, suffix_accepted: int = 0) -> None:
        """One verifier step of which ``kept`` tokens reached the client (0: none, not counted).
        ``tree_nodes`` > 0: it verified a tree of that many nodes (``drafted`` is its depth);
        ``suffix_nodes`` of them suffix candidates, ``suffix_accepted`` of its accepted tokens
        only a suffix candidate proposed (counted up to what was kept)."""
        if kept <= 0:
            return
        c = self.counter
        c.record(drafted, min(accepted, kept))
        if tree_nodes:
            c.record_tree(tree_nodes)
        if suffix_nodes:
            c.record_suffix(suffix_nodes, min(suffix_accepted, accepted, kept))
        c.fallback_steps += int(fallback)
        c.draft_seconds += draft_seconds
        c.verify_seconds += verify_seconds

    def chunk(self, kept: int, chunk: verifier_pb2.VerifierGenerateChunk) -> None:
        """:meth:`step` with a verifier chunk's figures."""
        self.step(kept, chunk.accepted, chunk.drafted, fallback=chunk.fallback,
                  tree_nodes=chunk.tree_nodes, draft_seconds=chunk.draft_seconds,
                  verify_seconds=chunk.verify_seconds, suffix_nodes=chunk.suffix_nodes,
                  suffix_accepted=chunk.suffix_accepted)

    def to_proto(self, verifier: common_pb2.AcceptanceStats | None) -> common_pb2.AcceptanceStats:
        """The counts of emitted tokens. The work figures are the emitted steps' sums, or the
        verifier's own statistics when its last chunk carried them (every step it ran was then
        emitted, at least in part)."""
        out = stats_to_proto(self.counter)
        if verifier is not None:
            out.fallback_steps = verifier.fallback_steps
            out.draft_seconds = verifier.draft_seconds
            out.verify_seconds = verifier.verify_seconds
            out.tree_drafts = verifier.tree_drafts
            out.tree_nodes = verifier.tree_nodes
            out.suffix_drafts = verifier.suffix_drafts
            out.suffix_nodes = verifier.suffix_nodes
        return out
