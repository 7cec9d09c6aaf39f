"""The speculation vocabulary every service shares (the gateway validates with it, the
verifier's policy acts on it): one definition, no torch. Code names a mode by its constant,
never by its string.

* :data:`MODES`: ``MODE_OFF`` (no drafts), ``MODE_FIXED`` (always the block), ``MODE_ADAPTIVE``
  (per step, the block length or tree budget with the most expected tokens per second;
  ``verifier_svc/policy.py``), ``MODE_TREE`` (always a DDTree of the request's budget;
  ``verifier_svc/tree.py``), ``MODE_SUFFIX`` (trees of continuations found earlier in the
  session's text and its tenant's recent answers, no drafter needed; ``verifier_svc/
  suffix_drafts.py``), ``MODE_HYBRID`` (a DDTree with suffix branches merged in, one node
  budget). The strings are wire values (``SpeculationParams.mode``, ``--spec-mode``).
* ``MAX_TREE_BUDGET``: the largest tree, in nodes (the root not counted), a request may ask for.
"""

from typing import Final

MODE_OFF: Final = "off"
MODE_FIXED: Final = "fixed"
MODE_ADAPTIVE: Final = "adaptive"
MODE_TREE: Final = "tree"
MODE_SUFFIX: Final = "suffix"
MODE_HYBRID: Final = "hybrid"
MODES: Final = (MODE_OFF, MODE_FIXED, MODE_ADAPTIVE, MODE_TREE, MODE_SUFFIX, MODE_HYBRID)
#: Modes whose steps may verify a tree (adaptive: when a tree arm wins).
TREE_MODES: Final = (MODE_TREE, MODE_ADAPTIVE, MODE_HYBRID, MODE_SUFFIX)
#: Modes that speculate without a drafter (from suffix matches) when the request has none.
SUFFIX_MODES: Final = (MODE_SUFFIX, MODE_HYBRID, MODE_ADAPTIVE)
#: Deepest suffix continuation when the request names no block size and has no drafter.
DEFAULT_SUFFIX_DEPTH = 16
MAX_TREE_BUDGET = 64
