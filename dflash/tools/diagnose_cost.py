"""Does speculation pay? Step costs (measured here, or as a deployment reports them) and the
speculation policy's own arithmetic over them.

In process, the real decode loop measures them: one ``VerifierEngine`` runs a few steps of one
session at each block length (speculation off for ``k = 0``, fixed blocks of ``k + 1``
otherwise, the in-process ``DrafterEngine`` drafting), and its own ``SpeculationPolicy``
records every step into its ``StepCostModel`` exactly as a serving verifier does. Against a
deployment (``--gateway`` with ``--metrics``), the verifier's ``dflash_spec_policy_*`` gauges
are those cells.

Then a fresh policy (``verifier_svc.policy.SpeculationPolicy``, adaptive) is given those costs
and the measured acceptance, and asked what it would do: the ``k`` it chooses, the tokens it
expects and the step it prices are its own (``choose_shapes``, ``Decision``), so the verdict is
the policy's formula, not a second one. "x plain decoding" is tokens per second against one
token per speculation-off step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import urllib.request
from collections.abc import Sequence
from types import SimpleNamespace

from dflash.core.speculation import MODE_ADAPTIVE, MODE_OFF
from verifier_svc.cost_model import StepCostModel
from verifier_svc.policy import CANDIDATES, SpeculationPolicy

ROUNDS = 3                # timed steps per block length, interleaved across the lengths
OVERHEAD_STEPS = 6        # plain decode steps of the real loop that measure the cycle overhead
SYNTHETIC_BLOCKS = 10000  # blocks that stand for a deployment's per-position rates


@dataclasses.dataclass
class CostTable:
    """What one cost measurement saw: the policy's cost model and per-k medians for display."""

    costs: StepCostModel
    verify_s: dict[int, float]      # k -> median verify seconds of a step
    draft_s: dict[int, float]       # k -> median draft seconds of a step
    source: str                     # "measured here" | "reported by <url>"

    def as_dict(self) -> dict:
        return {"source": self.source,
                "verify_ms": {k: round(1e3 * v, 2) for k, v in sorted(self.verify_s.items())},
                "draft_ms": {k: round(1e3 * v, 2) for k, v in sorted(self.draft_s.items())},
                "overhead_ms": round(1e3 * self.costs.overhead_seconds, 2),
                "cells_ms": {f"{b}x{k}": round(1e3 * v, 2)
                             for (b, k), v in sorted(self.costs.cost_table().items())}}


def measure_costs(target, proposer, prompt: list[int], block_size: int, *,
                  rounds: int = ROUNDS) -> CostTable:
    """Step seconds at each candidate k up to ``block_size - 1``, into the policy's
    ``StepCostModel``.

    ``target``: ``verifier_svc.target.TargetModel``; ``proposer``: a ``DrafterEngine``. After
    one prefill of ``prompt``, each round times, for every k in turn, what a decode step of
    the verifier calls: the drafter's ``propose`` of a block of k + 1 (with the one new
    context row a step sends) and the target's ``forward_batch`` of k + 1 tokens, the cache
    cropped back after each; k = 0 is a plain step (no drafter, no taps). Rounds interleave
    the k so that a change in the machine's load lands on every cell alike. The per-cycle
    overhead outside verify and draft comes from a few steps of the real decode loop
    (``VerifierEngine``, speculation off)."""
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from verifier_svc.engine import Request, VerifierEngine

    costs = StepCostModel()
    engine = VerifierEngine(target, spec_mode=MODE_OFF, tree_budgets=())
    try:
        for _ in engine.generate(Request(request_id="diagnose-overhead", prompt=list(prompt),
                                         max_tokens=OVERHEAD_STEPS, ignore_eos=True)):
            pass
    finally:
        engine.close()
    costs.observe_overhead(engine.policy.overhead_seconds)
    taps_ids = tuple(proposer.card.target_layer_ids)
    ks = [k for k in CANDIDATES if k <= block_size - 1]
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
        for _ in range(rounds):
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
                verify[k].append(v)
                draft[k].append(d)
    finally:
        proposer.release([sid])
        del cache                       # the pool frees a dropped sequence's row
        target.pool.collect()
    med = lambda x: {k: statistics.median(v) for k, v in x.items() if v}   # noqa: E731
    return CostTable(costs, med(verify), med(draft), "measured here")


@dataclasses.dataclass
class Payoff:
    """Speculation against plain decoding at one acceptance profile."""

    block_size: int
    fixed_speedup: float            # blocks of block_size every step
    adaptive_k: int                 # drafts the adaptive policy chooses (0: no speculation)
    adaptive_speedup: float
    expected_tokens: float          # per step at adaptive_k, bonus included
    plain_ms: float                 # one speculation-off step

    def sentence(self) -> str:
        k = self.adaptive_k
        ad = ("adaptive turns speculation off (k = 0): 1.0x" if k == 0 else
              f"adaptive chooses k = {k}; expected {self.adaptive_speedup:.2f}x")
        return (f"speculation at block {self.block_size} is {self.fixed_speedup:.2f}x plain "
                f"decoding here; {ad}")

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in vars(self).items()} | \
            {"sentence": self.sentence()}


def payoff(costs: StepCostModel, blocks: Sequence[tuple[int, int]], block_size: int,
           label: str = "diagnose") -> Payoff | None:
    """What the adaptive policy makes of ``costs`` and the verified ``blocks`` ((drafts,
    accepted drafts) each, as the verifier records them). None when the costs cannot price
    plain decoding (no speculation-off cell and no fit)."""
    fit = costs.fit()
    if not costs.measured(1, 0) or (fit is None and not costs.measured(1, block_size - 1)):
        return None
    policy = SpeculationPolicy(MODE_ADAPTIVE, explore_every=0, tree_budgets=())
    policy.costs = costs
    policy.observe_acceptance(label, list(blocks))
    job = SimpleNamespace(mode=MODE_ADAPTIVE, block_limit=block_size, emitted=0, stats=None,
                          tree_budget=0, req=SimpleNamespace(
                              max_tokens=1 << 30, proposer=SimpleNamespace(card=SimpleNamespace(label=label))))
    policy.choose_shapes([job])
    d = policy.last_decision
    plain = costs.estimate(1, 0, fit)
    top = block_size - 1
    fixed = policy.expected_tokens(label, top) / costs.estimate(1, top, fit) * plain
    adaptive = d.expected_tokens / d.cost_seconds * plain if d.cost_seconds else 1.0
    return Payoff(block_size, fixed, d.k, adaptive, d.expected_tokens, 1e3 * plain)


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
