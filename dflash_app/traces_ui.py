"""``dflash up --traces-ui``: a real OTLP trace UI (Arize Phoenix) beside the local stack.

Phoenix (``arize-phoenix`` from PyPI: OTLP over gRPC and HTTP, a web UI, SQLite in its working
directory) runs as its own process from its own virtualenv, ``.venv-traces``
(``scripts/setup_traces.sh``, pins in constraints-traces.txt): its dependency tree (pandas,
pyarrow, SQLAlchemy, strawberry, provider SDKs) is several times the services' and moves on its
own schedule, so it never shares the services' pinned environment. It starts before the
services (their exporters point at it from their first span) and stops after them (their last
spans are flushed on SIGTERM).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from dflash_app.launcher import LaunchError
from dflash_app.local_prometheus import http_ok

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-traces"
PROJECT = "dflash-serve"        # the Phoenix project the services' spans land in
# The spans one request's trace holds, one or more per process (docs/observability.md, Traces)
TRACE_SPANS = ("/dflash.v1.Gateway/Generate", "/dflash.v1.Verifier/Generate", "verifier.decode",
               "drafter.draft")
# The SDK's batch delay is 5 s by default; 1 s keeps a finished request's trace visible within
# the 5 s target, at one export per second per service.
EXPORT_DELAY_MS = "1000"
# Step spans with the UI attached: every 8th decode step of a request (and every step that fell
# back) instead of all of them. With every step, one 128-token request is ~155 spans and batch-1
# serving ran at 0.86x tracing off on two shared cores, Phoenix niced (docs/observability.md);
# DFLASH_TRACE_STEPS=all in the environment still asks for every step.
TRACE_STEPS = "every:8"
# Phoenix's niceness: on the cores the services share (one machine, `dflash up`), its span
# ingest (~150 spans a request) took ~18% of batch-1 tokens/s at the default priority
# (docs/observability.md, "The targets, measured"); niced, it runs in the cycles serving leaves.
DEFAULT_NICE = 19

INSTALL_HINT = """\
--traces-ui needs Arize Phoenix (`phoenix`), and none was found in .venv-traces or on PATH.
Install it into its own virtualenv (a few minutes, from PyPI), then run the command again:
  scripts/setup_traces.sh
Or point DFLASH_PHOENIX at a `phoenix` executable."""


def find_phoenix(env: Mapping[str, str] = os.environ) -> str | None:
    """The ``phoenix`` executable: ``DFLASH_PHOENIX``, else ``.venv-traces/bin/phoenix``, else
    PATH; None when there is none."""
    for candidate in (env.get("DFLASH_PHOENIX"), str(VENV / "bin" / "phoenix")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("phoenix")


class TracesUI:
    """One Phoenix process: web UI on ``host:port``, OTLP/gRPC on ``host:otlp_port``; data in
    ``run_dir/phoenix``. A launcher sidecar (:class:`dflash_app.launcher.Sidecar`)."""

    def __init__(self, binary: str, run_dir: str | Path, *, host: str = "127.0.0.1",
                 port: int = 6006, otlp_port: int = 4317, timeout_s: float = 120.0,
                 nice: int = DEFAULT_NICE):
        if not 0 <= nice <= 19:
            raise ValueError(f"--traces-ui-nice: {nice} not in 0..19")
        self.binary, self.run_dir, self.host = binary, Path(run_dir), host
        self.port, self.otlp_port, self.timeout_s = port, otlp_port, timeout_s
        self.nice = nice
        self.proc: subprocess.Popen | None = None

    @classmethod
    def from_env(cls, run_dir: str | Path, **kw) -> "TracesUI":
        """Raises SystemExit with install instructions when Phoenix is not installed."""
        binary = find_phoenix()
        if binary is None:
            raise SystemExit(INSTALL_HINT)
        return cls(binary, run_dir, **kw)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def otlp_endpoint(self) -> str:
        return f"http://{self.host}:{self.otlp_port}"

    def trace_url(self, trace_id: str) -> str:
        """The UI page of one trace (32 hex digits): Phoenix's redirect to its project."""
        return f"{self.url}/redirects/traces/{trace_id}"

    def env(self, base: Mapping[str, str] = os.environ) -> dict[str, str]:
        """What each service's environment gets: its OTLP exporter aimed at this UI."""
        resource = f"openinference.project.name={PROJECT}"
        if base.get("OTEL_RESOURCE_ATTRIBUTES"):
            resource = base["OTEL_RESOURCE_ATTRIBUTES"] + "," + resource
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint,
                "OTEL_RESOURCE_ATTRIBUTES": resource,
                "OTEL_BSP_SCHEDULE_DELAY": base.get("OTEL_BSP_SCHEDULE_DELAY", EXPORT_DELAY_MS),
                "DFLASH_TRACE_STEPS": base.get("DFLASH_TRACE_STEPS", TRACE_STEPS)}

    def log_tail(self, lines: int = 30) -> str:
        path = self.run_dir / "phoenix.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def command(self) -> list[str]:
        """``phoenix serve``, under ``nice -n N`` when ``nice`` > 0 (nice execs it: one pid)."""
        return (["nice", "-n", str(self.nice)] if self.nice else []) + [self.binary, "serve"]

    def start(self) -> None:
        """Start Phoenix and wait until its ``/healthz`` answers. Raises LaunchError (with the
        tail of its log) when it exits or is not up within ``timeout_s``."""
        data = self.run_dir / "phoenix"
        data.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PHOENIX_HOST": self.host, "PHOENIX_PORT": str(self.port),
               "PHOENIX_GRPC_PORT": str(self.otlp_port), "PHOENIX_WORKING_DIR": str(data.resolve()),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        log = open(self.run_dir / "phoenix.log", "w")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while not http_ok(self.url + "/healthz"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                         else f"not up after {self.timeout_s:.0f} s")
                self.stop()
                raise LaunchError(f"phoenix {state}:\n{self.log_tail()}")
            time.sleep(0.25)

    def describe(self) -> str:
        return f"  traces UI {self.url}  (Phoenix; OTLP/gRPC {self.otlp_endpoint}, project {PROJECT})"

    def stop(self, grace_s: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def project_spans(url: str, project: str = PROJECT, **query) -> list[dict]:
    """Spans of ``project`` in the Phoenix at ``url`` matching ``query`` (the filters of its
    REST ``GET /v1/projects/{project}/spans``: ``trace_id``, ``name``, ...), every page; [] when
    the project has no span yet (404) or Phoenix does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    out: list[dict] = []
    cursor = None
    while True:
        q = {**query, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        try:
            with opener.open(f"{url}/v1/projects/{project}/spans?"
                             f"{urllib.parse.urlencode(q, doseq=True)}", timeout=5) as r:
                body = json.load(r)
        except (OSError, ValueError):
            return out
        out += body.get("data", [])
        cursor = body.get("next_cursor")
        if not cursor:
            return out


def missing_spans(spans: list[dict]) -> list[str]:
    """What one request's trace (Phoenix's span records) still lacks: each of
    :data:`TRACE_SPANS`, a GenAI span (``gen_ai.operation.name``), and the parent of any span
    whose parent has not arrived. [] when nothing is missing."""
    names = {s["name"] for s in spans}
    lack = [n for n in TRACE_SPANS if n not in names]
    if not any(s.get("attributes", {}).get("gen_ai.operation.name") for s in spans):
        lack.append("the GenAI span")
    ids = {s["context"]["span_id"] for s in spans}
    return lack + [f"parent of {s['name']}" for s in spans
                   if s.get("parent_id") and s["parent_id"] not in ids]
