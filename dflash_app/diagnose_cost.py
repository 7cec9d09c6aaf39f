"""Does speculation pay? Step costs (measured here, or as a deployment reports them) and the
verifier's own arithmetic over them, mode by mode (``dflash_app.diagnose_modes``).

In process (:func:`measure_costs`), the target and drafter are the ones the services would
serve (``dflash_app.served``: their threads, dtypes, skinny and packed products), timed on the
thread that runs their forwards: each round times, for every candidate k, the drafter's
``propose`` of a block of k + 1 and the target's ``forward_batch`` of k + 1 tokens, into the
verifier's ``StepCostModel``. Against a deployment (``--gateway`` with ``--metrics``), the
verifier's ``dflash_spec_policy_*`` gauges are those cells, and its tree gauges the tokens per
tree step.

:func:`payoff` prices every servable mode (``diagnose_modes.MODES``) and states the spread of
the best one's speed-up over the rounds of costs (at least :data:`MIN_SPREAD`): the verdict
calls speculation "does not pay here" only when the best servable mode is below 1.0x plain
decoding by more than that spread.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import urllib.request
from collections.abc import Sequence

from dflash.core.speculation import SpecMode
from dflash_app.diagnose_modes import RACE_ROW, Context, Priced, best_speculative, price_modes, should_match
from verifier_svc.cost_model import StepCostModel
from verifier_svc.policy import CANDIDATES

ROUNDS = 5                # timed steps per block length, interleaved across the lengths
OVERHEAD_STEPS = 6        # plain decode steps of the real loop that measure the cycle overhead
SYNTHETIC_BLOCKS = 10000  # blocks that stand for a deployment's per-position rates
#: Least spread (x plain decoding) stated for an expected speed-up: one machine's speed moves
#: this much between runs (docs/diagnose.md), whatever a few rounds of costs show.
MIN_SPREAD = 0.05


@dataclasses.dataclass
class CostTable:
    """What one cost measurement saw: the policy's cost model and per-k medians for display."""

    costs: StepCostModel
    verify_s: dict[int, float]      # k -> median verify seconds of a step
    draft_s: dict[int, float]       # k -> median draft seconds of a step
    source: str                     # "measured here" | "reported by <url>"
    rounds: list[StepCostModel] = dataclasses.field(default_factory=list)   # one per round
    settings: dict = dataclasses.field(default_factory=dict)   # dflash_app.served choices

    def as_dict(self) -> dict:
        return {"source": self.source,
                "verify_ms": {k: round(1e3 * v, 2) for k, v in sorted(self.verify_s.items())},
                "draft_ms": {k: round(1e3 * v, 2) for k, v in sorted(self.draft_s.items())},
                "overhead_ms": round(1e3 * self.costs.overhead_seconds, 2),
                "cells_ms": {f"{b}x{k}": round(1e3 * v, 2)
                             for (b, k), v in sorted(self.costs.cost_table().items())},
                "rounds": len(self.rounds), "settings": self.settings}


def measure_costs(target, proposer, prompt: list[int], block_size: int, *,
                  rounds: int = ROUNDS, threads: int = 0) -> CostTable:
    """Step seconds at each candidate k up to ``block_size - 1``, into the policy's
    ``StepCostModel`` (and one model per round, for the spread).

    ``target``: ``verifier_svc.target.TargetModel``; ``proposer``: a ``DrafterEngine``; call on
    the thread that runs their forwards (``dflash_app.served.Served.run``). After
    one prefill of ``prompt``, each round times, for every k in turn, what a decode step of
    the verifier calls: the drafter's ``propose`` of a block of k + 1 (with the one new
    context row a step sends) and the target's ``forward_batch`` of k + 1 tokens, the cache
    cropped back after each; k = 0 is a plain step (no drafter, no taps). Rounds interleave
    the k so that a change in the machine's load lands on every cell alike. The per-cycle
    overhead outside verify and draft comes from a few steps of the real decode loop
    (``VerifierEngine``, speculation off, its decode thread on ``threads`` torch threads; 0:
    the process default)."""
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from verifier_svc.engine import Request, VerifierEngine

    costs = StepCostModel()
    engine = VerifierEngine(target, spec_mode=SpecMode.OFF, tree_budgets=(), threads=threads)
    try:
        for _ in engine.generate(Request(request_id="diagnose-overhead", prompt=list(prompt),
                                         max_tokens=OVERHEAD_STEPS, ignore_eos=True)):
            pass
    finally:
        engine.close()
    costs.observe_overhead(engine.policy.overhead_seconds)
    taps_ids = tuple(proposer.card.target_layer_ids)
    ks = sorted({k for k in CANDIDATES if k <= block_size - 1} | {block_size - 1})
    per_round = [StepCostModel() for _ in range(rounds)]
    verify: dict[int, list[float]] = {k: [] for k in ks}
    draft: dict[int, list[float]] = {k: [] for k in ks}
    sid = "diagnose-costs"
    cache = target.new_cache()
    try:
        with target.lock:
            logits, taps = target.forward(list(prompt), cache, taps_ids, logits_to_keep=1)
        n, anchor = len(prompt), int(logits[-1].argmax())
        proposer.propose([ProposalRequest(session_id=sid, context_start=0, context=taps[:-1],
                                          anchor_token=anchor, block_size=1, sampling=Sampling())])
        for r in range(rounds):
            for k in ks:
                d = 0.0
                if k:
                    t = time.perf_counter()
                    proposer.propose([ProposalRequest(
                        session_id=sid, context_start=n - 1, context=taps[-1:], anchor_token=anchor,
                        block_size=k + 1, sampling=Sampling())])
                    d = time.perf_counter() - t
                t = time.perf_counter()
                with target.lock:
                    target.forward_batch([[anchor] * (k + 1)], [cache], [taps_ids if k else ()])
                    v = time.perf_counter() - t
                    target.crop(cache, n)
                costs.observe_step(1, k, v + d)
                costs.observe_verify(1, k, v)     # what suffix trees are priced from
                for _ in range(2):      # confirmed: one round's cell is its own price
                    per_round[r].observe_step(1, k, v + d)
                    per_round[r].observe_verify(1, k, v)
                verify[k].append(v)
                draft[k].append(d)
    finally:
        proposer.release([sid])
        del cache                       # the pool frees a dropped sequence's row
        target.pool.collect()
    for m in per_round:
        m.observe_overhead(costs.overhead_seconds)
    med = lambda x: {k: statistics.median(v) for k, v in x.items() if v}   # noqa: E731
    return CostTable(costs, med(verify), med(draft), "measured here", per_round)


@dataclasses.dataclass
class Payoff:
    """Every servable mode priced at one acceptance profile (``diagnose_modes.Priced`` rows),
    and the spread of the best one's speed-up."""

    block_size: int
    rows: list[Priced]
    spread: float                   # x plain decoding: half the range over rounds, >= MIN_SPREAD
    plain_ms: float                 # one speculation-off step

    def row(self, mode: str) -> Priced | None:
        return next((r for r in self.rows if r.mode == mode), None)

    @property
    def best(self) -> Priced | None:
        return best_speculative(self.rows)

    @property
    def pays(self) -> bool:
        """The best servable mode is at least as fast as plain decoding."""
        return self.best is not None and self.best.speedup >= 1.0

    @property
    def does_not_pay(self) -> bool:
        """The best servable mode is below plain decoding by more than the spread."""
        return self.best is None or self.best.speedup < 1.0 - self.spread

    def sentence(self) -> str:
        fixed, ad, best = self.row("fixed"), self.row("adaptive"), self.best
        parts = [f"speculation at block {self.block_size} is {fixed.speedup:.2f}x plain decoding "
                 "here" if fixed else "no fixed blocks priced"]
        trees = [r for r in self.rows if r.mode.startswith("tree:")]
        if trees:
            parts.append("trees " + ", ".join(f"{r.mode[5:]} nodes {r.speedup:.2f}x" for r in trees))
        suffix, hybrids = self.row("suffix"), [r for r in self.rows if r.mode.startswith("hybrid:")]
        if suffix:
            parts.append(f"suffix {suffix.speedup:.2f}x (tau {suffix.tokens:.2f})")
        if hybrids:
            parts.append("hybrid " + ", ".join(f"{r.mode[7:]} nodes {r.speedup:.2f}x" for r in hybrids))
        if ad is None:
            parts.append("adaptive not priced")
        elif ad.choice == "off":
            parts.append("adaptive turns speculation off (k = 0): 1.0x")
        else:
            what = f"a {ad.choice}" if ad.choice.startswith(("tree", "suffix")) else ad.choice
            src = ad.accepted_by_source
            share = (f", {src['suffix']} of {src['suffix'] + src['drafter']} accepted drafts "
                     "from suffix candidates" if src and src["suffix"] + src["drafter"] else "")
            parts.append(f"adaptive chooses {what}; expected {ad.speedup:.2f}x (tau "
                         f"{ad.tokens:.2f}{share})")
        race, match = self.row(RACE_ROW), should_match(self.rows)
        if race is not None and match is not None and ad is not None:
            parts.append(f"adaptive should match {match.mode} ({match.speedup:.2f}x): its per-step "
                         f"choice alone {ad.speedup / match.speedup:.2f}x of it, with the mode race "
                         f"it {race.choice} ({race.speedup / match.speedup:.2f}x)")
        if best is not None:
            parts.append(f"best {best.mode} {best.speedup:.2f}x (spread +-{self.spread:.2f})")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        fixed, ad, best = self.row("fixed"), self.row("adaptive"), self.best
        k = 0 if ad is None or ad.choice == "off" else (
            int(ad.choice[4:].split()[0]) if ad.choice.startswith("k = ") else self.block_size - 1)
        return {"block_size": self.block_size, "plain_ms": round(self.plain_ms, 2),
                "fixed_speedup": round(fixed.speedup, 3) if fixed else None,
                "adaptive_choice": ad.choice if ad else None, "adaptive_k": k,
                "adaptive_speedup": round(ad.speedup, 3) if ad else None,
                "expected_tokens": round(ad.tokens, 3) if ad else None,
                "should_match": match.mode if (match := should_match(self.rows)) else None,
                "should_match_speedup": round(match.speedup, 3) if match else None,
                "race_choice": race.choice if (race := self.row(RACE_ROW)) else None,
                "race_speedup": round(race.speedup, 3) if race else None,
                "best_mode": best.mode if best else None,
                "best_speedup": round(best.speedup, 3) if best else None,
                "spread": round(self.spread, 3), "pays": self.pays,
                "does_not_pay": self.does_not_pay,
                "modes": [r.as_dict() for r in self.rows], "sentence": self.sentence()}


def payoff(table: CostTable, blocks: Sequence[tuple[int, int]], block_size: int, *,
           trees: dict[int, float] | None = None, tree_budgets: tuple[int, ...] = (),
           tree_budget: int = 0, replay=None) -> Payoff | None:
    """Every servable mode at ``table``'s costs and the verified ``blocks`` ((drafts, accepted
    drafts) each, as the verifier records them) and ``trees`` (budget -> tokens per tree step);
    ``replay`` (``diagnose_suffix.SuffixReplay``): the continuations suffix candidates are
    replayed over (None: no suffix modes priced). None when the costs cannot price plain
    decoding (no speculation-off cell)."""
    ctx = Context(table.costs, list(blocks), dict(trees or {}), block_size, tuple(tree_budgets),
                  tree_budget, replay)
    rows = price_modes(ctx)
    if not rows:
        return None
    spread = MIN_SPREAD
    per_round = [best_speculative(price_modes(dataclasses.replace(ctx, costs=m)))
                 for m in table.rounds]
    got = [b.speedup for b in per_round if b is not None]
    if len(got) > 1:
        spread = max(spread, (max(got) - min(got)) / 2)
    return Payoff(block_size, rows, spread, 1e3 * ctx.plain_seconds)


def blocks_from_rates(rates: Sequence[float], n: int = SYNTHETIC_BLOCKS) -> list[tuple[int, int]]:
    """``n`` blocks of ``len(rates)`` drafts whose per-position unconditional acceptance is
    ``rates`` (to 1/n): how a deployment's reported rates enter the policy."""
    r = [1.0] + [min(max(x, 0.0), 1.0) for x in rates] + [0.0]
    for i in range(1, len(r)):
        r[i] = min(r[i], r[i - 1])                   # a chain's rates never rise
    out = []
    for j in range(len(rates) + 1):                  # blocks accepting exactly j drafts
        out += [(len(rates), j)] * round(n * (r[j] - r[j + 1]))
    return out


# ---------------------------------------------------------------------- a deployment's figures
@dataclasses.dataclass
class Deployment:
    """What a verifier's /metrics says: lifetime acceptance per drafter version, the policy's
    cost cells and overhead, mean verify / draft seconds."""

    drafts: dict[str, float]                 # version -> drafted steps
    accepted: dict[str, float]               # version -> accepted drafts
    per_position: dict[str, list[float]]     # version -> accepted steps per position
    cells: dict[tuple[int, int], float]      # (batch bucket, drafts) -> step seconds (EMA)
    overhead: float
    verify_mean: dict[str, float]
    draft_mean: dict[str, float]
    source: str
    trees: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    # version -> node budget -> tokens per tree step (EMA)
    by_source: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # version -> source ("drafter", "suffix") -> accepted draft tokens
    suffix_nodes: dict[str, float] = dataclasses.field(default_factory=dict)
    # version -> suffix candidates verified

    def rates(self, version: str) -> list[float]:
        d = self.drafts.get(version, 0.0)
        return [a / d for a in self.per_position.get(version, [])] if d else []

    def busiest(self) -> str | None:
        real = {v: n for v, n in self.drafts.items() if v != "none"}
        return max(real, key=real.get) if real else None

    def cost_table(self) -> CostTable | None:
        """The cells as a StepCostModel (each cell entered as two equal steps: confirmed)."""
        if not self.cells:
            return None
        m = StepCostModel()
        for (b, k), sec in self.cells.items():
            m.observe_step(b, k, sec)
            m.observe_step(b, k, sec)
        m.observe_overhead(self.overhead)
        one = {k: v for (b, k), v in self.cells.items() if b == 1}
        return CostTable(m, one, {}, f"reported by {self.source}")


def scrape(url: str, timeout: float = 10.0) -> Deployment:
    """Read a verifier's Prometheus /metrics. Raises OSError when unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:      # noqa: S310 (user's URL)
        text = r.read().decode()
    dep = Deployment({}, {}, {}, {}, 0.0, {}, {}, url)
    sums: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            v, lab = s.value, s.labels
            ver = lab.get("drafter_version", "")
            if s.name == "dflash_spec_decode_num_drafts_total":
                dep.drafts[ver] = v
            elif s.name == "dflash_spec_decode_num_accepted_tokens_total":
                dep.accepted[ver] = v
            elif s.name == "dflash_spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(lab["position"])
                row = dep.per_position.setdefault(ver, [])
                row += [0.0] * (pos + 1 - len(row))
                row[pos] = v
            elif s.name == "dflash_spec_policy_step_seconds":
                dep.cells[(int(lab["batch_bucket"]), int(lab["drafts"]))] = v
            elif s.name == "dflash_spec_decode_num_accepted_tokens_by_source_total":
                dep.by_source.setdefault(ver, {})[lab["source"]] = v
            elif s.name == "dflash_spec_decode_num_suffix_nodes_total":
                dep.suffix_nodes[ver] = v
            elif s.name == "dflash_spec_policy_tree_tokens":
                dep.trees.setdefault(ver, {})[int(lab["budget"])] = v
            elif s.name == "dflash_spec_policy_overhead_seconds":
                dep.overhead = v
            elif s.name in ("dflash_spec_decode_verify_seconds_sum", "dflash_spec_decode_verify_seconds_count",
                            "dflash_spec_decode_draft_seconds_sum", "dflash_spec_decode_draft_seconds_count"):
                sums[(s.name, ver)] = v
    for (name, ver), v in sums.items():
        if name.endswith("_sum"):
            n = sums.get((name[:-4] + "_count", ver), 0.0)
            if n:
                (dep.verify_mean if "verify" in name else dep.draft_mean)[ver] = v / n
    return dep
