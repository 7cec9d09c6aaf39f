"""Two commits' stacks side by side: the many-users sweep, levels interleaved, in one run.

    python scripts/ab_commits.py OLD_REV [--concurrency 1,4,16,32] [--spec-modes off,adaptive]
        [--repeats 2] [--max-tokens 48] [--requests 8] [--requests-per-client 2] [--prompts SET]
        [--out DIR]

Checks ``OLD_REV`` out into a git worktree, starts its stack (``dflash up``, its own code) and
this checkout's stack on other ports, both on the same target and drafter; then, for each
repeat and each concurrency level, runs ``dflash bench --concurrency c`` against the old
gateway and then the new one (the order alternates between repeats), so drift on a shared
machine falls on both alike. Writes each cell's ``load.json`` under ``DIR/<side>/r<i>-c<c>/``
and prints one table: aggregate tokens/s per (level, mode), old vs new (mean and range over the
repeats), their ratio, and τ. Only one stack runs a bench at a time; the idle one only waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
# the `dflash` CLI of the tree on PYTHONPATH: dflash.tools before the application layer became
# the top-level dflash_app. The old layout is tried first: this venv's editable install would
# find the new tree's dflash_app even from an old tree.
CLI = ("import sys\ntry:\n    from dflash.tools.cli import main\nexcept ImportError:\n"
       "    from dflash_app.cli import main\nsys.exit(main())")


def wait_ready(addr: str, timeout_s: float = 600.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(addr) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(2)
    raise TimeoutError(f"gateway {addr} not serving after {timeout_s}s")


def start(tree: Path, base_port: int, run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "up.log", "w")
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "up",
         "--gateway-port", str(base_port), "--verifier-port", str(base_port + 1),
         "--drafter-port", str(base_port + 2), "--http-port", "0",   # two stacks: no shared :8000
         "--run-dir", str(run_dir)],
        cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--spec-modes", default="off,adaptive")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompts", default="", help="the bench's prompt set (default: its own)")
    p.add_argument("--out", default="runs/ab_commits")
    p.add_argument("--worktree", default="/tmp/dflash-ab-old")
    a = p.parse_args()
    out = Path(a.out).resolve()
    old_tree = Path(a.worktree)
    if not old_tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(old_tree), a.old],
                       check=True)
    sides = {"old": (old_tree, 51050), "new": (ROOT, 52050)}
    procs = {name: start(tree, port, out / name / "services") for name, (tree, port) in sides.items()}
    try:
        for _, port in sides.values():
            wait_ready(f"127.0.0.1:{port}")
        levels = [int(c) for c in a.concurrency.split(",")]
        for rep in range(a.repeats):
            for c in levels:
                order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
                for name in order:
                    cell = out / name / f"r{rep}-c{c}"
                    subprocess.run(
                        [sys.executable, "-c", CLI,
                         "bench", "--gateway", f"127.0.0.1:{sides[name][1]}", "--concurrency", str(c),
                         "--spec-modes", a.spec_modes, "--repeats", "1", "--max-tokens", str(a.max_tokens),
                         "--requests", str(a.requests), "--requests-per-client", str(a.requests_per_client),
                         *(["--prompts", a.prompts] if a.prompts else []),
                         "--out", str(cell)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
                    print(f"done {name} rep {rep} c={c}", flush=True)
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
    print(table(out, levels, a.spec_modes.split(","), a.repeats))
    (out / "table.md").write_text(table(out, levels, a.spec_modes.split(","), a.repeats) + "\n")


def table(out: Path, levels: list[int], modes: list[str], repeats: int) -> str:
    def cells(side, c, mode):
        rows = []
        for rep in range(repeats):
            f = out / side / f"r{rep}-c{c}" / "load.json"
            if f.exists():
                rows += [lv for lv in json.loads(f.read_text())["levels"] if lv["mode"] == mode]
        return rows

    lines = ["| concurrency | mode | old tok/s | new tok/s | new / old | tau old / new |",
             "|---|---|---|---|---|---|"]
    for c in levels:
        for mode in modes:
            o, n = cells("old", c, mode), cells("new", c, mode)
            if not o or not n:
                continue
            fo = [x["agg_tok_s"] for x in o]
            fn = [x["agg_tok_s"] for x in n]
            mo, mn = statistics.mean(fo), statistics.mean(fn)
            lines.append(f"| {c} | {mode} | {mo:.1f} ({min(fo):.1f}–{max(fo):.1f}) | {mn:.1f} "
                         f"({min(fn):.1f}–{max(fn):.1f}) | {mn / mo:.2f}x | "
                         f"{statistics.mean(x['tau'] for x in o):.2f} / "
                         f"{statistics.mean(x['tau'] for x in n):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
