#!/usr/bin/env python3
"""What the prefix cache costs where it cannot help: issue 61's unique-prompt and memory
targets, measured in one run (docs/prefix-cache.md, "Measuring the overhead").

1. **unique prompts**: one stack (``dflash_app.launcher.LocalStack``, ``verifiers=2``: each
   replica its own verifier and drafter, half the cores each) whose replica 0 keeps the cache
   on and replica 1 runs ``--prefix-cache off``, and two more gateways, each knowing one
   replica: the arms ``on`` and ``off``. Per round and ``--concurrency`` level, all prompts
   (``--prompts``, the first ``--limit``, greedy, ``--max-tokens``, speculation ``--mode``) go
   through one arm by ``c`` closed-loop clients, then through the other, the order rotated;
   never both at once. Every request is its own tenant (``--shared-tenant``: one per arm and
   round, so the chat template's prefix is reused), so the cache never hits and the figure is
   its pure cost: the lookup and keeping each finished request. Per arm and level: tokens/s
   (completion tokens / wall second of the round; median over ``--rounds``), on / off (target
   >= 0.98), greedy outputs equal between the arms, τ.
2. **τ per turn** with the cache in fixed mode is ``dflash bench --workload multiturn
   --spec-modes fixed`` (command in the report), not run here.
3. **memory**: one verifier (all the cores) with ``--prefix-cache-mb`` small, ``--requests``
   requests of random token ids (lengths ``--min-len``..``--max-len``, ``--tenants`` tenants,
   ``--reuse`` of them starting with a piece of an earlier prompt of their tenant),
   ``max_tokens`` 1, sent to the verifier's gRPC port by ``--clients`` clients (the gateway
   takes text only). Every ``--sample-every`` requests: the verifier's RSS (psutil) and its
   cache gauges (/metrics). Targets: RSS (and its high-water mark) under the printed bound
   (RSS at start + the batch KV pool's bound + ``--prefix-cache-mb`` + ``--slack-mb``), the
   cache's bytes never above ``--prefix-cache-mb``, 0 failed requests.

Output: ``overhead.json`` and ``overhead.md`` in ``--out``; progress on stderr.

    python scripts/bench_prefix_overhead.py --out docs/bench/prefix-overhead-<tag>    # SmolLM2
    python scripts/bench_prefix_overhead.py --tiny --out /tmp/overhead                # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_app import bench_overhead as report  # noqa: E402
from dflash_app.bench import split_mode  # noqa: E402
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig, cores, free_run  # noqa: E402
from gateway.inputs import CLIENT_KEY  # noqa: E402

ARMS = ("on", "off")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def common_verifier_args(a) -> list[str]:
    return ["--batch-invariant", a.batch_invariant] if a.batch_invariant else []


# ---- 1. unique prompts ---------------------------------------------------------------------


def start_arms(a, run_dir: Path) -> tuple[LocalStack, dict[str, str]]:
    """The two-replica stack and one gateway per arm (module docstring). Raises LaunchError."""
    base = free_run(10)             # replica r's verifier at base + r, its drafter at base + 2 + r
    order = [1, 0] if a.swap_replicas else [0, 1]     # replica of arm ARMS[i]: order[i]
    args = [["--prefix-cache", "on"], ["--prefix-cache", "off"]]
    cfg = StackConfig(target=a.target, drafters=[DrafterSpec(path=a.drafter, port=base + 2)],
                      verifier_port=base, gateway_port=base + 4, admin_port=base + 5, verifiers=2,
                      verifier_args=common_verifier_args(a),
                      verifier_args_per_replica=[args[order.index(r)] for r in range(2)],
                      run_dir=str(run_dir / "arms"), health_timeout_s=900)
    stack = LocalStack(cfg)
    log(f"unique prompts: starting 2 drafters, 2 verifiers, 3 gateways (logs in {cfg.run_dir}) ...")
    stack.start()
    try:
        gws = {arm: stack.add_gateway(f"gateway-{arm}", base + 6 + 2 * i, base + 7 + 2 * i,
                                      verifiers=[stack.verifier_addrs[order[i]]])
               for i, arm in enumerate(ARMS)}
    except BaseException:
        stack.stop()
        raise
    return stack, gws


def gateway_request(client, messages: list[dict], *, tenant: str, a) -> dict:
    """One greedy request as ``tenant`` on ``client`` (a connected GatewayClient); an error is
    recorded in the row, never raised."""
    import grpc

    from dflash.client import build_request
    from dflash.client._common import Collector

    mode, budget = split_mode(a.mode)
    req = build_request(messages=messages, max_tokens=a.max_tokens, speculation_mode=mode,
                        tree_budget=budget)
    col = Collector()
    try:
        for r in client.stub.Generate(req, timeout=1800, metadata=[(CLIENT_KEY, tenant)]):
            col.add(r)
    except grpc.RpcError as e:
        return {"ids": [], "tokens": 0, "cached": 0, "drafts": 0, "accepted": 0,
                "error": f"{e.code().name}: {e.details()}"[:300]}
    c = col.completions()[0]
    return {"ids": c.token_ids, "tokens": c.usage.completion_tokens,
            "cached": c.usage.cached_prompt_tokens, "drafts": c.acceptance.drafts,
            "accepted": c.acceptance.accepted_tokens, "error": ""}


def run_round(addr: str, prompts, clients: int, tenant, a) -> dict:
    """Every prompt once through ``addr`` by ``clients`` closed-loop clients (connected before
    the clock starts); ``tenant(i)`` names prompt i's tenant. Rows in prompt order."""
    from dflash.client import GatewayClient

    conns = [GatewayClient(addr) for _ in range(min(clients, len(prompts)))]
    rows: list[dict] = [{}] * len(prompts)
    nxt, lock = iter(range(len(prompts))), threading.Lock()

    def work(client) -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            rows[i] = gateway_request(client, prompts[i][1], tenant=tenant(i), a=a)

    try:
        for c in conns:
            c.wait_ready(60)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(conns)) as pool:
            list(pool.map(work, conns))
        wall = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    return {"wall_s": wall, "rows": rows}


def measure_throughput(gws: dict[str, str], prompts, a) -> dict:
    """``{level: {arm: [round, ...]}}`` (:func:`run_round`), arms alternating (module docstring);
    ``--warmup`` prompts through each arm first, not counted."""
    run = uuid.uuid4().hex[:8]
    for arm in ARMS if a.warmup else ():
        run_round(gws[arm], prompts[:a.warmup], 1, lambda i, arm=arm: f"ovh-{run}-warm-{arm}-{i}", a)
    levels = [int(c) for c in a.concurrency.split(",")]
    out: dict[str, dict[str, list[dict]]] = {str(c): {arm: [] for arm in ARMS} for c in levels}
    for r in range(a.rounds):
        for k, c in enumerate(levels):
            order = ARMS if (r + k) % 2 == 0 else ARMS[::-1]
            for arm in order:
                def tenant(i: int, arm=arm, r=r, c=c) -> str:
                    return f"ovh-{run}-{arm}-r{r}-c{c}" + ("" if a.shared_tenant else f"-{i}")
                res = run_round(gws[arm], prompts, c, tenant, a)
                out[str(c)][arm].append(res)
                tok = sum(x["tokens"] for x in res["rows"])
                log(f"unique prompts: round {r + 1}/{a.rounds}, {c} clients, {arm}: "
                    f"{tok / res['wall_s']:.2f} tok/s")
    return out


# ---- 3. memory -----------------------------------------------------------------------------


def start_memory(a, run_dir: Path) -> tuple[LocalStack, str]:
    """One verifier with its drafter (and the stack's gateway, unused); returns the stack and
    the verifier's /metrics address. Raises LaunchError."""
    base = free_run(5)
    cfg = StackConfig(target=a.target, drafters=[DrafterSpec(path=a.drafter, port=base + 1)],
                      verifier_port=base, gateway_port=base + 2, admin_port=base + 3,
                      metrics_ports={"verifier": base + 4}, run_dir=str(run_dir / "memory"),
                      verifier_args=[*common_verifier_args(a), "--prefix-cache", "on",
                                     "--prefix-cache-mb", f"{a.prefix_cache_mb:g}"],
                      health_timeout_s=900)
    log(f"memory: starting a drafter, a verifier, a gateway (logs in {cfg.run_dir}) ...")
    return LocalStack(cfg).start(), f"127.0.0.1:{base + 4}"


def verifier_request(stub, ids: list[int], *, tenant: str, drafter: str, mode: str) -> tuple[str, int]:
    """One ``max_tokens`` 1 request straight to the verifier: (error or "", cached tokens)."""
    import grpc

    from dflash.v1 import common_pb2, verifier_pb2

    spec_mode, budget = split_mode(mode)
    req = verifier_pb2.VerifierGenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, max_tokens=1, tenant=tenant,
        sampling=common_pb2.SamplingParams(),
        speculation=verifier_pb2.SpeculationParams(enabled=True, drafter_address=drafter,
                                                   mode=spec_mode, tree_budget=budget))
    try:
        chunks = list(stub.Generate(req, timeout=600))
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"[:300], 0
    return "", chunks[-1].cached_prompt_tokens if chunks else 0


def sample(proc, metrics: str, done: int, drafter=None) -> dict:
    """RSS of the verifier (and of its drafter, for the record) and the cache gauges now."""
    return {"requests": done, "rss": proc.memory_info().rss, **report.scrape(metrics),
            "drafter_rss": drafter.memory_info().rss if drafter is not None else None}


def run_memory(stack: LocalStack, metrics: str, prompts, a) -> dict:
    """``prompts`` (tenant index, ids) through ``--clients`` clients straight to the verifier,
    a sample every ``--sample-every`` requests (and before the first)."""
    import grpc
    import psutil

    from dflash.v1 import verifier_pb2_grpc

    proc = psutil.Process(stack.procs[stack.verifier_name()].pid)
    drafter = psutil.Process(stack.procs[stack.drafter_name()].pid)
    run = uuid.uuid4().hex[:8]
    samples = [sample(proc, metrics, 0, drafter)]
    errors: list[str] = []
    hits = [0, 0]
    nxt, lock, done = iter(range(len(prompts))), threading.Lock(), [0]

    def work(_: int) -> None:
        channel = grpc.insecure_channel(stack.verifier_addr)
        stub = verifier_pb2_grpc.VerifierStub(channel)
        try:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                t, ids = prompts[i]
                err, cached = verifier_request(stub, ids, tenant=f"mem-{run}-{t}",
                                               drafter=stack.drafter_addr(), mode=a.mode)
                with lock:
                    done[0] += 1
                    n = done[0]
                    errors.extend([err] if err else [])
                    hits[0] += cached > 0
                    hits[1] += cached
                    if n % a.sample_every == 0 or n == len(prompts):
                        samples.append(sample(proc, metrics, n, drafter))
                        log(f"memory: {n}/{len(prompts)} requests, RSS {samples[-1]['rss'] / 2**20:.0f} MiB, "
                            f"cache {samples[-1]['bytes'] / 2**20:.1f} MiB")
        finally:
            channel.close()

    with ThreadPoolExecutor(a.clients) as pool:
        list(pool.map(work, range(a.clients)))
    return {"samples": samples, "failed": len(errors), "errors": errors[:5],
            "hit_requests": hits[0], "hit_tokens": hits[1], "peak_rss": report.peak_rss(proc.pid)}


def measure_memory(a, run_dir: Path) -> dict:
    """Part 3 (module docstring) on a stack of its own: the raw figures and their summary."""
    import grpc
    import psutil

    from dflash.v1 import verifier_pb2, verifier_pb2_grpc

    stack, metrics = start_memory(a, run_dir)
    try:
        with grpc.insecure_channel(stack.verifier_addr) as ch:
            card = verifier_pb2_grpc.VerifierStub(ch).Describe(verifier_pb2.DescribeTargetRequest(),
                                                               timeout=60)
        hi = min(a.max_len, card.max_position_embeddings - 1)
        prompts = report.memory_prompts(a.requests, vocab=card.vocab_size, lo=min(a.min_len, hi), hi=hi,
                                        tenants=a.tenants, reuse=a.reuse, seed=a.seed)
        pid = stack.procs[stack.verifier_name()].pid
        kv = report.kv_bytes_per_token(a.target, card.dtype)
        bound = report.memory_bound(start_rss=psutil.Process(pid).memory_info().rss,
                                    kv_per_token=kv, clients=a.clients, positions=hi + 1,
                                    cache_mb=a.prefix_cache_mb, slack_mb=a.slack_mb)
        log("memory: RSS bound " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in bound.items()
                                             if k not in ("pool_rows", "pool_capacity")))
        report.peak_rss(pid, reset=True)
        raw = run_memory(stack, metrics, prompts, a)
    finally:
        stack.stop()
    raw.update(bound=bound, kv_bytes_per_token=kv, requests=a.requests, min_len=min(a.min_len, hi),
               max_len=hi, tenants=a.tenants, reuse=a.reuse, clients=a.clients,
               sample_every=a.sample_every, prefix_cache_mb=a.prefix_cache_mb, dtype=card.dtype)
    out = report.memory_summary(raw, a.prefix_cache_mb)
    log(f"memory: checks {out['checks']}")
    return out


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dflash.core.speculation import MODES, SpecMode
    from dflash.serving.argtypes import at_least, int_list, positive_float

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for overhead.json / overhead.md")
    p.add_argument("--target", help="target model dir (default: SmolLM2-135M-Instruct, set up on demand)")
    p.add_argument("--drafter", help="drafter dir (default: models/smollm2-dflash-b16)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight models, small counts (a smoke run)")
    p.add_argument("--phases", default="throughput,memory", choices=("throughput,memory", "throughput", "memory"))
    p.add_argument("--mode", default="fixed", help="speculation mode of every request (fixed, adaptive, tree:8 ...)")
    p.add_argument("--batch-invariant", choices=("auto", "on", "off"), help="the verifiers' --batch-invariant")
    p.add_argument("--run-dir", help="service logs (default: a temp dir)")
    g = p.add_argument_group("unique prompts")
    g.add_argument("--prompts", default="humaneval", help="prompt set: humaneval, chat or a JSONL file")
    g.add_argument("--limit", type=at_least(1), help="prompts from the set (20; --tiny 4)")
    g.add_argument("--max-tokens", type=at_least(1), help="completion tokens per request (128; --tiny 16)")
    g.add_argument("--concurrency", type=int_list(1), help="client counts (1,8; --tiny 1,4)")
    g.add_argument("--rounds", type=at_least(1), help="rounds, each arm once per level in each (3; --tiny 2)")
    g.add_argument("--warmup", type=at_least(0), default=2, help="prompts through each arm first, not counted")
    g.add_argument("--shared-tenant", action="store_true",
                   help="one tenant per arm and round (the chat template's prefix is reused) "
                        "instead of one per request (the cache never hits)")
    g.add_argument("--swap-replicas", action="store_true",
                   help="cache on in replica 1, off in replica 0 (a control: a ratio that moves "
                        "with the swap is the replicas', not the cache's)")
    g = p.add_argument_group("memory")
    g.add_argument("--requests", type=at_least(1), help="requests (10000; --tiny 200)")
    g.add_argument("--min-len", type=at_least(1), default=32, help="shortest prompt, tokens")
    g.add_argument("--max-len", type=at_least(1), default=512, help="longest prompt, tokens")
    g.add_argument("--tenants", type=at_least(1), default=4)
    g.add_argument("--reuse", type=float, default=0.25,
                   help="share of requests starting with a piece of an earlier prompt of their tenant")
    g.add_argument("--clients", type=at_least(1), help="concurrent clients (4; --tiny 2)")
    g.add_argument("--sample-every", type=at_least(1), help="requests between samples (100; --tiny 20)")
    g.add_argument("--prefix-cache-mb", type=positive_float, help="the verifier's (64; --tiny 2)")
    g.add_argument("--slack-mb", type=positive_float, default=256.0,
                   help="the RSS bound's allowance for activations, taps and the allocator")
    g.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for k, full, tiny in (("limit", 20, 4), ("max_tokens", 128, 16), ("concurrency", "1,8", "1,4"),
                          ("rounds", 3, 2), ("requests", 10000, 200), ("clients", 4, 2),
                          ("sample_every", 100, 20), ("prefix_cache_mb", 64.0, 2.0)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    mode = a.mode.partition(":")[0]
    if mode not in MODES or mode == SpecMode.OFF:
        p.error(f"--mode: one of {', '.join(m for m in MODES if m != SpecMode.OFF)}, got {a.mode!r}")
    if not 0 <= a.reuse <= 1:
        p.error(f"--reuse: must be in [0, 1], got {a.reuse}")
    if a.min_len > a.max_len:
        p.error(f"--min-len {a.min_len} is above --max-len {a.max_len}")
    return a


def config(a, t0: float, run_dir: Path) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"target": a.target, "drafter": a.drafter, "tiny": a.tiny, "mode": a.mode,
            "prompts": a.prompts, "limit": a.limit, "max_tokens": a.max_tokens,
            "concurrency": a.concurrency, "rounds": a.rounds, "warmup": a.warmup,
            "shared_tenant": a.shared_tenant, "swap_replicas": a.swap_replicas,
            "batch_invariant": a.batch_invariant or "verifier default",
            "cores": cores(), "threads_per_replica": max(1, cores() // 2), "commit": commit,
            "machine": platform.processor() or platform.machine(), "run_dir": str(run_dir),
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from dflash_app.bench_prompts import prompt_set
    from dflash_app.stack import DEFAULT_DRAFTER, tiny_models

    if a.tiny and not a.target:
        a.target, a.drafter = tiny_models()
    if not a.target:
        from dflash.train.target_setup import setup_target
        a.target = str(setup_target())
    a.target, a.drafter = (str(Path(x).resolve()) for x in (a.target, a.drafter or DEFAULT_DRAFTER))
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="bench-overhead-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res: dict = {}
    if "throughput" in a.phases:
        prompts = prompt_set(a.prompts, a.limit)
        stack, gws = start_arms(a, run_dir)
        try:
            res["throughput"] = report.throughput_summary(measure_throughput(gws, prompts, a))
        finally:
            stack.stop()
    if "memory" in a.phases:
        res["memory"] = measure_memory(a, run_dir)
    res["config"] = config(a, t0, run_dir)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(res, indent=1) + "\n")
    md = report.markdown(res)
    (out / "overhead.md").write_text(md)
    print(md)
    log(f"wrote {out}/overhead.json, overhead.md in {res['config']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
