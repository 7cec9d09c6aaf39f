"""Online learning's two guards, shown on a real captured store (docs/learning.md, Benchmark).

1. **Poisoned store, never released.** A copy of a learn dir's captured conversations with each
   answer's token ids shuffled within the conversation (taps unchanged: the labels no longer
   follow the context) trains a candidate from the serving version for ``--steps`` steps; the
   held-out gate (the poisoned store's own held-out slice, as a deployment would have it) must
   refuse it. The same candidate is also scored on the clean store's held-out slice (what it
   would do to real traffic).
2. **Automatic rollback under live traffic.** That candidate is released anyway
   (``release(force=True)``, logged "forced") and served as a canary (``--canary`` of the
   traffic) beside the serving version, through a gateway, by ``--clients`` closed-loop greedy
   clients on the learn bench's fresh prompts; ``watch_canary`` must roll it back once both
   versions drafted ``--min-drafts`` steps. Every stream is compared with speculation off
   (greedy: identical before, during and after the rollback).

Writes ``guards.json`` and ``guards.md`` to ``--out``; exit status 0 when both guards held.

    python scripts/bench_learn_guards.py --store-from /tmp/learn-bench --out docs/bench/learn-guards-<machine>
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def poison_copy(src: Path, dst: Path, seed: int = 0) -> int:
    """Copy ``src``'s conversations to ``dst`` with each answer's ids shuffled; returns how many."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n = 0
    for f in sorted(src.glob("conv_*.safetensors")):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata() or {}
            t = {k: h.get_tensor(k) for k in h.keys()}
        pos = torch.nonzero(t["loss_mask"].bool()).flatten().tolist()
        ids = t["input_ids"].clone()
        perm = pos[:]
        rng.shuffle(perm)
        ids[pos] = t["input_ids"][perm]
        t["input_ids"] = ids
        save_file(t, str(dst / f.name), metadata=meta)
        n += 1
    return n


def poisoned_gate(a) -> tuple[dict, Path]:
    """Train on the poisoned copy, gate it; force-release it for the rollback part."""
    from dflash.learn import release as rel
    from dflash.learn.learner import LearnConfig, Learner
    from dflash.learn.store import CaptureStore

    learn = Path(a.work) / "poison"
    shutil.rmtree(learn, ignore_errors=True)
    convs = poison_copy(Path(a.store_from) / "store", learn / "store")
    cfg = LearnConfig(max_steps=a.steps, lr=a.lr)
    lr = Learner(learn, a.drafter, a.target, cfg=cfg)
    t0 = time.time()
    lr.run(a.steps)
    train_s = time.time() - t0
    released = rel.release(lr)                      # the gate, on the poisoned held-out slice
    refused = rel.decisions(learn)[-1]
    clean = CaptureStore(Path(a.store_from) / "store", writer=False,
                         fingerprint=lr.serving.cfg.target_fingerprint)
    own_store, lr.store = lr.store, clean
    on_clean = lr.evaluate()                        # what it would do to real traffic
    lr.store = own_store
    forced = rel.release(lr, force=True)
    assert forced is not None
    res = {"conversations": convs, "steps": a.steps, "train_s": round(train_s, 1),
           "released_by_gate": released is not None,
           "gate": {k: refused.get(k) for k in ("decision", "tau_serving", "tau_candidate", "gain",
                                                "gain_lower", "wins", "conversations", "replay", "reason")},
           "on_clean_heldout": {"tau_serving": on_clean.tau_serving,
                                "tau_candidate": on_clean.tau_candidate, "gain": on_clean.gain},
           "forced_version": forced.name}
    return res, forced


def served_rollback(a, forced: Path) -> dict:
    """The forced version as a canary beside the serving one; watch_canary decides."""
    import grpc
    from bench_learn import domain_prompts
    from prometheus_client import generate_latest
    from transformers import AutoTokenizer

    from dflash.learn import release as rel
    from dflash.serving.telemetry import Telemetry
    from dflash.v1 import gateway_pb2, gateway_pb2_grpc
    from drafter_svc.engine import DrafterEngine
    from drafter_svc.server import build as build_drafter
    from gateway.server import build as build_gateway
    from gateway.upstream import register_drafter
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import build as build_verifier
    from verifier_svc.target import TargetModel

    learn = Path(a.work) / "poison"
    _, fresh = domain_prompts(ROOT, 1, a.fresh, max_chars=a.prompt_chars)
    tok = AutoTokenizer.from_pretrained(a.target)
    target = TargetModel(a.target)
    tel = Telemetry(service="verifier")
    engine = VerifierEngine(target, threads=a.threads, suffix=False)
    runtimes = [build_verifier(engine, "127.0.0.1:0", telemetry=tel)]
    runtimes[0].server.start()
    runtimes[0].set_serving(True)
    gw = build_gateway(tok, f"127.0.0.1:{runtimes[0].port}", "127.0.0.1:0",
                       max_positions=target.max_positions)
    gw.server.start()
    gw.set_serving(True)
    runtimes.append(gw)                             # its admin plane starts and stops with it

    def drafter(path) -> str:
        eng = DrafterEngine.from_pretrained(str(path), a.target, threads=a.threads)
        eng.warmup()
        rt = build_drafter(eng, "127.0.0.1:0")
        rt.server.start()
        rt.set_serving(True)
        runtimes.append(rt)
        return f"127.0.0.1:{rt.port}"

    channels = [grpc.insecure_channel(f"127.0.0.1:{gw.port}")]
    stub = gateway_pb2_grpc.GatewayStub(channels[0])
    channels.append(grpc.insecure_channel(f"127.0.0.1:{gw.admin.port}"))
    admin = gateway_pb2_grpc.GatewayAdminStub(channels[1])
    results: list = []
    errors: list = []
    stop = threading.Event()
    try:
        old = register_drafter(gw.servicer.registry, gw.servicer.verifier, drafter(a.drafter), default=True)
        old_label = f"{old.name}@{old.version}"

        def request(i: int, msgs, spec: bool, sid: str):
            req = gateway_pb2.GenerateRequest(
                chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in msgs]),
                max_tokens=a.max_tokens, speculation=spec, session_id=sid)
            resps = list(stub.Generate(req))
            return [x for r in resps for x in r.token_ids], resps[-1]

        refs = [request(i, m, False, f"ref{i}")[0] for i, m in enumerate(fresh)]
        new_addr = drafter(forced)

        def client(c: int):
            i = c
            while not stop.is_set():
                k = i % len(fresh)
                try:
                    t0 = time.monotonic()
                    ids, last = request(k, fresh[k], True, f"c{c}-{i}")
                    results.append({"start": t0, "prompt": k, "drafter": last.drafter,
                                    "identical": ids == refs[k]})
                except grpc.RpcError as e:
                    errors.append(repr(e))
                i += a.clients

        threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
        for th in threads:
            th.start()
        while len(results) < a.clients and not errors:        # traffic before the canary
            time.sleep(0.2)
        scrape = lambda: generate_latest(tel.registry).decode()   # noqa: E731
        new = rel.register_canary(admin, new_addr, old_label, a.canary, learn)
        canary_at = time.monotonic()
        decision, figures = rel.watch_canary(admin, scrape, old_label, new, learn,
                                             min_drafts=a.min_drafts, poll_s=1.0, timeout_s=a.timeout_s)
        decided_at = time.monotonic()
        n_after = len([r for r in results if r["start"] > decided_at])
        deadline = time.monotonic() + 300
        while n_after < a.clients and time.monotonic() < deadline and not errors:
            time.sleep(0.5)                                   # traffic after the decision
            n_after = len([r for r in results if r["start"] > decided_at])
        stop.set()
        for th in threads:
            th.join(600)
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        for rt in runtimes:
            rt.server.stop(0)
        engine.close()

    def phase(r):
        return "before" if r["start"] < canary_at else ("during" if r["start"] < decided_at else "after")

    by_phase: dict = {}
    for r in results:
        p = by_phase.setdefault(phase(r), {"requests": 0, "identical": 0, "drafters": {}})
        p["requests"] += 1
        p["identical"] += r["identical"]
        p["drafters"][r["drafter"]] = p["drafters"].get(r["drafter"], 0) + 1
    return {"decision": decision, "figures": figures, "old": old_label, "new": new,
            "canary_weight": a.canary, "seconds_to_decision": round(decided_at - canary_at, 1),
            "phases": by_phase, "errors": errors[:5],
            "decisions_logged": [d["decision"] for d in rel.decisions(learn)]}


def write(res: dict, out: Path) -> bool:
    g, r = res["poisoned"], res["rollback"]
    ok_gate = not g["released_by_gate"]
    ok_roll = r["decision"] == "rollback" and not r["errors"] and all(
        p["identical"] == p["requests"] for p in r["phases"].values())
    after = r["phases"].get("after", {}).get("drafters", {})
    lines = [
        "| guard | measured | held |", "|---|---|---|",
        f"| poisoned store ({g['conversations']} conversations, answers shuffled; {g['steps']} steps, "
        f"{g['train_s']} s) never released | gate: {g['gate']['decision']}, τ serving "
        f"{g['gate']['tau_serving']} vs candidate {g['gate']['tau_candidate']} (gain lower bound "
        f"{g['gate']['gain_lower']}); on the clean held-out slice τ {g['on_clean_heldout']['tau_serving']} "
        f"→ {g['on_clean_heldout']['tau_candidate']} | {'yes' if ok_gate else '**no**'} |",
        f"| forced release of it, canary {r['canary_weight']:.0%}, rolled back automatically | "
        f"{r['decision']} after {r['seconds_to_decision']} s: served τ {r['new']} "
        f"{r['figures'].get('new_tau')} vs {r['old']} {r['figures'].get('old_tau')}; after it: {after} | "
        f"{'yes' if ok_roll else '**no**'} |",
        "", "Streams identical to speculation off, by phase: " + ", ".join(
            f"{k} {v['identical']}/{v['requests']} ({v['drafters']})" for k, v in r["phases"].items()),
        f"Decisions logged: {r['decisions_logged']}.",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "guards.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "guards.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok_gate and ok_roll


def main(argv=None) -> int:
    from dflash.learn.defaults import MIN_DRAFTS
    from dflash.learn.learner import LearnConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store-from", required=True, help="a learn dir with a captured store (bench_learn's)")
    p.add_argument("--target", help="target directory (default: the converted SmolLM2)")
    p.add_argument("--drafter", default=str(ROOT / "models/smollm2-dflash-b16"), help="the serving version")
    p.add_argument("--out", required=True, help="guards.json / guards.md")
    p.add_argument("--work", default="/tmp/learn-guards",
                   help="the poisoned learn dir and the forced version (users' traffic: not in --out)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=LearnConfig.lr)
    p.add_argument("--fresh", type=int, default=24, help="fresh prompts the clients cycle through")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--canary", type=float, default=0.5)
    p.add_argument("--min-drafts", type=int, default=MIN_DRAFTS)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-chars", type=int, default=900, help="passage length cap (bench_learn's)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if not a.target:
        from dflash.train.target_setup import target_dir

        a.target = str(target_dir())
    out = Path(a.out)
    torch.set_num_threads(a.threads)
    poisoned, forced = poisoned_gate(a)
    print(json.dumps(poisoned), flush=True)
    res = {"poisoned": poisoned, "rollback": served_rollback(a, forced), "args": vars(a)}
    return 0 if write(res, out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
