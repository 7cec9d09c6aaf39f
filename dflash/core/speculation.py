"""The speculation vocabulary every service shares (the gateway validates with it, the
verifier's policy acts on it): one definition, no torch. Code names a mode by its constant,
never by its string.

* :data:`MODES`: ``MODE_OFF`` (no drafts), ``MODE_FIXED`` (always the block), ``MODE_ADAPTIVE``
  (per step, the block length or tree budget with the most expected tokens per second;
  ``verifier_svc/policy.py``), ``MODE_TREE`` (always a DDTree of the request's budget;
  ``verifier_svc/tree.py``). The strings are wire values (``SpeculationParams.mode``,
  ``--spec-mode``).
* ``MAX_TREE_BUDGET``: the largest tree, in nodes (the root not counted), a request may ask for.
"""

from typing import Final

MODE_OFF: Final = "off"
MODE_FIXED: Final = "fixed"
MODE_ADAPTIVE: Final = "adaptive"
MODE_TREE: Final = "tree"
MODES: Final = (MODE_OFF, MODE_FIXED, MODE_ADAPTIVE, MODE_TREE)
#: Modes whose steps may verify a tree (adaptive: when a tree arm wins).
TREE_MODES: Final = (MODE_TREE, MODE_ADAPTIVE)
MAX_TREE_BUDGET = 64
