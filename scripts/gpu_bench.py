#!/usr/bin/env python3
"""The measuring parts of scripts/gpu_check.sh: the step benchmark, the end-to-end benchmark
through the real services, and the report that joins them.

    python scripts/gpu_bench.py step   --target T --drafter D --device cuda --out step.json
    python scripts/gpu_bench.py e2e    --target T --drafter D --device cuda --out e2e.json
    python scripts/gpu_bench.py report --dir OUT            # OUT/results.json + OUT/report.md

``step`` (in this process, no gRPC): per batch size (``--batches``, default 1 8 32) with each
session holding ``--context`` cached positions, the median of ``--iters`` timed runs (the
device synchronised around each) of

* ``decode_ms``: one target forward of 1 token per session plus its verification (a step
  without speculation);
* ``verify16_ms``: one target forward of a block of 16 per session plus the greedy verification
  of its 15 drafts (a speculative step's target part);
* ``draft_ms``: one drafter call drafting a block of 16 per session, each with 16 new context rows;
* ``wire_ms``: what crosses the wire in such a step: the 16 new tap rows per session from the
  device through the pinned host buffer (``verifier_svc.tap_buffer``), into protobuf, serialised,
  parsed, back to tensors and onto the drafter's device, and the drafts' reply the same way
  (gRPC's own loopback transfer not included: the e2e figures include it).

``e2e``: starts ``python -m verifier_svc`` and ``python -m drafter_svc`` (the random-weight
drafter) on ``--device``, serves the oracle drafter (tests/doubles.py: it proposes the target's
own greedy continuation, so every draft is accepted: tau = 16) from this process, and sends
``--requests`` prompts of random token ids per concurrency level over gRPC on loopback with
speculation off, with the oracle, and with the random drafter. Reports tokens/s, tau, and
whether each run's tokens equal speculation off (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))     # the oracle test double


def _timed(fn, *, iters: int, device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after one warm-up, the device
    synchronised before and after each."""
    from dflash.core.device import synchronize

    fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --- step ---------------------------------------------------------------------------------------

def step(a) -> dict:
    import torch

    from dflash.core import wire
    from dflash.core.device import to_device
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from dflash.v1 import drafter_pb2
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.tap_buffer import TapRows
    from verifier_svc.target import TargetModel
    from verifier_svc.verification import RowParams, verify_batch

    t0 = time.perf_counter()
    target = TargetModel(a.target, device=a.device, dtype=a.dtype, skinny_max_rows=0)
    drafter = DrafterEngine.from_pretrained(a.drafter, a.target, device=a.device, dtype=a.dtype,
                                            skinny_max_rows=0, context_threads=0)
    load_s = time.perf_counter() - t0
    dev = target.device
    taps = tuple(drafter.card.target_layer_ids)
    block = drafter.cfg.block_size
    gen = torch.Generator().manual_seed(0)
    out = {"device": str(dev), "dtype": str(target.dtype).replace("torch.", ""),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "context": a.context, "block": block, "load_s": round(load_s, 1), "rows": []}

    def one(b: int) -> dict:
        """One batch size's row (its sessions' caches are freed when it returns)."""
        caches = [target.new_cache() for _ in range(b)]
        with target.lock:
            for c in caches:
                ids = torch.randint(0, target.vocab_size, (a.context,), generator=gen).tolist()
                target.forward(ids, c, taps, logits_to_keep=1)
        params = [RowParams(Sampling(), None, frozenset(), 1 << 20)] * b

        def forward_verify(q: int):
            blocks = [[1] * q] * b
            outs = target.forward_batch(blocks, caches, [taps] * b)
            verify_batch([torch.ones(q - 1, dtype=torch.int64)] * b, [lg for lg, _ in outs],
                         [None] * b, params)
            for c in caches:
                target.crop(c, a.context)
            return outs

        decode = _timed(lambda: forward_verify(1), iters=a.iters, device=dev)
        verify = _timed(lambda: forward_verify(block), iters=a.iters, device=dev)
        new_taps = [t[:block] for _, t in forward_verify(block)]     # [16, F] on the device
        host_rows = [t.cpu() for t in new_taps]
        drafter.propose([ProposalRequest(session_id=f"s{i}", context_start=0,
                                         context=torch.randn(a.context, drafter.cfg.context_size,
                                                             generator=gen).to(target.dtype),
                                         anchor_token=1, block_size=1, sampling=Sampling())
                         for i in range(b)])

        def draft():
            return drafter.propose([ProposalRequest(
                session_id=f"s{i}", context_start=a.context, context=host_rows[i],
                anchor_token=1, block_size=block, sampling=Sampling()) for i in range(b)])

        draft_ms = _timed(draft, iters=a.iters, device=dev)
        proposals = draft()

        def wire_step():
            items = []
            for i, t in enumerate(new_taps):
                rows = TapRows()
                rows.append(t)
                items.append(drafter_pb2.DraftItem(session_id=f"s{i}", context_start=a.context,
                                                   context=wire.to_proto(rows.rows(0)),
                                                   anchor_token=1, block_size=block))
            got = drafter_pb2.DraftBatch.FromString(
                drafter_pb2.DraftBatch(batch_id=1, items=items).SerializeToString())
            [to_device(wire.from_proto(it.context), dev) for it in got.items]
            reply = drafter_pb2.DraftBatchResult(batch_id=1, results=[
                drafter_pb2.DraftResult(session_id=f"s{i}", tokens=p.tokens.tolist())
                for i, p in enumerate(proposals)])
            back = drafter_pb2.DraftBatchResult.FromString(reply.SerializeToString())
            [torch.tensor(list(r.tokens), dtype=torch.int64) for r in back.results]
            return len(got.items[0].context.data)

        wire_ms = _timed(wire_step, iters=a.iters, device=dev)
        drafter.release([f"s{i}" for i in range(b)])
        row = {"batch": b, "decode_ms": round(decode, 3), "verify16_ms": round(verify, 3),
               "draft_ms": round(draft_ms, 3), "wire_ms": round(wire_ms, 3),
               "verify16_over_decode": round(verify / decode, 3),
               "wire_share_of_step": round(wire_ms / (verify + draft_ms + wire_ms), 4),
               "wire_bytes_per_session": wire_step()}
        return row
    for b in a.batches:
        row = one(b)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


# --- e2e ----------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _generate(stub, prompt, n, *, session="", addr="", block=0):
    from dflash.v1 import common_pb2, verifier_pb2

    spec = (verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, block_size=block,
                                           mode="fixed") if addr else None)
    req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=prompt, max_tokens=n,
                                               ignore_eos=True, session_id=session,
                                               sampling=common_pb2.SamplingParams(),
                                               speculation=spec)
    t0 = time.perf_counter()
    ids, first, last = [], None, None
    for chunk in stub.Generate(req, timeout=600):
        if first is None:
            first = time.perf_counter()
        ids += list(chunk.token_ids)
        last = chunk
    end = time.perf_counter()
    st = last.stats
    return {"ids": ids, "ttft_s": first - t0, "latency_s": end - t0,
            "decode_tok_s": (len(ids) - 1) / max(end - first, 1e-9),
            "drafts": st.drafts, "accepted": st.accepted_tokens}


def _run_level(stub, prompts, n, c, **kw) -> dict:
    """``c`` requests at once (one per prompt of the first ``c``): wall-clock tokens/s."""
    rows = [None] * c
    keys = kw.pop("sessions", None)

    def one(i):
        rows[i] = _generate(stub, prompts[i], n, session=keys[i] if keys else "", **kw)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(r["ids"]) for r in rows)
    drafts = sum(r["drafts"] for r in rows)
    return {"concurrency": c, "tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1),
            "decode_tok_s_per_request": round(statistics.median(r["decode_tok_s"] for r in rows), 1),
            "tau": round(1 + sum(r["accepted"] for r in rows) / drafts, 3) if drafts else None,
            "ids": [r["ids"] for r in rows]}


def e2e(a) -> dict:
    import grpc
    import torch

    from dflash.serving.server import wait_healthy
    from dflash.v1 import verifier_pb2_grpc
    from drafter_svc.server import build as build_drafter

    from doubles import ReferenceDrafter

    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    vport, dport = _free_port(), _free_port()
    common = ["--device", a.device, "--dtype", a.dtype, "--batch-invariant", a.batch_invariant]
    verifier = _start(["-m", "verifier_svc", "--target", a.target, "--bind", f"127.0.0.1:{vport}",
                       "--allow-unregistered-drafters", "--spec-mode", "fixed",
                       "--draft-timeout", "30", "--prefill-chunk", "1024",
                       "--max-batch", "64", *common, *a.verifier_args], logs / "verifier.log")
    drafter = _start(["-m", "drafter_svc", "--drafter", a.drafter, "--target", a.target,
                      "--bind", f"127.0.0.1:{dport}", *common], logs / "drafter.log")
    cfg = json.loads((Path(a.target) / "config.json").read_text())
    refs: dict[str, list[int]] = {}
    shape = type("Shape", (), {"vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"]})
    oracle = ReferenceDrafter(shape, refs, block_size=a.block)
    ort = build_drafter(oracle, "127.0.0.1:0")
    ort.server.start()
    ort.set_serving(True)
    oracle_addr = f"127.0.0.1:{ort.port}"
    out = {"device": a.device, "dtype": a.dtype, "prompt_len": a.prompt_len,
           "max_tokens": a.max_tokens, "block": a.block, "batch_invariant": a.batch_invariant,
           "levels": {}}
    try:
        t0 = time.perf_counter()
        for name, p, addr in (("verifier", verifier, f"127.0.0.1:{vport}"),
                              ("drafter", drafter, f"127.0.0.1:{dport}")):
            if not wait_healthy(addr, a.start_timeout):
                raise SystemExit(f"{name} not SERVING within {a.start_timeout}s "
                                 f"(exit {p.poll()}); see {logs / (name + '.log')}")
        out["start_s"] = round(time.perf_counter() - t0, 1)
        gen = torch.Generator().manual_seed(1)
        top = max(a.concurrency)
        prompts = [torch.randint(0, cfg["vocab_size"], (a.prompt_len,), generator=gen).tolist()
                   for _ in range(top)]
        ch = grpc.insecure_channel(f"127.0.0.1:{vport}")
        stub = verifier_pb2_grpc.VerifierStub(ch)
        _generate(stub, prompts[0], 8)                                  # warm-up
        for c in a.concurrency:
            off = _run_level(stub, prompts, a.max_tokens, c)
            keys = [f"oracle-c{c}-{i}" for i in range(c)]
            refs.update({k: prompts[i] + off["ids"][i] for i, k in enumerate(keys)})
            _generate(stub, prompts[0], 2 * a.block, session="warm-o", addr=oracle_addr)
            orc = _run_level(stub, prompts, a.max_tokens, c, addr=oracle_addr, block=a.block,
                             sessions=keys)
            _generate(stub, prompts[0], 2 * a.block, addr=f"127.0.0.1:{dport}")
            rnd = _run_level(stub, prompts, a.max_tokens, c, addr=f"127.0.0.1:{dport}",
                             block=a.block)
            level = {}
            for name, r in (("off", off), ("oracle", orc), ("random", rnd)):
                r["same_as_off"] = r.pop("ids") == off["ids"] if name != "off" else True
                level[name] = r
            off.pop("ids", None)
            level["oracle_speedup"] = round(orc["tok_s"] / off["tok_s"], 2)
            level["random_speedup"] = round(rnd["tok_s"] / off["tok_s"], 2)
            out["levels"][str(c)] = level
            print(json.dumps({"concurrency": c, **{k: (v if not isinstance(v, dict) else
                                                        {x: v[x] for x in ("tok_s", "tau", "same_as_off")})
                                                    for k, v in level.items()}}), flush=True)
        ch.close()
    finally:
        ort.server.stop(0)
        for p in (verifier, drafter):
            p.terminate()
        for p in (verifier, drafter):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return out


# --- report -------------------------------------------------------------------------------------

TARGETS = [
    ("verify of 16 <= 1.3x a one-token decode step (batch 1)", "verify16_over_decode", 1.3, "<="),
    ("wire + (de)serialisation <= 3% of a step (batch 1)", "wire_share_of_step", 0.03, "<="),
    ("oracle drafter >= 6x speculation-off tokens/s (batch 1)", "oracle_speedup", 6.0, ">="),
]


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _kernel_rows(md: str) -> list[dict]:
    rows = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in ("greedy", "rejection", "pack"):
            rows.append(dict(zip(("op", "batch", "vocab", "reference_us", "triton_us",
                                  "speedup", "exact"), cells)))
    return rows


def report(a) -> int:
    d = Path(a.dir)
    res = {"meta": _load(d / "meta.json") or {}, "realsize": _load(d / "realsize.json"),
           "step": _load(d / "step.json"), "e2e": _load(d / "e2e.json"),
           "e2e_invariant": _load(d / "e2e_invariant.json"),
           "kernels": _kernel_rows((d / "kernels.md").read_text())
           if (d / "kernels.md").is_file() else None,
           "pytest_gpu": (d / "pytest_gpu.txt").read_text().strip().splitlines()[-1:]
           if (d / "pytest_gpu.txt").is_file() else None}
    checks = []
    b1 = next((r for r in (res["step"] or {}).get("rows", []) if r["batch"] == 1), None)
    lvl1 = ((res["e2e"] or {}).get("levels") or {}).get("1")
    values = {"verify16_over_decode": b1 and b1["verify16_over_decode"],
              "wire_share_of_step": b1 and b1["wire_share_of_step"],
              "oracle_speedup": lvl1 and lvl1["oracle_speedup"]}
    for label, key, bound, op in TARGETS:
        v = values[key]
        ok = None if v is None else (v <= bound if op == "<=" else v >= bound)
        checks.append({"target": label, "value": v, "met": ok})
    inv1 = ((res["e2e_invariant"] or {}).get("levels") or {}).get("1")
    block = (res["e2e_invariant"] or {}).get("block")
    checks.append({"target": "batch-invariant bf16: oracle tau = block size, every output "
                             "identical to off (batch 1)",
                   "value": inv1 and f"tau {inv1['oracle']['tau']} (default kernels: "
                            f"{lvl1 and lvl1['oracle']['tau']}), identical "
                            f"{inv1['oracle']['same_as_off'] and inv1['random']['same_as_off']}",
                   "met": None if not inv1 else (inv1["oracle"]["tau"] == block
                                                 and inv1["oracle"]["same_as_off"]
                                                 and inv1["random"]["same_as_off"])})
    k32 = [r for r in res["kernels"] or [] if r["batch"] == "32" and r["op"] != "pack"]
    if k32:
        checks.append({"target": "Triton kernels faster than torch at batch 32, bit-exact",
                       "value": ", ".join(f"{r['op']} {r['speedup']} exact {r['exact']}"
                                          for r in k32),
                       "met": all(r["exact"] == "yes" and float(r["speedup"].rstrip("x")) > 1
                                  for r in k32)})
    res["targets"] = checks
    (d / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (d / "report.md").write_text(_markdown(res))
    print(_markdown(res))
    return 0


def _markdown(res: dict) -> str:
    meta = res["meta"]
    lines = [f"# GPU check: {meta.get('gpu', '?')} ({meta.get('mode', '?')})", "",
             f"torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}, "
             f"triton {meta.get('triton', '?')}; {meta.get('date', '')}; stages "
             f"{meta.get('stages', '')}", "", "## Targets", "",
             "| target | measured | met |", "|---|---|:---:|"]
    for c in res["targets"]:
        met = {True: "yes", False: "NO", None: "not measured"}[c["met"]]
        lines.append(f"| {c['target']} | {c['value']} | {met} |")
    if res["step"]:
        s = res["step"]
        lines += ["", f"## Step ({s['device']}, {s['dtype']}, {s['context']} cached positions per "
                      f"session, block {s['block']}; medians, ms)", "",
                  "| batch | decode | verify of 16 | verify / decode | drafter call | wire | "
                  "wire share |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            lines.append(f"| {r['batch']} | {r['decode_ms']} | {r['verify16_ms']} | "
                         f"{r['verify16_over_decode']} | {r['draft_ms']} | {r['wire_ms']} | "
                         f"{100 * r['wire_share_of_step']:.2f}% |")
    for key, kernels in (("e2e", "default kernels"), ("e2e_invariant", "batch-invariant kernels")):
        if not res.get(key):
            continue
        e = res[key]
        lines += ["", f"## End to end, {kernels} (gRPC on loopback; prompts of {e['prompt_len']} "
                      f"random ids, {e['max_tokens']} new tokens, greedy, block {e['block']})", "",
                  "| concurrency | drafter | tokens/s | per-request decode tok/s | tau | "
                  "speedup | same tokens as off |", "|---:|---|---:|---:|---:|---:|:---:|"]
        for c, lvl in e["levels"].items():
            for name in ("off", "oracle", "random"):
                r = lvl[name]
                sp = {"off": "1.00", "oracle": lvl["oracle_speedup"],
                      "random": lvl["random_speedup"]}[name]
                lines.append(f"| {c} | {name} | {r['tok_s']} | {r['decode_tok_s_per_request']} | "
                             f"{r['tau'] or '-'} | {sp} | {'yes' if r['same_as_off'] else 'NO'} |")
    if res["kernels"]:
        lines += ["", "## Triton kernels vs torch references", "",
                  "| op | batch | vocab | reference (us) | triton (us) | speedup | exact |",
                  "|---|---:|---:|---:|---:|---:|:---:|"]
        lines += [f"| {r['op']} | {r['batch']} | {r['vocab']} | {r['reference_us']} | "
                  f"{r['triton_us']} | {r['speedup']} | {r['exact']} |" for r in res["kernels"]]
    if res["pytest_gpu"]:
        lines += ["", f"## pytest -m gpu: {res['pytest_gpu'][0]}"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    from dflash.core.device import device_flag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("step", "e2e"):
        s = sub.add_parser(name)
        s.add_argument("--target", required=True)
        s.add_argument("--drafter", required=True)
        s.add_argument("--device", type=device_flag, default="auto")
        s.add_argument("--dtype", default="bfloat16")
        s.add_argument("--out", required=True)
    st = sub.choices["step"]
    st.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    st.add_argument("--context", type=int, default=512)
    st.add_argument("--iters", type=int, default=10)
    e = sub.choices["e2e"]
    e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    e.add_argument("--prompt-len", type=int, default=256)
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--block", type=int, default=16)
    e.add_argument("--start-timeout", type=float, default=240)
    e.add_argument("--logs", default="gpu_out/logs")
    e.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="off",
                   help="the services' --batch-invariant (kernels/invariant.py)")
    e.add_argument("--verifier-args", nargs=argparse.REMAINDER, default=[],
                   help="extra verifier flags (last), e.g. --cuda-graphs")
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cmd == "report":
        return report(a)
    result = step(a) if a.cmd == "step" else e2e(a)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
