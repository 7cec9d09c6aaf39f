#!/usr/bin/env python3
"""Two verifier replicas behind one gateway, on one machine: issue 64's routing, failover and
drain targets, measured in one run (docs/running.md, "Several verifiers").

One stack (``dflash_app.launcher.LocalStack``, ``verifiers=2``: each replica its own verifier
and drafter, half the cores each) behind the gateway (``--routing score``, given a
``--verifiers-file`` too so a replica can be drained), plus, for the routing comparison, two
more gateways on the same verifiers: ``--routing round-robin``, and one that knows replica 0
only. Then, in this order:

1. **routing**: bench_prefix's multi-turn workload (``--conversations`` conversations of
   ``--turns`` turns, each resending its history; its ``cache`` arm: one tenant per
   conversation, no ``session_id``) through each of the three gateways in turn, each with its
   own tenants. Per turn, the cached share of the prompt (cached / prompt tokens, mean over the
   conversations); over the run, cached prompt tokens of two replicas / one replica, with the
   score (target >= 0.9) and round-robin; the requests each replica got; greedy outputs equal
   to the one replica's. With N conversations taking turns in order, round-robin sends a
   conversation to the same replica every turn when N is even (sticky by accident), to the
   other one every turn when N is odd: the default is odd.
2. **drain**: ``--streams`` clients in a closed loop (requests back to back) through the score
   gateway; once ``--streams`` requests have finished, replica 1 is marked ``drain`` in the
   file, and the clients go on until ``--drain-rounds`` x ``--streams`` requests have started
   after one health period. Failed requests (target 0); requests routed to replica 1 later
   than one health period after the mark (target 0): the period is the gateway's re-read of the
   file (``gateway.replicas.RESOLVE_S``), the routing counts are the gateway's
   ``dflash_gateway_routed_requests_total``, polled every ``POLL_S`` (a request is seen up to
   one poll late); when the last one went there; requests routed to replica 0 after the mark
   (the load went on). Replica 1 is undrained afterwards.
3. **failover**: ``--streams`` concurrent greedy streams run once uninterrupted (the reference),
   then again with the verifier process of the replica serving most of them (replica 1 on a
   tie) killed (SIGKILL) once ``--kill-at`` of the reference's tokens have arrived. Failed
   requests (target 0); streams that moved (``usage.resumes`` > 0); streams whose token ids
   equal the reference's (target: all); per moved stream the time to resume: from its last
   token before the kill to its first after (p50, max), and from the kill to that first token.

Output: ``replicas.json`` and ``replicas.md`` in ``--out``; progress on stderr.

    python scripts/bench_replicas.py --out docs/bench/replicas-<tag>     # SmolLM2 (~20 min)
    python scripts/bench_replicas.py --tiny --out /tmp/replicas          # smoke run, no figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_app import bench_prefix  # noqa: E402
from dflash_app.bench_prompts import prompt_set  # noqa: E402
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig, free_run  # noqa: E402
from gateway.replicas import RESOLVE_S  # noqa: E402

ROUTING_TARGET = 0.9          # cached tokens, two replicas / one
POLL_S = 0.05                 # the drain phase's reads of the gateway's routing counts
ROUTED = "dflash_gateway_routed_requests_total"
GATEWAYS = ("score", "round-robin", "one")      # the routing phase's, in the order they run


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the stack -----------------------------------------------------------------------------


def write_verifiers(path: Path, addresses: list[str], drained: str = "") -> None:
    """The gateway's ``--verifiers-file``, replaced at once (never read half written)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{a}{' drain' if a == drained else ''}\n" for a in addresses))
    os.replace(tmp, path)


def routed(metrics: str) -> dict[str, int]:
    """The gateway's requests routed per verifier address, from its /metrics at ``metrics``
    (host:port). Raises OSError when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    return {s.labels["verifier"]: int(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == ROUTED}


@dataclasses.dataclass
class Bench:
    """The started stack: its gateways' addresses and /metrics, the verifiers file."""

    stack: LocalStack
    file: Path
    gateways: dict[str, str]          # GATEWAYS name -> host:port
    metrics: dict[str, str]           # GATEWAYS name -> host:port of its /metrics

    @property
    def replicas(self) -> list[str]:
        return self.stack.verifier_addrs


def start(a, run_dir: Path) -> Bench:
    """The stack and its three gateways (module docstring). Raises LaunchError."""
    file = run_dir / "verifiers.txt"
    base = free_run(13)          # replica r's verifier at ver + r, its drafter at dr + r
    ver, dr = base, base + 2
    gw, admin, m_score, rr, rr_admin, m_rr, one, one_admin, m_one = range(base + 4, base + 13)
    write_verifiers(file, [f"127.0.0.1:{ver}", f"127.0.0.1:{ver + 1}"])
    verifier_args = ["--batch-invariant", a.batch_invariant] if a.batch_invariant else []
    cfg = StackConfig(target=a.target, drafters=[DrafterSpec(path=a.drafter, port=dr)],
                      gateway_port=gw, admin_port=admin, verifier_port=ver, verifiers=2,
                      run_dir=str(run_dir / "stack"), metrics_ports={"gateway": m_score},
                      gateway_args=["--verifiers-file", str(file)], verifier_args=verifier_args,
                      health_timeout_s=900)
    stack = LocalStack(cfg)
    log(f"starting 2 drafters, 2 verifiers, 3 gateways (logs in {cfg.run_dir}) ...")
    stack.start()
    try:
        addr_rr = stack.add_gateway("gateway-rr", rr, rr_admin, args=["--routing", "round-robin"],
                                    metrics_port=m_rr)
        addr_one = stack.add_gateway("gateway-one", one, one_admin,
                                     verifiers=stack.verifier_addrs[:1], metrics_port=m_one)
    except BaseException:
        stack.stop()
        raise
    return Bench(stack, file, {"score": stack.gateway_addr, "round-robin": addr_rr, "one": addr_one},
                 {"score": f"127.0.0.1:{m_score}", "round-robin": f"127.0.0.1:{m_rr}",
                  "one": f"127.0.0.1:{m_one}"})


# ---- streams -------------------------------------------------------------------------------


@dataclasses.dataclass
class Stream:
    """One greedy request as the client saw it: ``times`` are ``time.perf_counter()`` at each
    delta that carried token ids (``counts`` of them)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)
    started: float = 0.0
    resumes: int = 0
    finish: str = ""
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.finish not in ("length", "stop")


def run_stream(addr: str, messages: list[dict], *, max_tokens: int, tenant: str,
               on_delta=None) -> Stream:
    """One greedy request through the gateway at ``addr`` as ``tenant``; ``on_delta(n)`` after
    each delta of ``n`` ids. An error is recorded in the result, never raised."""
    import grpc

    from dflash.client import GatewayClient, build_request
    from dflash.client._common import finish_name
    from gateway.inputs import CLIENT_KEY

    s = Stream()
    client = GatewayClient(addr, metadata=[(CLIENT_KEY, tenant)])
    try:
        client.wait_ready(60)
        s.started = time.perf_counter()
        for r in client.stream(build_request(messages=messages, max_tokens=max_tokens), timeout=1800):
            if r.token_ids:
                s.times.append(time.perf_counter())
                s.counts.append(len(r.token_ids))
                s.ids += list(r.token_ids)
                if on_delta is not None:
                    on_delta(len(r.token_ids))
            if r.HasField("usage"):
                s.resumes, s.finish = r.usage.resumes, finish_name(r.finish_reason)
    except grpc.RpcError as e:    # a failed request is a figure of the bench
        s.error = f"{e.code().name}: {e.details()}"[:300]
    except grpc.FutureTimeoutError:
        s.error = f"the gateway at {addr} did not connect in 60 s"
    finally:
        client.close()
    return s


def run_streams(addr: str, messages: list[list[dict]], *, max_tokens: int, tenant: str,
                on_delta=None) -> list[Stream]:
    """``messages`` as concurrent streams, one thread each; results in their order."""
    with ThreadPoolExecutor(len(messages)) as pool:
        futs = [pool.submit(run_stream, addr, m, max_tokens=max_tokens, tenant=tenant,
                            on_delta=on_delta) for m in messages]
        return [f.result() for f in futs]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linear between ranks; None for none."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


# ---- 1. routing ----------------------------------------------------------------------------


def routing_summary(results: dict[str, dict], split: dict[str, dict[str, int]]) -> dict:
    """Per gateway of ``results`` (GATEWAYS name -> bench_prefix.run_workload result, ``cache``
    arm): per-turn cached share and prompt tokens, totals, the two-replica / one-replica ratio
    of cached tokens, the replicas' request ``split``, and rows whose greedy ids equal the one
    replica's."""
    out: dict = {}
    one = results["one"]["rows"]["cache"]
    for name, res in results.items():
        rows = res["rows"]["cache"]
        turns = bench_prefix.summarize(res)["cache"]["turns"]
        cached = sum(r["cached_tokens"] for t in rows for r in t)
        prompt = sum(r["prompt_tokens"] for t in rows for r in t)
        out[name] = {"turns": [{"cached_share": t["cached_share"], "prompt_tokens": t["prompt_tokens"],
                                "ttft_median_s": t["ttft_median_s"]} for t in turns],
                     "cached_tokens": cached, "prompt_tokens": prompt,
                     "cached_share": cached / max(prompt, 1), "requests": split.get(name, {}),
                     "identical_to_one": sum(x["token_ids"] == y["token_ids"] for tx, ty in zip(rows, one)
                                             for x, y in zip(tx, ty)),
                     "rows": sum(len(t) for t in rows)}
    base = out["one"]["cached_tokens"]
    for name in ("score", "round-robin"):
        out[name]["ratio_to_one"] = out[name]["cached_tokens"] / base if base else None
    return out


def measure_routing(b: Bench, prompts, a) -> dict:
    from tqdm import tqdm

    results, split = {}, {}
    for name in GATEWAYS:
        before = routed(b.metrics[name])
        with tqdm(total=a.conversations * a.turns, desc=f"routing: {name}") as bar:
            results[name] = bench_prefix.run_workload(
                b.gateways[name], prompts, workload="multiturn", max_tokens=a.max_tokens,
                speculation=True, conversations=a.conversations, turns=a.turns, arms=["cache"],
                progress=lambda: bar.update(1))
        after = routed(b.metrics[name])
        split[name] = {addr: after.get(addr, 0) - before.get(addr, 0) for addr in after}
    out = routing_summary(results, split)
    log(f"routing: cached tokens two replicas / one: score {out['score']['ratio_to_one']}, "
        f"round-robin {out['round-robin']['ratio_to_one']}")
    return out


# ---- 2. drain ------------------------------------------------------------------------------


def drain_summary(samples: list[tuple[float, dict[str, int]]], t_drain: float, period_s: float,
                  drained: str, other: str) -> dict:
    """The drain figures from ``samples`` of the routing counts ((perf_counter, address ->
    count), in time order; one at or before ``t_drain``, the mark): requests routed to
    ``drained`` first seen later than ``period_s`` + one poll after the mark, the last time
    its count rose after the mark (seconds after it, None: never), and requests routed to
    ``other`` after the mark."""
    def at(t: float) -> dict[str, int]:
        return next((c for ts, c in reversed(samples) if ts <= t), samples[0][1])

    start, end = at(t_drain), samples[-1][1]
    settled = at(t_drain + period_s + POLL_S)
    rises = [ts - t_drain for (_, c0), (ts, c1) in zip(samples, samples[1:])
             if ts > t_drain and c1.get(drained, 0) > c0.get(drained, 0)]
    return {"routed_to_drained_after_period": end.get(drained, 0) - settled.get(drained, 0),
            "routed_to_drained_after_mark": end.get(drained, 0) - start.get(drained, 0),
            "last_routed_to_drained_s": max(rises) if rises else None,
            "routed_to_other_after_mark": end.get(other, 0) - start.get(other, 0)}


def measure_drain(b: Bench, prompts, a) -> dict:
    """Module docstring, 2: the clients go on until ``--drain-rounds`` x ``--streams`` requests
    have started later than one health period (and a poll) after the mark."""
    drained, other = b.replicas[1], b.replicas[0]
    tenant = f"bench-drain-{uuid.uuid4().hex[:8]}"
    settle = RESOLVE_S + POLL_S
    finished = threading.Semaphore(0)
    stop, done = threading.Event(), threading.Event()
    results: list[Stream] = []
    mark: list[float] = []                 # the mark's perf_counter, once made
    late = [0]                             # requests started after mark + settle
    lock = threading.Lock()

    def worker(w: int) -> None:
        k = 0
        while not stop.is_set():
            t = time.perf_counter()
            s = run_stream(b.gateways["score"], prompts[(w + k * a.streams) % len(prompts)][1],
                           max_tokens=a.max_tokens, tenant=tenant)
            k += 1
            with lock:
                results.append(s)
                if mark and t > mark[0] + settle:
                    late[0] += 1
                    if late[0] >= a.drain_rounds * a.streams:
                        stop.set()
            finished.release()

    samples: list[tuple[float, dict[str, int]]] = []

    def poll() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), routed(b.metrics["score"])))
            done.wait(POLL_S)
        samples.append((time.perf_counter(), routed(b.metrics["score"])))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    workers = [threading.Thread(target=worker, args=(w,)) for w in range(a.streams)]
    for t in workers:
        t.start()
    for _ in range(a.streams):             # one round's worth finished: the loop is going
        finished.acquire()
    write_verifiers(b.file, b.replicas, drained=drained)
    with lock:
        mark.append(time.perf_counter())
    log(f"drain: {drained} marked draining after {a.streams} requests")
    for t in workers:
        t.join()
    done.set()
    poller.join()
    write_verifiers(b.file, b.replicas)     # back for the failover phase
    failed = [s.error or s.finish for s in results if s.failed]
    out = {"requests": len(results), "failed": len(failed), "failures": failed[:5],
           "requests_after_period": late[0], "health_period_s": RESOLVE_S, "poll_s": POLL_S,
           "drained": drained, **drain_summary(samples, mark[0], RESOLVE_S, drained, other)}
    log(f"drain: {out}")
    time.sleep(2 * RESOLVE_S + 0.5)         # the gateway reads the file again: both eligible
    return out


# ---- 3. failover ---------------------------------------------------------------------------


def failover_summary(ref: list[Stream], run: list[Stream], t_kill: float | None) -> dict:
    """Failed requests, resumed streams, streams equal to the reference, and per resumed stream
    the gap from its last token at or before ``t_kill`` to its first after (and from the kill
    to that first token), seconds."""
    gaps, waits, differ = [], [], []
    for i, (r, s) in enumerate(zip(ref, run)):
        if s.ids != r.ids:
            first = next((k for k, (x, y) in enumerate(zip(s.ids, r.ids)) if x != y),
                         min(len(s.ids), len(r.ids)))
            differ.append({"stream": i, "first_difference": first, "resumes": s.resumes,
                           "tokens": len(s.ids), "reference_tokens": len(r.ids)})
        if s.resumes and t_kill is not None:
            before = [t for t in s.times if t <= t_kill]
            after = [t for t in s.times if t > t_kill]
            if before and after:
                gaps.append(after[0] - before[-1])
                waits.append(after[0] - t_kill)
    return {"streams": len(run), "failed": sum(s.failed for s in run),
            "failures": [s.error or s.finish for s in run if s.failed][:5],
            "reference_failed": sum(s.failed for s in ref),
            "resumed": sum(s.resumes > 0 for s in run), "identical": len(run) - len(differ),
            "differences": differ, "resume_gap_s": gaps,
            "resume_gap_p50_s": percentile(gaps, 0.5), "resume_gap_max_s": max(gaps, default=None),
            "kill_to_next_token_p50_s": percentile(waits, 0.5),
            "kill_to_next_token_max_s": max(waits, default=None)}


def measure_failover(b: Bench, prompts, a) -> dict:
    msgs = [prompts[i % len(prompts)][1] for i in range(a.streams)]
    run_id = uuid.uuid4().hex[:8]
    log(f"failover: {a.streams} uninterrupted streams (the reference) ...")
    before = routed(b.metrics["score"])
    ref = run_streams(b.gateways["score"], msgs, max_tokens=a.max_tokens, tenant=f"bench-ref-{run_id}")
    mid = routed(b.metrics["score"])
    threshold = a.kill_at * sum(len(s.ids) for s in ref)
    got = [0]
    lock = threading.Lock()
    fire = threading.Event()

    def on_delta(n: int) -> None:
        with lock:
            got[0] += n
            if got[0] >= threshold:
                fire.set()

    kill: dict = {}

    def killer() -> None:
        if fire.wait(1800) and not kill.get("cancelled"):
            # the replica serving most of the streams (replica 1 on a tie): the router may
            # have sent every one to the replica that holds their prefixes, and killing the
            # other would test nothing
            now = routed(b.metrics["score"])
            load = [now.get(r, 0) - mid.get(r, 0) for r in b.replicas]
            kill["index"] = i = max(range(len(load)), key=lambda j: (load[j], j))
            kill["t"] = time.perf_counter()
            b.stack.procs[b.stack.verifier_name(i)].send_signal(signal.SIGKILL)
            with lock:
                kill["tokens"] = got[0]

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    log(f"failover: {a.streams} streams, the replica serving most of them killed once they have "
        f"{threshold:.0f} of the reference's tokens ...")
    run = run_streams(b.gateways["score"], msgs, max_tokens=a.max_tokens,
                      tenant=f"bench-kill-{run_id}", on_delta=on_delta)
    kill["cancelled"] = True
    fire.set()
    k.join()
    after = routed(b.metrics["score"])
    out = failover_summary(ref, run, kill.get("t"))
    i = kill.get("index")
    out.update({"killed": b.stack.verifier_name(i) if i is not None else None,
                "killed_address": b.replicas[i] if i is not None else None,
                "kill_at_tokens": kill.get("tokens"),
                "reference_tokens": sum(len(s.ids) for s in ref),
                "requests_reference": {x: mid.get(x, 0) - before.get(x, 0) for x in mid},
                "requests_killed_run": {x: after.get(x, 0) - mid.get(x, 0) for x in after}})
    log(f"failover: failed {out['failed']}, resumed {out['resumed']}, identical "
        f"{out['identical']}/{out['streams']}, gap p50 {out['resume_gap_p50_s']}")
    return out


# ---- report --------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(res: dict) -> str:
    c, ro, dr, fo = res["config"], res["routing"], res["drain"], res["failover"]
    lines = [f"# Verifier replicas: routing, drain, failover ({'tiny models' if c['tiny'] else c['target']})",
             "", f"commit {c['commit']}, {c['host']['cpus']} CPUs ({c['host']['machine']}), 2 replicas, "
             f"max_tokens {c['max_tokens']}, greedy", "",
             "| target | measured | verdict |", "|---|---|---|"]
    ratio = ro["score"]["ratio_to_one"]
    lines.append(f"| cached tokens, two replicas / one >= {ROUTING_TARGET:.0%} | score {_pct(ratio)} "
                 f"(round-robin {_pct(ro['round-robin']['ratio_to_one'])}) | "
                 f"{verdict(ratio is not None and ratio >= ROUTING_TARGET)} |")
    lines.append(f"| replica killed: 0 failed | {fo['failed']} of {fo['streams']} "
                 f"({fo['resumed']} resumed) | {verdict(fo['failed'] == 0 and fo['killed'] is not None)} |")
    lines.append(f"| every greedy stream identical to an uninterrupted run | {fo['identical']}/{fo['streams']} | "
                 f"{verdict(fo['identical'] == fo['streams'])} |")
    lines.append(f"| time to resume (reported) | p50 {_s(fo['resume_gap_p50_s'])}, max "
                 f"{_s(fo['resume_gap_max_s'])} | - |")
    lines.append(f"| drained: 0 failed | {dr['failed']} of {dr['requests']} | {verdict(dr['failed'] == 0)} |")
    lines.append(f"| drained: nothing new after one health period ({dr['health_period_s']:g} s) | "
                 f"{dr['routed_to_drained_after_period']} | "
                 f"{verdict(dr['routed_to_drained_after_period'] == 0)} |")
    lines += ["", f"## Routing: {c['conversations']} conversations x {c['turns']} turns, resent history",
              "", "cached share of each prompt (mean over conversations):", "",
              "| turn | prompt tokens | one replica | two, score | two, round-robin |",
              "|---|---|---|---|---|"]
    for t, x in enumerate(ro["one"]["turns"]):
        lines.append(f"| {t + 1} | {x['prompt_tokens']:.0f} | {_pct(x['cached_share'])} | "
                     f"{_pct(ro['score']['turns'][t]['cached_share'])} | "
                     f"{_pct(ro['round-robin']['turns'][t]['cached_share'])} |")
    lines.append(f"| all | {ro['one']['prompt_tokens']} | {_pct(ro['one']['cached_share'])} | "
                 f"{_pct(ro['score']['cached_share'])} | {_pct(ro['round-robin']['cached_share'])} |")
    lines += ["", "requests per replica: " + "; ".join(
        f"{n} " + ", ".join(f"{a} {k}" for a, k in sorted(ro[n]["requests"].items())) for n in GATEWAYS),
        "greedy outputs equal to one replica's: " + ", ".join(
            f"{n} {ro[n]['identical_to_one']}/{ro[n]['rows']}" for n in ("score", "round-robin")), ""]
    lines += [f"## Drain: {c['streams']} closed-loop clients, {dr['requests']} requests", "",
              f"{dr['drained']} marked `drain` after {c['streams']} requests finished; routed to it "
              f"after the mark {dr['routed_to_drained_after_mark']} (the last "
              f"{_s(dr['last_routed_to_drained_s'])} after it; counts polled every {dr['poll_s']:g} s), "
              f"after one health period {dr['routed_to_drained_after_period']} (requests started after it "
              f"{dr['requests_after_period']}); routed to the other replica after the mark "
              f"{dr['routed_to_other_after_mark']}. Failed {dr['failed']}.", ""]
    lines += [f"## Failover: {c['streams']} concurrent greedy streams", "",
              f"{fo['killed'] or 'nothing'} (SIGKILL) after {fo['kill_at_tokens']} of the reference's "
              f"{fo['reference_tokens']} tokens. Requests per replica: reference "
              + ", ".join(f"{a} {k}" for a, k in sorted(fo["requests_reference"].items()))
              + "; killed run " + ", ".join(f"{a} {k}" for a, k in sorted(fo["requests_killed_run"].items()))
              + " (a resume is one more request, on the survivor).", "",
              "| failed | resumed | identical | resume gap p50 / max | kill to next token p50 / max |",
              "|---|---|---|---|---|",
              f"| {fo['failed']} | {fo['resumed']} | {fo['identical']}/{fo['streams']} | "
              f"{_s(fo['resume_gap_p50_s'])} / {_s(fo['resume_gap_max_s'])} | "
              f"{_s(fo['kill_to_next_token_p50_s'])} / {_s(fo['kill_to_next_token_max_s'])} |", ""]
    if fo["differences"]:
        lines += ["differing streams: " + "; ".join(
            f"#{d['stream']} from token {d['first_difference']} (resumes {d['resumes']})"
            for d in fo["differences"]), ""]
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for replicas.json / replicas.md")
    p.add_argument("--target", help="target model dir (default: SmolLM2-135M-Instruct, set up on demand)")
    p.add_argument("--drafter", help="drafter dir (default: models/smollm2-dflash-b16)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random-weight models and small settings (a smoke run, no figures)")
    p.add_argument("--prompts", default="chat", help="prompt set: chat, humaneval or a JSONL file")
    p.add_argument("--conversations", type=_positive, help="routing: conversations (9; --tiny 3)")
    p.add_argument("--turns", type=_positive, help="routing: turns per conversation (6; --tiny 3)")
    p.add_argument("--max-tokens", type=_positive, help="completion tokens per request (128; --tiny 32)")
    p.add_argument("--streams", type=_positive, help="drain and failover: concurrent streams (16; --tiny 4)")
    p.add_argument("--drain-rounds", type=_positive,
                   help="drain: requests per client started after one health period past the "
                        "mark, all clients together x --streams (2; --tiny 3)")
    p.add_argument("--kill-at", type=float, default=0.3,
                   help="failover: kill once this share of the reference's tokens arrived (0..1)")
    p.add_argument("--batch-invariant", choices=("auto", "on", "off"),
                   help="the verifiers' --batch-invariant (default: theirs, auto); on makes a "
                        "resumed stream's identity exact by construction (docs/batch-invariance.md)")
    p.add_argument("--run-dir", help="service logs and the verifiers file (default: a temp dir)")
    a = p.parse_args(argv)
    for k, full, tiny in (("conversations", 9, 3), ("turns", 6, 3), ("max_tokens", 128, 32),
                          ("streams", 16, 4), ("drain_rounds", 2, 3)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    if not 0 < a.kill_at < 1:
        p.error(f"--kill-at: must be in (0, 1), got {a.kill_at}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from dflash_app.stack import DEFAULT_DRAFTER, tiny_models

    if a.tiny and not a.target:
        a.target, a.drafter = tiny_models()
    if not a.target:
        from dflash.train.target_setup import setup_target
        a.target = str(setup_target())
    a.target, a.drafter = (str(Path(x).resolve()) for x in (a.target, a.drafter or DEFAULT_DRAFTER))
    prompts = prompt_set(a.prompts)
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="bench-replicas-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    b = start(a, run_dir)
    try:
        res = {"routing": measure_routing(b, prompts, a)}
        for name in ("gateway-rr", "gateway-one"):      # off the cores for the rest
            b.stack.procs[name].terminate()
            b.stack.procs[name].wait(30)
        res["drain"] = measure_drain(b, prompts, a)
        res["failover"] = measure_failover(b, prompts, a)
    finally:
        b.stack.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    res["config"] = {"target": a.target, "drafter": a.drafter, "tiny": a.tiny, "prompts": a.prompts,
                     "conversations": a.conversations, "turns": a.turns, "max_tokens": a.max_tokens,
                     "streams": a.streams, "drain_rounds": a.drain_rounds, "kill_at": a.kill_at,
                     "batch_invariant": a.batch_invariant or "verifier default", "commit": commit,
                     "run_dir": str(run_dir), "wall_s": round(time.monotonic() - t0, 1),
                     "host": {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "replicas.md").write_text(md)
    print(md)
    log(f"wrote {out}/replicas.json, replicas.md in {res['config']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
