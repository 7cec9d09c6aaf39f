"""Acceptance statistics of what the client received (a stop string may cut the stream)."""

from __future__ import annotations

from dflash.convert import stats_to_proto
from dflash.stats import AcceptanceCounter
from dflash.v1 import common_pb2


class EmittedStats:
    """Acceptance statistics of the tokens the client received, rebuilt from verifier chunks.

    A step emitting tokens ``t_0..t_m``, of which ``t_0..t_{a-1}`` are accepted drafts and
    ``t_a`` the bonus, that is cut after ``c`` tokens (a stop string completed there) accepted
    ``min(a, c)`` emitted drafts; steps after the cut were never emitted and do not count. Its
    draft tokens are all ``drafted`` of the step, as the verifier counts a block cut by EOS.
    """

    def __init__(self):
        self.counter = AcceptanceCounter()

    def step(self, kept: int, accepted: int, drafted: int) -> None:
        """One verifier chunk of which ``kept`` tokens reached the client (``kept`` >= 1)."""
        if kept > 0:
            self.counter.record(drafted, min(accepted, kept))

    def to_proto(self, verifier: common_pb2.AcceptanceStats | None) -> common_pb2.AcceptanceStats:
        """The counts of emitted tokens; the work figures (fallback steps, seconds, tree nodes)
        come from the verifier's own statistics when its last chunk carried them."""
        out = stats_to_proto(self.counter)
        if verifier is not None:
            out.fallback_steps = verifier.fallback_steps
            out.draft_seconds = verifier.draft_seconds
            out.verify_seconds = verifier.verify_seconds
            out.tree_drafts = verifier.tree_drafts
            out.tree_nodes = verifier.tree_nodes
        return out
