#!/usr/bin/env python3
"""The three observability targets of issue 43, measured in one run (docs/observability.md).

(a) trace UI latency: a fresh ``dflash up --traces-ui`` (Phoenix from .venv-traces), one
    ``dflash generate``, then Phoenix's REST API polled every 0.1 s until that request's trace
    holds the gateway's, verifier's and drafter's spans, every parent present, and its span
    count has settled; seconds from ``dflash generate``'s exit to the first poll that saw all
    of it (target <= 5 s).
(b) tracing overhead: batch-1 tokens/s (sequential requests; completion tokens / summed
    end-to-end latency) of that stack against a twin with tracing off, rounds interleaved
    (ABBA), same prompts; ratio of the means (target >= 0.97), and whether both gave the same
    tokens (greedy: tracing must not change them).
(c) ``dflash top`` under load: aggregate tokens/s of ``--clients`` closed-loop clients against
    the tracing-off stack with and without ``dflash top`` refreshing every ``--top-interval``
    in its own process (a real rich Live view rendered to a file), rounds interleaved; ratio of
    the means against the run-to-run spread of the runs without top (target: not lower by more
    than that spread), and the refresh intervals top actually achieved.

Both stacks run with ``DFLASH_SUFFIX_ANSWER_TOKENS=0`` (every prompt runs once per condition
and round: an earlier answer must not become a later run's suffix candidate) and the bench's
own OTEL_* / DFLASH_TRACE_FILE removed (tracing off means off). Without Phoenix (run
``scripts/setup_traces.sh``) (a) and (b) are skipped, saying so, and (c) still runs.
Output: ``observability.json`` and ``observability.md`` in ``--out``.

    python scripts/bench_observability.py --out docs/bench/observability-<tag>   # SmolLM2
    python scripts/bench_observability.py --tiny --out /tmp/obs                   # smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_app.bench import run_gateway  # noqa: E402
from dflash_app.bench_load import run_level  # noqa: E402
from dflash_app.bench_prompts import prompt_set  # noqa: E402
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig  # noqa: E402
from dflash_app.traces_ui import find_phoenix, missing_spans, project_spans  # noqa: E402

TRACE_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DFLASH_TRACE_FILE")
GATEWAY_RPC, VERIFIER_RPC = "/dflash.v1.Gateway/Generate", "/dflash.v1.Verifier/Generate"
TRACE_TARGET_S, OVERHEAD_TARGET = 5.0, 0.97


def free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _spread(v: list[float]) -> float:
    """Half the range relative to the mean (0 for one run): bench_load's run-to-run spread."""
    return (max(v) - min(v)) / 2 / float(np.mean(v)) if v else 0.0


# ---- (a) the trace in Phoenix ------------------------------------------------------------


class UpProcess:
    """``dflash up --traces-ui`` as a child process; its output is read on a thread."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_app.cli", "up", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("logs in"):      # the last line of up's summary
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        """Raises RuntimeError with up's output when it exits or is not up in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dflash up --traces-ui did not come up:\n" + "".join(self.lines))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)    # up stops the services, then Phoenix
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _service(span_name: str) -> str:
    return "drafter" if span_name.startswith("drafter.") else (
        "verifier" if span_name.startswith("verifier.") or span_name == VERIFIER_RPC else "gateway")


def measure_trace(ui: str, gateway: str, prompt: str, max_tokens: int, timeout_s: float = 60.0,
                  settle_s: float = 3.0) -> dict:
    """One ``dflash generate`` through a fresh stack, and how long its trace takes to show.

    Phoenix is polled every 0.1 s until the trace has every service's spans and parents and
    its span count has not changed for ``settle_s`` (each service exports on its own batch
    timer: a trace can look whole while a process's last spans are still on their way).
    ``visible_s``: from ``dflash generate``'s exit to the first poll that saw all of it;
    ``first_whole_s``: to the first poll where nothing looked missing."""
    t0 = time.monotonic()
    gen = subprocess.run([sys.executable, "-m", "dflash_app.cli", "generate", "--gateway", gateway,
                          "--max-tokens", str(max_tokens), prompt],
                         capture_output=True, text=True, timeout=600)
    done = time.monotonic()
    if gen.returncode:
        raise RuntimeError(f"dflash generate failed:\n{gen.stderr}")
    polls: list[tuple[float, int, bool]] = []       # (seconds after exit, spans, looks whole)
    trace_id, spans, lack = None, [], ["the gateway's span"]
    while time.monotonic() < done + timeout_s:
        roots = project_spans(ui, name=GATEWAY_RPC)
        if len(roots) > 1:
            raise RuntimeError(f"{len(roots)} gateway requests in a fresh Phoenix project")
        if roots:
            trace_id = roots[0]["context"]["trace_id"]
            spans = project_spans(ui, trace_id=trace_id)
            lack = missing_spans(spans)
        polls.append((time.monotonic() - done, len(spans), not lack))
        settled = [p for p in polls if p[0] >= polls[-1][0] - settle_s]
        if not lack and polls[-1][0] - polls[0][0] >= settle_s and len({p[1] for p in settled}) == 1:
            break
        time.sleep(0.1)
    whole = [p for p in polls if p[2]]
    final = [p for p in whole if p[1] == len(spans)]
    visible_s = final[0][0] if final and not lack else None
    return {"visible_s": visible_s, "first_whole_s": whole[0][0] if whole else None,
            "generate_s": done - t0, "trace_id": trace_id,
            "trace_url": f"{ui}/redirects/traces/{trace_id}" if trace_id else None,
            "missing": lack, "spans": len(spans), "spans_when_first_whole": whole[0][1] if whole else 0,
            "spans_by_service": dict(Counter(_service(x["name"]) for x in spans)), "target_s": TRACE_TARGET_S,
            "ok": visible_s is not None and visible_s <= TRACE_TARGET_S,
            "generate_summary": gen.stderr.strip().splitlines()[-1:]}


# ---- (b) batch-1 tokens/s, tracing to the UI vs off --------------------------------------


def phoenix_cpu_s() -> float:
    """CPU seconds (user + system) every running ``phoenix serve`` process has used so far
    (Linux /proc; 0.0 elsewhere): where the trace UI's share of the cores goes."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if not any(c.endswith(b"phoenix") for c in cmd) or b"serve" not in cmd:
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick     # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total


def tracing_overhead(addrs: dict[str, str], prompts, rounds: int, max_tokens: int) -> dict:
    """``addrs``: {"ui": gateway of the traced stack, "off": its twin}; ABBA rounds. Each run
    also records the CPU seconds Phoenix used during it (its span ingest shares the cores)."""
    runs: list[dict] = []
    tokens: dict[str, list[list[list[int]]]] = {}
    for r in range(rounds):
        for cond in (("off", "ui") if r % 2 == 0 else ("ui", "off")):
            cpu0, t0 = phoenix_cpu_s(), time.monotonic()
            rows = run_gateway(addrs[cond], prompts, max_tokens=max_tokens, speculation=True)
            n = sum(x["tokens"] for x in rows)
            runs.append({"round": r, "tracing": cond, "tokens": n,
                         "tok_s": n / sum(x["latency_s"] for x in rows),
                         "tau": float(np.mean([x["tau"] for x in rows])),
                         "wall_s": time.monotonic() - t0, "phoenix_cpu_s": phoenix_cpu_s() - cpu0})
            tokens.setdefault(cond, []).append([x["token_ids"] for x in rows])
    tok = {c: [x["tok_s"] for x in runs if x["tracing"] == c] for c in ("ui", "off")}
    ratio = float(np.mean(tok["ui"]) / np.mean(tok["off"]))
    return {"runs": runs, "tok_s_ui": float(np.mean(tok["ui"])), "tok_s_off": float(np.mean(tok["off"])),
            "ratio": ratio, "paired": [u / o for u, o in zip(tok["ui"], tok["off"])],
            "phoenix_cpu_share": {c: sum(x["phoenix_cpu_s"] for x in runs if x["tracing"] == c)
                                  / max(1e-9, sum(x["wall_s"] for x in runs if x["tracing"] == c))
                                  for c in ("ui", "off")},
            "spread_ui": _spread(tok["ui"]), "spread_off": _spread(tok["off"]),
            "same_tokens": all(t == tokens["off"][0] for c in tokens for t in tokens[c]),
            "target": OVERHEAD_TARGET, "ok": ratio >= OVERHEAD_TARGET}


# ---- (c) dflash top at 1 Hz against a loaded stack ---------------------------------------


def _top_worker(endpoints: list[str], interval_s: float, log: str, marks: str) -> None:
    """``dflash top``'s live view (top.run) in its own process, drawn as on a terminal into
    ``log``; one line per refresh in ``marks``: wall time, rows shown, endpoints down."""
    from rich.console import Console

    from dflash_app import top

    with open(log, "w") as f, open(marks, "w", buffering=1) as m:
        console = Console(file=f, force_terminal=True, width=200, color_system="standard")
        top.run(endpoints, interval_s, console=console,
                on_frame=lambda fr: m.write(f"{time.time()} {len(fr.rows)} {len(fr.down)}\n"))


class TopProcess:
    """A context: top refreshing from entry (after its first three frames: its start-up is not
    part of the load) until exit (SIGINT, its Ctrl-C); ``marks``: [(time, rows, down)] of every
    refresh."""

    def __init__(self, endpoints: list[str], interval_s: float, run_dir: Path, tag: str):
        self.args = (endpoints, interval_s, str(run_dir / f"top-{tag}.log"), str(run_dir / f"top-{tag}.marks"))
        self.marks: list[tuple[float, int, int]] = []

    def _read(self) -> list[tuple[float, int, int]]:
        p = Path(self.args[3])
        lines = p.read_text().splitlines() if p.exists() else []
        return [(float(t), int(r), int(d)) for t, r, d in (ln.split() for ln in lines if ln.count(" ") == 2)]

    def __enter__(self) -> "TopProcess":
        self.proc = multiprocessing.get_context("spawn").Process(target=_top_worker, args=self.args)
        self.proc.start()
        deadline = time.monotonic() + 60
        while len(self._read()) < 3:
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"dflash top did not refresh (log {self.args[2]})")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGINT)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
        self.marks = self._read()


def _load(addr: str, prompts, a, requests_per_client: int | None = None) -> dict:
    x = run_level(addr, prompts, concurrency=a.clients, max_tokens=a.max_tokens, mode="",
                  requests_per_client=requests_per_client or a.requests_per_client)
    x.pop("per_position")
    return x


def top_overhead(addr: str, endpoints: list[str], prompts, a, run_dir: Path) -> dict:
    """ABBA rounds of ``a.clients`` clients, without and with top; see the module docstring.
    Refresh figures use each top's frames after its first (whose interval includes rich's
    first render)."""
    runs, steady = [], []
    _load(addr, prompts, a, requests_per_client=1)      # warm-up, not recorded
    for r in range(a.rounds):
        for with_top in ((False, True) if r % 2 == 0 else (True, False)):
            if not with_top:
                runs.append({"round": r, "top": False, **_load(addr, prompts, a)})
                continue
            with TopProcess(endpoints, a.top_interval, run_dir, f"r{r}") as top:
                t0 = time.time()
                x = _load(addr, prompts, a)
                t1 = time.time()
            marks = top.marks[1:]
            steady.append(marks)
            runs.append({"round": r, "top": True, **x,
                         "top_frames_under_load": sum(t0 <= m[0] <= t1 for m in marks)})
    off = [x["agg_tok_s"] for x in runs if not x["top"]]
    on = [x["agg_tok_s"] for x in runs if x["top"]]
    ratio, spread = float(np.mean(on) / np.mean(off)), _spread(off)
    gaps = [float(g) for marks in steady for g in np.diff([m[0] for m in marks])]
    med = float(np.median(gaps)) if gaps else None
    frames = [m for marks in steady for m in marks]
    return {"runs": runs, "tok_s_top": float(np.mean(on)), "tok_s_no_top": float(np.mean(off)),
            "ratio": ratio, "spread_no_top": spread, "spread_top": _spread(on),
            "paired": [o / f for o, f in zip(on, off)], "ok": ratio >= 1.0 - spread,
            "refresh": {"frames": len(frames), "interval_s": a.top_interval, "median_s": med,
                        "max_s": max(gaps) if gaps else None,
                        "frames_under_load": sum(x.get("top_frames_under_load", 0) for x in runs),
                        "saw_stack": bool(frames) and all(rows > 0 and down == 0 for _, rows, down in frames),
                        "ok": med is not None and abs(med - a.top_interval) <= 0.1 * a.top_interval}}


# ---- report ------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(res: dict) -> str:
    """The three targets, one line each, then the runs behind them."""
    c = res["config"]
    out = [f"# Observability targets ({c['target']}, drafter {c['drafter']})", "",
           f"{c['rounds']} interleaved rounds; batch-1: {c['prompts']} prompts x {c['max_tokens']} "
           f"tokens; load: {c['clients']} clients x {c['requests_per_client']} requests; "
           f"{c['host']['cpus']} CPUs ({c['host']['machine']}); commit {c['commit']}.", "",
           "| target | measured | verdict |", "|---|---|---|"]
    tr, ov, tp = res["trace_ui"], res["tracing_overhead"], res["top_overhead"]
    if "skipped" in tr:
        out.append(f"| trace in the UI <= {TRACE_TARGET_S:.0f} s | skipped: {tr['skipped']} | - |")
    else:
        got = (f"{tr['visible_s']:.2f} s (looked whole at {tr['first_whole_s']:.2f} s with "
               f"{tr['spans_when_first_whole']} spans)" if tr["visible_s"] is not None
               else f"not seen (missing {', '.join(tr['missing'])})")
        out.append(f"| trace in the UI <= {TRACE_TARGET_S:.0f} s, all three services | {got}; "
                   f"{tr['spans']} spans {tr['spans_by_service']} | {_verdict(tr['ok'])} |")
    if "skipped" in ov:
        out.append(f"| batch-1 tok/s traced >= {OVERHEAD_TARGET}x off | skipped: {ov['skipped']} | - |")
    else:
        out.append(f"| batch-1 tok/s traced >= {OVERHEAD_TARGET}x off | {ov['ratio']:.3f}x "
                   f"({ov['tok_s_ui']:.1f} / {ov['tok_s_off']:.1f}; spread ±{100 * ov['spread_off']:.1f}% off, "
                   f"±{100 * ov['spread_ui']:.1f}% traced; same tokens: {ov['same_tokens']}; Phoenix used "
                   f"{100 * ov['phoenix_cpu_share']['ui']:.0f}% of a core during traced runs, "
                   f"{100 * ov['phoenix_cpu_share']['off']:.0f}% during the others) | {_verdict(ov['ok'])} |")
    rf = tp["refresh"]
    med = f"{rf['median_s']:.3f}" if rf["median_s"] is not None else "-"
    out += [f"| {c['clients']} clients: tok/s with top not lower beyond the spread | {tp['ratio']:.3f}x "
            f"({tp['tok_s_top']:.1f} / {tp['tok_s_no_top']:.1f}; spread ±{100 * tp['spread_no_top']:.1f}% "
            f"without top) | {_verdict(tp['ok'])} |",
            f"| top refreshes every {rf['interval_s']:g} s | median {med} s, max "
            f"{rf['max_s'] or 0:.3f} s over {rf['frames']} frames ({rf['frames_under_load']} under load; "
            f"saw the stack: {rf['saw_stack']}) | {_verdict(rf['ok'])} |", ""]
    if "runs" in ov:
        out += ["Batch-1 runs (tok/s): " + ", ".join(
            f"r{x['round']} {x['tracing']} {x['tok_s']:.1f}" for x in ov["runs"]), ""]
    out += ["Load runs (aggregate tok/s): " + ", ".join(
        f"r{x['round']} {'top' if x['top'] else 'no top'} {x['agg_tok_s']:.1f}" for x in tp["runs"]), ""]
    return "\n".join(out)


# ---- main --------------------------------------------------------------------------------


def _stack_args(target: str, drafter: str, run_dir: Path) -> tuple[list[str], str, str]:
    """``dflash up --traces-ui`` flags on free ports; its gateway and UI addresses."""
    gw, ver, dr, ui, otlp = free_ports(5)
    args = ["--target", target, "--drafter", drafter, "--gateway-port", str(gw),
            "--verifier-port", str(ver), "--drafter-port", str(dr), "--http-port", "0",
            "--traces-ui", "--traces-ui-port", str(ui), "--traces-ui-otlp-port", str(otlp),
            "--run-dir", str(run_dir)]
    return args, f"127.0.0.1:{gw}", f"http://127.0.0.1:{ui}"


def _off_stack(target: str, drafter: str, run_dir: Path) -> LocalStack:
    """The tracing-off twin, with /metrics on free ports for top (unscraped during (b))."""
    gw, ver, dr, mg, mv, md = free_ports(6)
    return LocalStack(StackConfig(target=target, drafters=[DrafterSpec(path=drafter, port=dr)],
                                  gateway_port=gw, verifier_port=ver, run_dir=str(run_dir),
                                  metrics_ports={"gateway": mg, "verifier": mv, "drafter0": md}))


def run_all(a, prompts, run_dir: Path) -> dict:
    chat = [m for _, m in prompts]
    prompt = chat[0][0]["content"]
    skip = None if find_phoenix() else "Arize Phoenix is not installed (run scripts/setup_traces.sh)"
    res: dict = {"trace_ui": {"skipped": skip}, "tracing_overhead": {"skipped": skip}}
    if skip:
        print(f"(a) and (b) skipped: {skip}", file=sys.stderr, flush=True)
    up = None
    try:
        if skip is None:    # (a) first: the stack and its Phoenix project are fresh
            args, gw_ui, ui = _stack_args(a.target, a.drafter, run_dir / "ui")
            t0 = time.monotonic()
            up = UpProcess(args)
            up.wait_ready(900)
            up_s = time.monotonic() - t0
            print(f"dflash up --traces-ui ready in {up_s:.1f} s; UI {ui}", flush=True)
            res["trace_ui"] = {"up_s": up_s, **measure_trace(ui, gw_ui, prompt, a.max_tokens)}
            print(f"(a) {res['trace_ui']}", flush=True)
        with _off_stack(a.target, a.drafter, run_dir / "off") as off:
            run_gateway(off.gateway_addr, prompts[:1], max_tokens=a.max_tokens, speculation=True)  # warm-up
            if up is not None:
                res["tracing_overhead"] = tracing_overhead(
                    {"ui": gw_ui, "off": off.gateway_addr}, prompts, a.rounds, a.max_tokens)
                print(f"(b) ratio {res['tracing_overhead']['ratio']:.3f}", flush=True)
                up.stop()       # off the cores before (c)
                up = None
            endpoints = [f"127.0.0.1:{p}" for p in off.cfg.metrics_ports.values()]
            res["top_overhead"] = top_overhead(off.gateway_addr, endpoints, prompts, a, run_dir)
            print(f"(c) ratio {res['top_overhead']['ratio']:.3f}", flush=True)
    finally:
        if up is not None:
            up.stop()
    return res


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for observability.json / .md")
    p.add_argument("--target", help="target model dir (default: SmolLM2-135M-Instruct, set up on demand)")
    p.add_argument("--drafter", help="drafter dir (default: models/smollm2-dflash-b16)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random-weight models and small settings (a smoke run, no figures)")
    p.add_argument("--rounds", type=_positive, help="interleaved rounds per comparison (5; --tiny 2)")
    p.add_argument("--prompts", type=_positive, help="batch-1 chat prompts per run (4; --tiny 1)")
    p.add_argument("--max-tokens", type=_positive, help="completion tokens per request (128; --tiny 16)")
    p.add_argument("--clients", type=_positive, default=16, help="concurrent clients for (c)")
    p.add_argument("--requests-per-client", type=_positive, help="requests per client per run (2; --tiny 1)")
    p.add_argument("--top-interval", type=float, default=1.0, help="dflash top's refresh period, s")
    p.add_argument("--run-dir", help="service logs, Phoenix data, top's output (default: a temp dir)")
    a = p.parse_args(argv)
    for k, full, tiny in (("rounds", 5, 2), ("prompts", 4, 1), ("max_tokens", 128, 16),
                          ("requests_per_client", 2, 1)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    if not a.top_interval > 0:
        p.error(f"--top-interval: must be > 0, got {a.top_interval}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from dflash_app.stack import DEFAULT_DRAFTER, tiny_models

    if a.tiny and not a.target:
        a.target, a.drafter = tiny_models()
    if not a.target:
        from dflash.train.target_setup import setup_target
        a.target = str(setup_target())
    # absolute: the services and `dflash up` resolve them from their own working directories
    a.target, a.drafter = (str(Path(x).resolve()) for x in (a.target, a.drafter or DEFAULT_DRAFTER))
    for k in TRACE_VARS:        # tracing off means off; the traced stack gets its own
        os.environ.pop(k, None)
    os.environ["DFLASH_SUFFIX_ANSWER_TOKENS"] = "0"
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="bench-observability-"))
    prompts = prompt_set("chat", a.prompts)
    res = run_all(a, prompts, run_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    res["config"] = {"target": a.target, "drafter": a.drafter, "tiny": a.tiny, "rounds": a.rounds,
                     "prompts": a.prompts, "max_tokens": a.max_tokens, "clients": a.clients,
                     "requests_per_client": a.requests_per_client, "top_interval_s": a.top_interval,
                     "commit": commit, "run_dir": str(run_dir),
                     "host": {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "observability.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "observability.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
