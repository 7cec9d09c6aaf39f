"""A stream flood against a stack of separate processes, with health probed from a third.

``python -m dflash_app.flood --tiny --streams 500`` starts drafter, verifier (``--max-batch``,
``--max-waiting``) and gateway as processes (:class:`dflash_app.launcher.LocalStack`), opens
``--streams`` Generate streams on the gateway at once, and meanwhile a probe process checks
``grpc.health.v1`` every ``--probe-interval`` seconds, each address on its own channel: the
gateway's and the verifier's service ports, and their health-only listeners (``--health-bind``,
a child process each: what orchestrators probe). It prints how many streams completed, how many were refused with
RESOURCE_EXHAUSTED (and how fast), and each service's health latency (median, p99, max).

The probe runs in its own process so that its timings are the services' (a probe sharing an
interpreter with 500 client streams measures its own GIL waits). This is the measurement behind
"health answers in under 100 ms at 500 open streams" (docs/limits.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time

import grpc

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else float("nan")


@dataclasses.dataclass
class FloodResult:
    """What one flood measured; latencies in seconds."""

    streams: int
    completed: int
    refused: int
    errors: list[str]                 # "CODE: details" of any other failure
    refusal_s: list[float]            # send -> RESOURCE_EXHAUSTED, per refused stream
    served_s: list[float]             # send -> last message, per completed stream
    health_s: dict[str, list[float]]  # probe label -> latencies (a failed check counts inf)

    def lines(self) -> list[str]:
        out = [f"{self.streams} streams: {self.completed} completed, {self.refused} refused "
               f"(RESOURCE_EXHAUSTED in median {1e3 * _pct(self.refusal_s, 0.5):.1f} ms, max "
               f"{1e3 * max(self.refusal_s, default=float('nan')):.1f} ms), "
               f"{len(self.errors)} other errors; completed ones took median "
               f"{_pct(self.served_s, 0.5):.2f} s, max {max(self.served_s, default=float('nan')):.2f} s"]
        for addr, xs in self.health_s.items():
            out.append(f"health {addr}: {len(xs)} checks, median {1e3 * _pct(xs, 0.5):.1f} ms, "
                       f"p99 {1e3 * _pct(xs, 0.99):.1f} ms, max {1e3 * max(xs, default=float('nan')):.1f} ms")
        return out


def probe_main(addrs: list[str], interval_s: float, timeout_s: float) -> None:
    """Check health on each address every ``interval_s`` until stdin closes, then print
    ``{address: [seconds, ...]}`` as JSON (a failed or timed-out check is recorded as inf)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stubs = {a: health_pb2_grpc.HealthStub(grpc.insecure_channel(a)) for a in addrs}
    samples: dict[str, list[float]] = {a: [] for a in addrs}
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    check = health_pb2.HealthCheckRequest()
    print("ready", flush=True)
    while not stop.wait(interval_s):
        for a, stub in stubs.items():
            t0 = time.perf_counter()
            try:
                stub.Check(check, timeout=timeout_s)
                samples[a].append(time.perf_counter() - t0)
            except grpc.RpcError:
                samples[a].append(float("inf"))
    json.dump(samples, sys.stdout)


def flood(gateway: str, streams: int, max_tokens: int, probes: dict[str, str], *,
          interval_s: float = 0.02, channels: int = 8, prompt: str = "Hello") -> FloodResult:
    """Open ``streams`` Generate streams on ``gateway`` at once (over ``channels`` connections)
    while a probe process checks health on each of ``probes`` (label -> address); wait for
    all to end."""
    from dflash.v1 import gateway_pb2, gateway_pb2_grpc

    probe = subprocess.Popen([sys.executable, "-m", "dflash_app.flood", "probe",
                              "--interval", str(interval_s), *probes.values()],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert probe.stdout is not None and probe.stdin is not None
    if probe.stdout.readline().strip() != "ready":
        raise RuntimeError("health probe did not start")
    chans = [grpc.insecure_channel(gateway) for _ in range(channels)]
    stubs = [gateway_pb2_grpc.GatewayStub(c) for c in chans]
    try:
        time.sleep(10 * interval_s)          # a few idle samples first
        sent, done, calls = [], {}, []
        for i in range(streams):
            sent.append(time.monotonic())
            call = stubs[i % channels].Generate(gateway_pb2.GenerateRequest(
                prompt=f"{prompt} {i}", max_tokens=max_tokens), timeout=600)
            call.add_done_callback(lambda _c, i=i: done.setdefault(i, time.monotonic()))
            calls.append(call)
        completed, refused, errors = [], [], []
        for i, call in enumerate(calls):
            try:
                chunks = list(call)
                if not chunks or not chunks[-1].finish_reason:
                    errors.append(f"stream {i}: ended without a finish reason")
                else:
                    completed.append(i)
            except grpc.RpcError as e:
                (refused if e.code() == RESOURCE_EXHAUSTED else errors).append(
                    i if e.code() == RESOURCE_EXHAUSTED else f"{e.code().name}: {e.details()}")
        time.sleep(10 * interval_s)
    finally:
        out, _ = probe.communicate("", timeout=60)
        for c in chans:
            c.close()
    return FloodResult(streams=streams, completed=len(completed), refused=len(refused),
                       errors=errors, refusal_s=[done[i] - sent[i] for i in refused],
                       served_s=[done[i] - sent[i] for i in completed],
                       health_s={label: json.loads(out)[addr] for label, addr in probes.items()})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash_app.flood", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    pr = sub.add_parser("probe", help="(internal) the health probe process")
    pr.add_argument("addrs", nargs="+")
    pr.add_argument("--interval", type=float, default=0.02)
    pr.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight models (else --target/--drafter)")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=128)
    p.add_argument("--probe-interval", type=float, default=0.02)
    p.add_argument("--run-dir", help="service logs (default: a temporary directory)")
    a = p.parse_args(argv)
    if a.cmd == "probe":
        probe_main(a.addrs, a.interval, a.timeout)
        return
    try:
        result = run_stack_flood(a)
    except KeyboardInterrupt:            # the stack's context manager has stopped every service
        print("flood: interrupted; the stack is stopped", file=sys.stderr)
        raise SystemExit(130) from None
    print("\n".join(result.lines()))


def run_stack_flood(a: argparse.Namespace) -> FloodResult:
    """Start the stack ``a`` describes on free ports, flood it, stop it."""
    import socket

    from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig
    from dflash_app.stack import tiny_models

    target, drafter = tiny_models() if a.tiny else (a.target, a.drafter)
    if not target or not drafter:
        raise SystemExit("--target and --drafter, or --tiny")
    socks = [socket.socket() for _ in range(6)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    gw, ver, dr, admin, gw_health, ver_health = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="dflash-flood-")
    cfg = StackConfig(target=target, drafters=[DrafterSpec(path=drafter, port=dr)],
                      gateway_port=gw, verifier_port=ver, admin_port=admin, run_dir=run_dir,
                      verifier_args=["--max-batch", str(a.max_batch), "--max-waiting", str(a.max_waiting),
                                     "--health-bind", f"127.0.0.1:{ver_health}"],
                      # one client opens every stream: the per-client bound would refuse them first
                      gateway_args=["--max-streams-per-client", "0",
                                    "--health-bind", f"127.0.0.1:{gw_health}"])
    with LocalStack(cfg) as stack:       # __enter__ starts it
        probes = {"gateway port": stack.gateway_addr, "verifier port": stack.verifier_addr,
                  "gateway --health-bind": f"127.0.0.1:{gw_health}",
                  "verifier --health-bind": f"127.0.0.1:{ver_health}"}
        return flood(stack.gateway_addr, a.streams, a.max_tokens, probes, interval_s=a.probe_interval)


if __name__ == "__main__":
    main()
