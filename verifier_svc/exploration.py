"""When the adaptive policy re-measures a neighbour of its best arm (``verifier_svc/policy.py``).

An arm's estimate only moves when that arm runs, so the policy now and then runs a neighbour of
the best arm instead, to follow load and acceptance. Each such step costs what the best arm
would have gained, and where the best arm keeps winning (on chat, suffix trees alone against
every drafter arm) the explorations are pure cost (docs/bench/suffix-history/README.md,
"Adaptive against suffix").

So each leader (a best arm's batch bucket and :func:`leader`: its family and size) keeps its own schedule: the first exploration around it ``every`` steps after it
first leads, each next one twice the previous gap later, up to ``backoff`` times ``every``,
taken at the first step the leader leads once due. A new best arm is explored around soon; one
that keeps its lead, or returns to it (suffix candidates on some steps, none on others), ever
less often. No two explorations come closer than ``every`` steps. Only the scheduler thread
calls it.
"""

from __future__ import annotations

from verifier_svc.acceptance import Family
from verifier_svc.shapes import Arm

#: Most steps between explorations around one best arm, as a multiple of ``every``.
DEFAULT_EXPLORE_BACKOFF = 8


def leader(arm: Arm) -> tuple[str, int]:
    """What the schedule keys a best arm by: its family and size, suffix trees alone and no
    speculation being one ("none": neither calls the drafter, and which of them leads moves
    with every step's candidates)."""
    if arm.suffix_only or not (arm.k or arm.budget):
        return "none", 0
    return (Family.TREE, arm.budget) if arm.budget else (Family.CHAIN, arm.k)


class Exploration:
    """The exploration schedule of one policy.

    Args:
        every: steps from a best arm's first lead to the first exploration around it (0:
            never explore); each later gap around it is twice the one before. Raises
            ValueError below 0.
        backoff: the longest gap, as a multiple of ``every`` (1: a fixed gap). Raises
            ValueError below 1.
    """

    def __init__(self, every: int = 25, backoff: int = DEFAULT_EXPLORE_BACKOFF):
        if every < 0:
            raise ValueError(f"explore_every: must be >= 0, got {every}")
        if backoff < 1:
            raise ValueError(f"explore_backoff: must be >= 1, got {backoff}")
        self.every, self.backoff = every, backoff
        self.count = 0                      # explorations so far (the neighbours alternate)
        # leader -> (its next gap, the step count its next exploration is due at)
        self._schedule: dict[tuple[int, str, int], tuple[int, int]] = {}
        self._quiet = 0                     # no exploration before this step count

    def took(self, step: int) -> None:
        """Step ``step`` explored outside this schedule (a tree budget measured early): the
        next exploration waits ``every`` steps."""
        self._quiet = step + self.every

    def now(self, step: int, best: Arm, bucket: int) -> bool:
        """Whether step ``step`` (counting from 1) explores around ``best``, the best arm at
        batch bucket ``bucket``."""
        if not self.every:
            return False
        key = (bucket, *leader(best))
        gap, due = self._schedule.setdefault(key, (self.every, step + self.every))
        if step < max(due, self._quiet):
            return False
        self.count += 1
        gap = min(2 * gap, self.every * self.backoff)
        self._schedule[key] = (gap, step + gap)
        self.took(step)
        return True
