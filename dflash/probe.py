"""Live acceptance probes for ``dflash diagnose``: tau over a few prompts, a verdict, and the
target_layer_ids offset probe.

In process: the real decode loop (``verifier_svc.engine.VerifierEngine``) with the real drafter
(``drafter_svc.engine.DrafterEngine``), greedy; or against a running gateway.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from dflash.stats import AcceptanceCounter

BROKEN_TAU, DEGRADED_TAU = 1.1, 1.5          # tau below these (with p1 below the rates below)
BROKEN_P1, DEGRADED_P1 = 0.1, 0.4            # acceptance rate at draft position 1
OFFSET_MARGIN = 0.25                         # a shift must beat the saved ids by this much tau


@dataclasses.dataclass
class ProbeResult:
    stats: AcceptanceCounter
    block_size: int
    prompts: int
    seconds: float

    @property
    def tau(self) -> float:
        return self.stats.mean_acceptance_length

    def summary(self) -> str:
        s = self.stats
        rates = ", ".join(f"{r:.3f}" for r in s.per_position_rate) or "-"
        return (f"tau {self.tau:.2f} (block size {self.block_size}) over {self.prompts} prompts, "
                f"{s.drafts} drafts; draft acceptance rate {100 * s.draft_acceptance_rate:.1f}%; "
                f"per-position [{rates}]; fallback steps {s.fallback_steps}")


@dataclasses.dataclass
class Verdict:
    verdict: str            # "healthy" | "degraded" | "broken"
    causes: list[str]


def judge(r: ProbeResult, static_issues: list[str] = ()) -> Verdict:
    """healthy / degraded / broken from tau and the first-position rate, with likely causes."""
    s = r.stats
    steps = s.drafts + s.fallback_steps
    p1 = s.per_position_rate[0] if s.per_position_rate else 0.0
    causes = list(static_issues)
    if steps and s.fallback_steps > steps / 2:
        return Verdict("broken", causes + ["the drafter failed most steps (unreachable, timeouts or "
                                           "errors): see its log and dflash_spec_decode_fallback_steps"])
    if r.tau < BROKEN_TAU or p1 < BROKEN_P1:
        verdict = "broken"
    elif r.tau < DEGRADED_TAU or p1 < DEGRADED_P1:
        verdict = "degraded"
    else:
        return Verdict("healthy", causes)
    causes += [
        "target_layer_ids shifted by one (output of layer i vs hidden_states[i]): run the offset probe",
        "the drafter was trained for another target or tokenizer (dflash_serve.target_fingerprint)",
        "mask_token_id differs from the one used in training",
        "rope_theta / rope scaling or dtype differ from training",
    ]
    if verdict == "degraded":
        causes.append("prompts far from the drafter's training data (try prompts of that domain)")
    if s.fallback_steps:
        causes.append(f"{s.fallback_steps} steps fell back (drafter errors or timeouts)")
    return Verdict(verdict, causes)


class InProcessProbe:
    """Target + drafter in this process. ``layer_ids`` overrides the drafter's taps (same
    weights), which is how the offset probe tries a shift."""

    def __init__(self, target_dir: str | Path, drafter_dir: str | Path, *, dtype: str = "float32"):
        from dflash.checkpoint import load_drafter, load_target_head, torch_dtype
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.target import TargetModel

        self.target = TargetModel(target_dir, dtype=dtype)
        self.verifier = VerifierEngine(self.target)
        self.drafter = load_drafter(drafter_dir, dtype=torch_dtype(dtype))
        self.head = load_target_head(target_dir, dtype=torch_dtype(dtype))
        self.layer_ids = tuple(self.drafter.cfg.target_layer_ids)

    def run(self, prompts: list[list[int]], *, max_tokens: int = 64,
            layer_ids: tuple[int, ...] | None = None, ignore_eos: bool = False) -> ProbeResult:
        from drafter_svc.engine import DrafterEngine
        from verifier_svc.engine import Request

        saved = self.drafter.cfg
        self.drafter.cfg = dataclasses.replace(saved, target_layer_ids=tuple(layer_ids or self.layer_ids))
        try:
            engine = DrafterEngine(self.drafter, self.head)   # reads the card from drafter.cfg
        finally:
            self.drafter.cfg = saved
        total, t0 = AcceptanceCounter(), time.perf_counter()
        for i, p in enumerate(prompts):
            last = None
            for last in self.verifier.generate(Request(request_id=f"diagnose-{i}", prompt=list(p),
                                                       max_tokens=max_tokens, proposer=engine,
                                                       ignore_eos=ignore_eos)):
                pass
            total.merge(last.stats)
        return ProbeResult(total, engine.card.block_size, len(prompts), time.perf_counter() - t0)

    def offsets(self, prompts: list[list[int]], *, max_tokens: int = 64, shifts=(-1, 0, 1),
                ignore_eos: bool = False, base: ProbeResult | None = None
                ) -> list[tuple[int, tuple[int, ...], ProbeResult | None]]:
        """tau with every id shifted by each of ``shifts`` (None where a shift leaves the range).
        ``base``: an already measured run of the saved ids on the same prompts (reused for 0)."""
        out = []
        n = self.target.num_layers
        for d in shifts:
            ids = tuple(i + d for i in self.layer_ids)
            if d == 0 and base is not None:
                out.append((d, ids, base))
            elif all(0 <= i < n for i in ids):
                out.append((d, ids, self.run(prompts, max_tokens=max_tokens, layer_ids=ids,
                                             ignore_eos=ignore_eos)))
            else:
                out.append((d, ids, None))
        return out


def offset_conclusion(rows) -> tuple[int, str]:
    """(best shift, sentence). Shift 0 unless another beats the saved ids clearly."""
    base = next(r for d, _, r in rows if d == 0)
    best_d, best_ids, best = max(((d, ids, r) for d, ids, r in rows if r is not None),
                                 key=lambda x: (x[2].tau, x[0] == 0))
    if best_d != 0 and best.tau >= base.tau + max(OFFSET_MARGIN, 0.1 * base.tau):
        why = (" (the drafter was trained on hidden_states[id], i.e. the output of layer id - 1)"
               if best_d == -1 else "")
        return best_d, (f"target_layer_ids look shifted by {best_d:+d}: {list(best_ids)} give tau "
                        f"{best.tau:.2f} vs {base.tau:.2f} with the saved ids{why}. Fix: set "
                        f"dflash_config.target_layer_ids to {list(best_ids)} (or retrain).")
    return 0, f"no shift does better than the saved ids (tau {base.tau:.2f})"


def gateway_probe(address: str, prompts: list[str], *, max_tokens: int = 64, drafter: str = "",
                  raw: bool = False) -> ProbeResult:
    """Same measurement against a running gateway (greedy, speculation on)."""
    from dflash.client import GatewayClient, build_request
    from dflash.convert import stats_from_proto

    client = GatewayClient(address)
    total, t0, block = AcceptanceCounter(), time.perf_counter(), 0
    try:
        for p in prompts:
            req = (build_request(p, max_tokens=max_tokens, drafter=drafter) if raw else
                   build_request(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                                 drafter=drafter))
            c = client.complete(req)
            total.merge(stats_from_proto(c.acceptance))
            block = max(block, len(c.acceptance.accepted_per_position) + 1)
    finally:
        client.close()
    return ProbeResult(total, block, len(prompts), time.perf_counter() - t0)
