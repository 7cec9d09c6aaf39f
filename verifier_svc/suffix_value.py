"""What suffix candidates are worth to a step and what verifying them costs, from the
acceptance estimates (:class:`~verifier_svc.acceptance.AcceptanceEstimator`) and the step cost
model (:class:`~verifier_svc.cost_model.StepCostModel`) alone: what the adaptive choice's arms
(``verifier_svc/arms.py``), mode ``suffix`` and the hybrid trees of ``verifier_svc/proposals.py``
read (through :class:`verifier_svc.policy.SpeculationPolicy`)."""

from __future__ import annotations

from collections.abc import Sequence

from verifier_svc.acceptance import AcceptanceEstimator
from verifier_svc.cost_model import Fit, StepCostModel, relative_rows
from verifier_svc.suffix_drafts import SuffixOffer, suffix_gain

#: Floor of the drafter's marginal node value (expected tokens per node): a suffix candidate
#: below it never displaces a drafter node.
MIN_NODE_VALUE = 0.02


def suffix_cost(costs: StepCostModel, b: int, n: int, model: Fit | None) -> float:
    """Seconds of one cycle at bucket ``b`` verifying ``n`` suffix nodes without drafts:
    the step without speculation plus the verify rows ``n`` adds
    (:meth:`StepCostModel.verify_estimate`). Unmeasured, relative units of the same scale
    (:func:`verifier_svc.cost_model.relative_rows`)."""
    v0, vn = costs.verify_estimate(b, 0), costs.verify_estimate(b, n)
    if v0 is None or vn is None or not (costs.measured(b, 0) or model is not None):
        return relative_rows(n)
    return costs.estimate(b, 0, model) + max(0.0, vn - v0)


def suffix_size(costs: StepCostModel, offer: SuffixOffer | None, b: int, budget: int,
                limit: int) -> int:
    """How many of ``offer``'s candidates to verify alone at batch bucket ``b``:
    ``argmax_n expected(n) / suffix_cost(b, n)`` over ``0..budget`` (0: none pays), no
    candidate deeper than ``limit``."""
    if offer is None or not limit or not budget:
        return 0
    depths = offer.trie.depths
    usable = sum(1 for j in offer.order[:budget] if depths[j] <= limit)
    model = costs.fit()
    best, best_rate = 0, 1.0 / max(suffix_cost(costs, b, 0, model), 1e-9)
    for n in range(1, usable + 1):
        r = offer.expected(n) / max(suffix_cost(costs, b, n, model), 1e-9)
        if r > best_rate:
            best, best_rate = n, r
    return best


def drafter_node_value(acceptance: AcceptanceEstimator, tree_budgets: Sequence[int], label: str,
                       budget: int, limit: int) -> float:
    """Expected tokens the drafter's last nodes of a ``budget``-node tree add, per node:
    the measured tree values' slope below ``budget`` (over the measured ``tree_budgets``),
    else the chain's at ``min(budget, limit)`` (a suffix candidate displaces such a node only
    when it is worth more)."""
    e_n = acceptance.tree_expected(label, budget)
    if e_n is not None:
        lower = [(n, acceptance.tree_expected(label, n)) for n in tree_budgets if n < budget]
        known = [(n, v) for n, v in lower if v is not None]
        n0, v0 = known[-1] if known else (0, 1.0)
        return max(MIN_NODE_VALUE, (e_n - v0) / (budget - n0))
    k = max(1, min(budget, limit))
    table = acceptance.expected_table(label, k)
    return max(MIN_NODE_VALUE, table[k] - table[k - 1])


def hybrid_gain(acceptance: AcceptanceEstimator, tree_budgets: Sequence[int],
                offer: SuffixOffer | None, label: str, budget: int, limit: int) -> float:
    """What ``offer``'s candidates add to a ``budget``-node drafter tree: each one worth
    more than the drafter's marginal node adds the difference (``suffix_gain``), scaled by
    what recent hybrid trees realized of their prediction (``hybrid_factor``)."""
    if offer is None or not limit:
        return 0.0
    theta = drafter_node_value(acceptance, tree_budgets, label, budget, limit)
    return acceptance.hybrid_factor(label) * suffix_gain(offer, theta, limit, budget)
