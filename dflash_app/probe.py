"""Live acceptance probes for ``dflash diagnose``: tau over a few prompts, in process or through a gateway.

In process: the models as the services load them, the real decode loop
(``verifier_svc.engine.VerifierEngine``) with the real drafter (``drafter_svc.engine.DrafterEngine``),
greedy; or against a running gateway. The precise, teacher-forced measurement of the wiring is
``dflash_app.diagnose_tf`` / ``dflash_app.diagnose_wiring``; the thresholds below decide "broken" (and
"degraded" where no step costs are known) in ``dflash_app.diagnose``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from dflash.core.stats import AcceptanceCounter

BROKEN_TAU, DEGRADED_TAU = 1.1, 1.5          # tau below these (with p1 below the rates below)
BROKEN_P1, DEGRADED_P1 = 0.1, 0.4            # acceptance rate at draft position 1


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


class InProcessProbe:
    """Target + drafter in this process, loaded as the services load them (``TargetModel``;
    ``DrafterEngine.from_pretrained``, with the checkpoint's draft vocabulary).

    ``run``: the real greedy decode loop over some prompts (``VerifierEngine``);
    ``collect``: the teacher-forced probe's continuations (``dflash_app.diagnose_tf.collect``).
    Step costs are measured on the served pair instead (``dflash_app.served``).

    ``target``: a loaded ``TargetModel`` of ``target_dir`` to use (``dflash diagnose`` passes the
    served one, ``dflash_app.served``), not closed here; None: one loaded in ``dtype``. The
    drafter is loaded in ``dtype`` (float32: the probe's statistics at full precision)."""

    def __init__(self, target_dir: str | Path, drafter_dir: str | Path, *, dtype: str = "float32",
                 target=None):
        from drafter_svc.engine import DrafterEngine
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.target import TargetModel

        self.target = target if target is not None else TargetModel(target_dir, dtype=dtype)
        self.verifier = VerifierEngine(self.target)
        self.engine = DrafterEngine.from_pretrained(drafter_dir, target_dir, dtype=dtype,
                                                    context_threads=0)
        self.drafter, self.head = self.engine.drafter, self.engine.head
        self.layer_ids = tuple(self.drafter.cfg.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.drafter.cfg.block_size

    def run(self, prompts: list[list[int]], *, max_tokens: int = 64,
            ignore_eos: bool = False) -> ProbeResult:
        """Greedy generation of each prompt with blocks of the drafter's size (fixed mode)."""
        from verifier_svc.engine import Request

        total, t0 = AcceptanceCounter(), time.perf_counter()
        for i, p in enumerate(prompts):
            last = None
            for ev in self.verifier.generate(Request(request_id=f"diagnose-{i}", prompt=list(p),
                                                     max_tokens=max_tokens, proposer=self.engine,
                                                     ignore_eos=ignore_eos)):
                last = ev
            total.merge(last.stats)
        return ProbeResult(total, self.block_size, len(prompts), time.perf_counter() - t0)

    def collect(self, prompts: list[list[int]], domains: list[str], *, max_new_tokens: int):
        from dflash_app.diagnose_tf import collect

        eos = self.target.eos_token_ids
        pad = self.target.config.pad_token_id
        pad = pad if pad is not None else (min(eos) if eos else 0)
        return collect(self.target.model, prompts, domains, max_new_tokens=max_new_tokens,
                       eos_ids=eos, pad_id=pad)

    def close(self) -> None:
        self.verifier.close()
        self.engine.close()


def gateway_probe(address: str, prompts: list, *, max_tokens: int = 64, drafter: str = "",
                  raw: bool = False) -> ProbeResult:
    """Same measurement against a running gateway (greedy, speculation on). ``prompts``: text
    (a user message, or raw text with ``raw``) or chat message lists."""
    from dflash.client import GatewayClient, build_request
    from dflash.core.convert import stats_from_proto

    client = GatewayClient(address)
    total, t0, block = AcceptanceCounter(), time.perf_counter(), 0
    try:
        for p in prompts:
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            req = (build_request(p, max_tokens=max_tokens, drafter=drafter) if raw and
                   isinstance(p, str) else
                   build_request(messages=msgs, max_tokens=max_tokens, drafter=drafter))
            c = client.complete(req)
            total.merge(stats_from_proto(c.acceptance))
            block = max(block, len(c.acceptance.accepted_per_position) + 1)
    finally:
        client.close()
    return ProbeResult(total, block, len(prompts), time.perf_counter() - t0)
