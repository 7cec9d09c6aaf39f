"""The speculation vocabulary every service shares (the gateway validates with it, the
verifier's policy acts on it): one definition, no torch.

* ``MODES``: ``off`` (no drafts), ``fixed`` (always the block), ``adaptive`` (per step, the
  block length or tree budget with the most expected tokens per second; ``verifier_svc/policy.py``),
  ``tree`` (always a DDTree of the request's budget; ``verifier_svc/tree.py``).
* ``MAX_TREE_BUDGET``: the largest tree, in nodes (the root not counted), a request may ask for.
"""

MODES = ("off", "fixed", "adaptive", "tree")
MAX_TREE_BUDGET = 64
