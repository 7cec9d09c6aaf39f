"""The speculation vocabulary every service shares (the gateway validates with it, the
verifier's policy acts on it): one definition, no torch. Code names a mode by its
:class:`SpecMode` member, never by its string.

* :class:`SpecMode` (:data:`MODES`, in order): ``OFF`` (no drafts), ``FIXED`` (always the
  block), ``ADAPTIVE`` (per step, the block length or tree budget with the most expected tokens
  per second; ``verifier_svc/policy.py``), ``TREE`` (always a DDTree of the request's budget;
  ``verifier_svc/tree.py``), ``SUFFIX`` (trees of continuations found earlier in the session's
  text and its tenant's recent answers, no drafter needed; ``verifier_svc/suffix_drafts.py``),
  ``HYBRID`` (a DDTree with suffix branches merged in, one node budget). The values are wire
  strings (``SpeculationParams.mode``, ``--spec-mode``).
* ``MAX_TREE_BUDGET``: the largest tree, in nodes (the root not counted), a request may ask for.
"""

from enum import StrEnum
from typing import Final


class SpecMode(StrEnum):
    """A speculation mode; each value is its wire string (a member equals, formats and
    serialises as that string)."""

    OFF = "off"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    TREE = "tree"
    SUFFIX = "suffix"
    HYBRID = "hybrid"


MODES: Final = tuple(SpecMode)
#: Modes whose steps may verify a tree (adaptive: when a tree arm wins).
TREE_MODES: Final = (SpecMode.TREE, SpecMode.ADAPTIVE, SpecMode.HYBRID, SpecMode.SUFFIX)
#: Modes that speculate without a drafter (from suffix matches) when the request has none.
SUFFIX_MODES: Final = (SpecMode.SUFFIX, SpecMode.HYBRID, SpecMode.ADAPTIVE)
#: Deepest suffix continuation when the request names no block size and has no drafter.
DEFAULT_SUFFIX_DEPTH = 16
MAX_TREE_BUDGET = 64


def suffix_depth(suffix_limit: int, max_tokens: int, emitted: int) -> int:
    """Deepest suffix candidate a request may verify this step: its ``suffix_limit``, and no
    more than the tokens it may still emit beside the bonus token (0: none)."""
    return max(0, min(suffix_limit, max_tokens - emitted - 1))
