"""The speculation modes the verifier can serve, each priced at one acceptance profile and one
set of step costs: expected tokens per step, seconds per step, speed-up against plain decoding.

:data:`MODES` is the table: one :class:`ModeEntry` per mode, in the order the report lists
them; a new mode of the verifier is one more entry (its price function reads what it needs of
:class:`Context`). Every price is the verifier's own arithmetic: expected tokens from the
speculation policy's ``AcceptanceEstimator`` (chains from per-position rates, trees from
measured tokens per tree step), seconds from its ``StepCostModel`` (``estimate``: cell or fit,
overhead included; a tree of n nodes priced like a chain of n drafts, as the policy prices it),
and the adaptive row is a fresh adaptive ``SpeculationPolicy`` asked what it would do
(``choose_shapes``); the ``adaptive (race)`` row is adaptive as served with the mode race,
the best priced of the modes it races (``verifier_svc/mode_race.py``), and
:func:`should_match` the fastest mode a user could pin. "x plain decoding" is tokens per second against one token per
speculation-off step at the same costs.

Suffix candidates (modes ``suffix`` and ``hybrid:N``, and adaptive's suffix arms) depend on the
text a session has seen, so they are priced by a replay of the target's continuations
(``dflash_app.diagnose_suffix``) when the context carries one: adaptive is then priced as the
verifier serves it, with its suffix arms, step by step; without one (no local probe, or
``--suffix off``), as a policy without suffix candidates chooses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

from dflash.core.speculation import MAX_TREE_BUDGET, SpecMode
from verifier_svc.acceptance import TREE_MEASURED_STEPS
from verifier_svc.cost_model import StepCostModel
from verifier_svc.policy import CANDIDATES, DEFAULT_RACE_ARMS, SpeculationPolicy
from verifier_svc.race_arms import race_arms as raced

if TYPE_CHECKING:
    from dflash_app.diagnose_suffix import Replayed, SuffixReplay

LABEL = "diagnose"


@dataclasses.dataclass(frozen=True)
class Context:
    """What the modes are priced from.

    ``blocks``: verified chain blocks ``(drafts, accepted drafts)`` (as the verifier records
    them); ``trees``: node budget -> mean tokens one tree step commits (bonus included), for the
    budgets measured; ``tree_budgets``: the verifier's ``--tree-budgets`` (adaptive's arms);
    ``tree_budget``: its ``--tree-budget`` (mode tree); ``replay``: the continuations to replay
    suffix candidates over (None: suffix candidates are not priced)."""

    costs: StepCostModel
    blocks: Sequence[tuple[int, int]]
    trees: dict[int, float]
    block_size: int
    tree_budgets: tuple[int, ...]
    tree_budget: int
    replay: SuffixReplay | None = None

    @property
    def plain_seconds(self) -> float:
        return self.costs.estimate(1, 0, self.costs.fit())

    def policy(self, tree_budgets: Sequence[int] = ()) -> SpeculationPolicy:
        """A fresh adaptive policy holding these costs and this acceptance (no exploration)."""
        p = SpeculationPolicy(SpecMode.ADAPTIVE, explore_every=0,
                              tree_budgets=[n for n in tree_budgets if n in self.trees])
        p.costs = self.costs
        p.observe_acceptance(LABEL, list(self.blocks))
        for n, tokens in self.trees.items():
            for _ in range(TREE_MEASURED_STEPS):   # one mean, seen as measured
                p.acceptance.observe_trees(LABEL, [(n, tokens)])   # type: ignore[list-item]
        return p


@dataclasses.dataclass(frozen=True)
class Priced:
    """One servable mode at these costs and this acceptance."""

    mode: str                 # how it is served: "off", "fixed", "chain:3" (fixed, block_size
                              # 4), "tree:15" (tree, tree_budget 15), "adaptive", ...
    tokens: float             # expected tokens committed per step, bonus included
    seconds: float            # expected seconds per step, overhead included
    speedup: float            # tokens per second against one token per plain step
    choice: str = ""          # adaptive: what it picks ("k = 2", "tree of 7 nodes", "off";
                              # replayed: the shapes by share of steps)
    # replayed modes: accepted drafts by who proposed them ("drafter", "suffix")
    accepted_by_source: dict[str, int] | None = None

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "tokens": round(self.tokens, 3),
               "ms": round(1e3 * self.seconds, 2), "speedup": round(self.speedup, 3),
               "choice": self.choice}
        if self.accepted_by_source is not None:
            out["accepted_by_source"] = dict(self.accepted_by_source)
        return out


@dataclasses.dataclass(frozen=True)
class ModeEntry:
    """One mode of the verifier: ``price(ctx)`` -> its rows (a mode with a size, such as trees
    of each budget, may give several; none where it cannot be priced)."""

    name: str
    price: Callable[[Context], list[Priced]]


def _row(ctx: Context, mode: str, tokens: float, drafts: int, choice: str = "") -> Priced:
    sec = ctx.costs.estimate(1, drafts, ctx.costs.fit())
    return Priced(mode, tokens, sec, tokens / sec * ctx.plain_seconds, choice)


def _off(ctx: Context) -> list[Priced]:
    return [_row(ctx, "off", 1.0, 0)]


def _fixed(ctx: Context) -> list[Priced]:
    top = ctx.block_size - 1
    return [_row(ctx, "fixed", ctx.policy().expected_tokens(LABEL, top), top)] if top else []


def _chains(ctx: Context) -> list[Priced]:
    """Shorter fixed blocks (mode fixed with a request's ``block_size`` of k + 1): the chain
    lengths adaptive chooses among, below the full block."""
    policy = ctx.policy()
    return [_row(ctx, f"chain:{k}", policy.expected_tokens(LABEL, k), k)
            for k in CANDIDATES if 0 < k < ctx.block_size - 1]


def _trees(ctx: Context) -> list[Priced]:
    sizes = sorted(n for n in set(ctx.tree_budgets) | {ctx.tree_budget} if n in ctx.trees)
    return [_row(ctx, f"tree:{n}", ctx.trees[n], n) for n in sizes]


def _replayed(ctx: Context, mode: str, r: Replayed, choice: str = "") -> Priced:
    sec = r.seconds / r.steps if r.steps else ctx.plain_seconds
    return Priced(mode, r.tau, sec, r.tau / sec * ctx.plain_seconds, choice,
                  {"drafter": r.drafter_accepted, "suffix": r.suffix_accepted})


def _suffix(ctx: Context) -> list[Priced]:
    """Mode suffix (its ``--tree-budget`` nodes at most, as many as pay each step)."""
    if ctx.replay is None:
        return []
    r = ctx.replay.run(ctx.policy(), SpecMode.SUFFIX, tree_budget=ctx.tree_budget)
    return [_replayed(ctx, "suffix", r, r.choice())]     # "off": it never speculated


def _hybrids(ctx: Context) -> list[Priced]:
    """Mode hybrid with each node budget trees are priced at (a request's ``tree_budget``)."""
    if ctx.replay is None or not ctx.trees:
        return []
    policy = ctx.policy(tuple(ctx.trees))
    sizes = sorted(n for n in set(ctx.tree_budgets) | {ctx.tree_budget} if n in ctx.trees)
    return [_replayed(ctx, f"hybrid:{n}", ctx.replay.run(policy, SpecMode.HYBRID, n))
            for n in sizes]


def _adaptive(ctx: Context) -> list[Priced]:
    policy = ctx.policy(ctx.tree_budgets)
    if ctx.replay is not None:      # as served: suffix arms, and hybrid trees
        r = ctx.replay.run(policy, SpecMode.ADAPTIVE, tree_budget=ctx.tree_budget)
        return [_replayed(ctx, "adaptive", r, r.choice())]
    job = SimpleNamespace(mode=SpecMode.ADAPTIVE, block_limit=ctx.block_size, emitted=0, stats=None,
                          tree_budget=max(ctx.tree_budgets, default=0) or MAX_TREE_BUDGET, suffix_limit=0,
                          req=SimpleNamespace(max_tokens=1 << 30, proposer=SimpleNamespace(
                              card=SimpleNamespace(label=LABEL))))
    d = policy.choose_shapes([job]).decision
    if not d.cost_seconds:          # nothing priced (no cell, no fit): the policy is exploring
        return []
    choice = (f"tree of {d.budget} nodes" if d.budget else f"k = {d.k}" if d.k else "off")
    return [Priced("adaptive", d.expected_tokens, d.cost_seconds,
                   d.expected_tokens / d.cost_seconds * ctx.plain_seconds, choice)]


#: The row of adaptive as served with the mode race (``--mode-race on``, the default).
RACE_ROW = "adaptive (race)"
#: What the report means by a fixed mode: every row a user could pin (adaptive's are not).
PINNED = lambda r: not r.mode.startswith(SpecMode.ADAPTIVE)   # noqa: E731


def race_arms(ctx: Context) -> list[str]:
    """The rows of the modes adaptive races (``verifier_svc.policy.DEFAULT_RACE_ARMS`` at the
    verifier's largest tree budget)."""
    return raced(DEFAULT_RACE_ARMS, max(ctx.tree_budgets, default=0))


def _race(ctx: Context) -> list[Priced]:
    """Adaptive with the mode race: per batch bucket it plays the best of its arms
    (``verifier_svc/mode_race.py``), here the best priced, exploration aside; its choice names
    the arm (``adaptive``: the per-step choice itself)."""
    rows = {r.mode: r for m in MODES if m.name != "race" for r in m.price(ctx)}
    cands = [rows[a] for a in race_arms(ctx) if a in rows]
    if not cands:
        return []
    best = max(cands, key=lambda r: r.speedup)
    choice = f"plays {best.mode}" + (f" ({best.choice})" if best.choice else "")
    return [Priced(RACE_ROW, best.tokens, best.seconds, best.speedup, choice,
                   best.accepted_by_source)]


def should_match(rows: Sequence[Priced]) -> Priced | None:
    """The fastest mode a user could pin (``off`` included): what adaptive should match."""
    return max((r for r in rows if PINNED(r)), key=lambda r: r.speedup, default=None)


#: The servable modes, in report order. A new verifier mode is one entry here.
MODES: tuple[ModeEntry, ...] = (
    ModeEntry("off", _off),
    ModeEntry("fixed", _fixed),
    ModeEntry("chain", _chains),
    ModeEntry("tree", _trees),
    ModeEntry("suffix", _suffix),
    ModeEntry("hybrid", _hybrids),
    ModeEntry("adaptive", _adaptive),
    ModeEntry("race", _race),
)


def price_modes(ctx: Context, modes: Sequence[ModeEntry] = MODES) -> list[Priced]:
    """Every row of every mode in ``modes``; [] when the costs cannot price plain decoding
    (no speculation-off cell)."""
    if not ctx.costs.measured(1, 0):
        return []
    return [row for m in modes for row in m.price(ctx)]


def best_speculative(rows: Sequence[Priced]) -> Priced | None:
    """The fastest row that speculates (adaptive counts when it chose to speculate; the race's
    row repeats the row it plays)."""
    spec = [r for r in rows if r.mode not in ("off", RACE_ROW) and r.choice != "off"]
    return max(spec, key=lambda r: r.speedup, default=None)
