"""Release and rollback of learned drafter versions, every decision logged with its figures.

* :func:`release`: the gate on the held-out slice; a candidate that passes becomes version
  ``N+1`` of the serving drafter's name, a drafter directory ``<learn_dir>/versions/<name>@<N+1>``
  (bf16 safetensors, z-lab layout) that a drafter process serves.
* :func:`register_canary`: that process registered through the gateway's admin plane
  (``dflash.v1.GatewayAdmin``: ``RegisterDrafter`` then ``SetDrafterWeights``) with a canary
  share of the traffic.
* :class:`ServedTau` / :func:`rollback_check`: served τ per version over a window, from two
  scrapes of the verifier's Prometheus counters (``dflash_spec_decode_num_drafts_total`` and
  ``..._num_accepted_tokens_total`` by ``drafter_version``); the new version is rolled back
  (all traffic to the old one, the new one deregistered) when its τ falls below the old one's.

Decisions are JSON lines in ``<learn_dir>/decisions.jsonl``: ``{"time", "decision", ...figures}``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dflash.learn.defaults import MIN_DRAFTS

DECISIONS = "decisions.jsonl"


def log_decision(learn_dir: str | Path, decision: str, **figures) -> dict:
    """Append one decision (``figures`` JSON-able) to the learn dir's log; returns the line."""
    line = {"time": round(time.time(), 3), "decision": decision, **figures}
    with open(Path(learn_dir) / DECISIONS, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def decisions(learn_dir: str | Path) -> list[dict]:
    path = Path(learn_dir) / DECISIONS
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def next_version(version: str) -> str:
    """``"6"`` -> ``"7"``; a non-numeric version gains ``.1`` (``"6a"`` -> ``"6a.1"``)."""
    return str(int(version) + 1) if version.isdigit() else f"{version}.1"


def release(learner, *, force: bool = False) -> Path | None:
    """Gate the learner's candidate; when it passes (or ``force``, logged as such) write it as
    the next version and start the next candidate from scratch. A refused candidate that has
    finished its schedule (``max_steps``) is started afresh too; one refused mid-schedule keeps
    training. Returns the version's directory, or None when refused.

    Raises FileExistsError when that version was released already (a learner still based on
    the version before it: restart it with the released version as its serving drafter)."""
    cfg = learner.serving.cfg
    version = next_version(cfg.version)
    label = f"{cfg.name}@{version}"
    target = Path(learner.dir) / "versions" / label
    if target.exists():
        raise FileExistsError(f"{target}: {label} was released already; the learner's serving "
                              f"drafter is still {learner.base}")
    res = learner.evaluate()
    figures = dataclasses.asdict(res)
    figures.update(base=learner.base, step=learner.step)
    if not (res.release or force):
        # A candidate judged at the end of its schedule will not improve by standing still: the
        # next one starts from the serving version over the store as it is then, with a full
        # schedule of its own (docs/bench/learning-history/README.md, "Schedules end at the
        # gate").
        spent = learner.step >= learner.cfg.max_steps
        log_decision(learner.dir, "refused", **figures, afresh=spent)
        if spent:
            learner.reset()
        return None
    out = learner.save_candidate(target, version)
    log_decision(learner.dir, "released" if res.release else "forced", version=label,
                 path=str(out), **figures)
    learner.reset()
    return out


def register_canary(admin_stub, address: str, old: str, weight: float, learn_dir: str | Path):
    """Register the drafter serving the new version at ``address`` and give it ``weight`` of
    the traffic, ``old`` (``name@version``) the rest; returns the new entry's label.

    Raises ValueError naming ``weight`` outside (0, 1]; grpc.RpcError from the gateway."""
    from dflash.v1 import gateway_pb2

    if not 0 < weight <= 1:
        raise ValueError(f"weight: must be in (0, 1], got {weight}")
    e = admin_stub.RegisterDrafter(gateway_pb2.RegisterDrafterRequest(address=address))
    new = f"{e.name}@{e.version}"
    admin_stub.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(
        weights={old: 1.0 - weight, new: weight} if weight < 1 else {new: 1.0}))
    log_decision(learn_dir, "canary", version=new, old=old, address=address, weight=weight)
    return new


@dataclasses.dataclass(frozen=True)
class ServedTau:
    """Drafted steps and accepted drafts of one version over a window."""

    drafts: float
    accepted: float

    @property
    def tau(self) -> float:
        """1 + accepted / drafts (includes the bonus token); 0 without drafts."""
        return 1 + self.accepted / self.drafts if self.drafts else 0.0


def counters(metrics_text: str) -> dict[str, ServedTau]:
    """``drafter_version`` -> cumulative (drafts, accepted) from a verifier's /metrics text."""
    cols = {"dflash_spec_decode_num_drafts_total": 0, "dflash_spec_decode_num_accepted_tokens_total": 1}
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:        # by sample name: the family's name depends on the parser
            if s.name in cols:
                out.setdefault(s.labels.get("drafter_version", ""), [0.0, 0.0])[cols[s.name]] += s.value
    return {k: ServedTau(*v) for k, v in out.items()}


def window(before: str, after: str) -> dict[str, ServedTau]:
    """Per version, what happened between two scrapes."""
    a, b = counters(before), counters(after)
    zero = ServedTau(0.0, 0.0)
    return {k: ServedTau(v.drafts - a.get(k, zero).drafts, v.accepted - a.get(k, zero).accepted)
            for k, v in b.items()}


def rollback_check(win: dict[str, ServedTau], old: str, new: str, *, min_drafts: int = MIN_DRAFTS,
                   tolerance: float = 0.0) -> tuple[str, dict]:
    """("rollback" | "keep" | "wait", figures): rollback when both versions drafted at least
    ``min_drafts`` steps in the window and the new one's τ is below the old one's by more than
    ``tolerance`` (relative)."""
    zero = ServedTau(0.0, 0.0)
    o, n = win.get(old, zero), win.get(new, zero)
    figures = {"old": old, "new": new, "old_tau": round(o.tau, 4), "new_tau": round(n.tau, 4),
               "old_drafts": o.drafts, "new_drafts": n.drafts, "min_drafts": min_drafts,
               "tolerance": tolerance}
    if min(o.drafts, n.drafts) < min_drafts:
        return "wait", figures
    return ("rollback" if n.tau < o.tau * (1 - tolerance) else "keep"), figures


def rollback(admin_stub, old: str, new: str, learn_dir: str | Path, figures: dict | None = None) -> None:
    """All traffic back to ``old``, ``new`` deregistered; logged with ``figures`` (those of
    :func:`rollback_check`)."""
    from dflash.v1 import gateway_pb2

    admin_stub.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={old: 1.0}))
    admin_stub.DeregisterDrafter(gateway_pb2.DrafterRef(drafter=new))
    log_decision(learn_dir, "rollback", **dict(figures or {}, old=old, new=new))


def watch_canary(admin_stub, scrape, old: str, new: str, learn_dir: str | Path, *,
                 min_drafts: int = MIN_DRAFTS, tolerance: float = 0.0, poll_s: float = 5.0,
                 timeout_s: float = 3600.0) -> tuple[str, dict]:
    """Poll ``scrape()`` (the verifier's /metrics text) from now until both versions drafted
    ``min_drafts`` steps, then keep the new version or roll it back (:func:`rollback`);
    "wait" when ``timeout_s`` passes first. Every outcome is logged. Returns (decision, figures)."""
    before = scrape()
    deadline = time.monotonic() + timeout_s
    while True:
        decision, figures = rollback_check(window(before, scrape()), old, new,
                                           min_drafts=min_drafts, tolerance=tolerance)
        if decision != "wait" or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if decision == "rollback":
        rollback(admin_stub, old, new, learn_dir, figures)
    else:
        log_decision(learn_dir, "kept" if decision == "keep" else "undecided", **figures)
    return decision, figures
