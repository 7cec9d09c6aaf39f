"""The mode race's arms as the policy plays them: an arm's name (``"hybrid:15"``), which arms a
step's adaptive jobs may play, and the shape a job takes in a mode (``verifier_svc/policy.py``,
``verifier_svc/mode_race.py``; docs/batching.md, "The mode race")."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash.core.speculation import MODES, SpecMode
from verifier_svc.arms import Batch, hybrid_shape, tree_shape
from verifier_svc.shapes import Shape
from verifier_svc.suffix_drafts import SuffixOffer

#: The modes adaptive races when no list is given (``race_arms``; ``{N}``: the largest tree
#: budget). ``tree:N`` is ``hybrid:N`` without the suffix candidates, and the smaller budgets
#: and chains are among the per-step choice's own arms (docs/batching.md, "The mode race").
DEFAULT_RACE_ARMS = (SpecMode.ADAPTIVE, SpecMode.OFF, SpecMode.SUFFIX, SpecMode.HYBRID + ":{N}", SpecMode.FIXED)

#: ``suffix_shape(offer, bucket, budget, limit)``: mode suffix's shape for one job
#: (:meth:`verifier_svc.policy.SpeculationPolicy.suffix_shape`).
SuffixShape = Callable[[SuffixOffer | None, int, int, int], Shape]


def split_arm(arm: str) -> tuple[SpecMode, int]:
    """A race arm's mode and tree budget (``"hybrid:15"`` -> ``("hybrid", 15)``; 0: the
    mode's own). Raises ValueError naming ``race_arms`` for anything else."""
    mode, _, n = arm.partition(":")
    if mode not in MODES or (n and (not n.isdigit() or int(n) < 1
                                    or mode not in (SpecMode.TREE, SpecMode.HYBRID, SpecMode.SUFFIX))):
        raise ValueError(f"race_arms: {arm!r} is not a mode (off, fixed, tree:n, hybrid:n, "
                         f"suffix[:n], adaptive)")
    if mode in (SpecMode.TREE, SpecMode.HYBRID) and not n:
        raise ValueError(f"race_arms: {arm!r} needs a node budget ({mode}:n)")
    return SpecMode(mode), int(n or 0)


def race_arms(arms: Sequence[str], top_budget: int) -> list[str]:
    """``arms`` with ``{N}`` read as ``top_budget`` (dropped where that is 0), each checked
    (:func:`split_arm`), duplicates dropped."""
    out = [a.replace("{N}", str(top_budget)) for a in arms if top_budget or "{N}" not in a]
    for a in out:
        split_arm(a)
    return list(dict.fromkeys(out))


def available(order: Sequence[str], batch: Batch) -> list[str]:
    """The arms of ``order`` this step's adaptive jobs may play: trees when every one may
    verify the budget, suffix arms when some may verify suffix candidates."""
    adaptive = batch.adaptive
    cap = min(batch.budgets[i] for i in adaptive)
    drafts = any(batch.limits[i] for i in adaptive)
    suffix = any(batch.suffix_limits[i] for i in adaptive)
    out = []
    for a in order:
        mode, n = split_arm(a)
        if mode in (SpecMode.TREE, SpecMode.HYBRID) and not (drafts and n <= cap):
            continue
        if (mode == SpecMode.FIXED and not drafts) or (mode == SpecMode.SUFFIX and not suffix):
            continue
        out.append(a)
    return out


def mode_shape(mode: SpecMode, budget: int, batch: Batch, i: int, suffix_shape: SuffixShape) -> Shape:
    """Job ``i``'s shape in ``mode`` with tree node budget ``budget`` (suffix: at most that
    many candidates); ``Shape(0)`` (no drafts) for off and adaptive."""
    lim, offer = batch.limits[i], batch.offers[i]
    if mode == SpecMode.FIXED:
        return Shape(lim)
    if mode == SpecMode.TREE:
        return tree_shape(lim, budget)
    if mode == SpecMode.HYBRID:
        return hybrid_shape(lim, budget, offer is not None)
    if mode == SpecMode.SUFFIX:
        return suffix_shape(offer, batch.bucket, budget, batch.suffix_limits[i])
    return Shape(0)
