"""``dflash up --traces-ui`` without Phoenix itself: finding it, the environment the services
get, the UI process's lifecycle (a stand-in ``phoenix`` that serves /healthz), its failures, and
the launcher starting sidecars before the services and stopping them after."""

from __future__ import annotations

import os
import stat
import sys
import urllib.error
import urllib.request

import pytest

from dflash_app import traces_ui
from dflash_app.launcher import LaunchError, LocalStack, StackConfig
from dflash_app.traces_ui import TracesUI, find_phoenix

from helpers import free_ports

# A `phoenix serve` stand-in: answers /healthz on PHOENIX_HOST:PHOENIX_PORT like Phoenix does.
FAKE_UI = f"""#!{sys.executable}
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer((os.environ["PHOENIX_HOST"], int(os.environ["PHOENIX_PORT"])), H).serve_forever()
"""


def get(url: str):
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5)


def executable(path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_find_phoenix_prefers_the_variable_then_the_venv(tmp_path, monkeypatch):
    exe = executable(tmp_path / "phoenix", "#!/bin/sh\n")
    assert find_phoenix({"DFLASH_PHOENIX": exe}) == exe
    monkeypatch.setattr(traces_ui, "VENV", tmp_path / "none")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_phoenix({}) is None
    with pytest.raises(SystemExit, match="scripts/setup_traces.sh"):
        TracesUI.from_env(tmp_path)


def test_services_export_to_the_ui_in_its_project(tmp_path):
    ui = TracesUI("phoenix", tmp_path, port=7006, otlp_port=7317)
    env = ui.env({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=dev"})
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:7317"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == ("deployment.environment=dev,"
                                               f"openinference.project.name={traces_ui.PROJECT}")
    assert env["OTEL_BSP_SCHEDULE_DELAY"] == traces_ui.EXPORT_DELAY_MS
    assert ui.env({"OTEL_BSP_SCHEDULE_DELAY": "200"})["OTEL_BSP_SCHEDULE_DELAY"] == "200"  # the user's wins
    assert env["DFLASH_TRACE_STEPS"] == traces_ui.TRACE_STEPS == "every:8"        # sampled steps ...
    assert ui.env({"DFLASH_TRACE_STEPS": "all"})["DFLASH_TRACE_STEPS"] == "all"   # ... unless asked
    assert ui.trace_url("ab" * 16) == f"http://127.0.0.1:7006/redirects/traces/{'ab' * 16}"


def test_ui_process_starts_healthy_and_stops(tmp_path):
    (port,) = free_ports(1)
    ui = TracesUI(executable(tmp_path / "phoenix", FAKE_UI), tmp_path / "run", port=port)
    ui.start()
    try:
        with get(ui.url + "/healthz") as r:
            assert r.status == 200
        assert (tmp_path / "run" / "phoenix").is_dir()      # its working directory
    finally:
        ui.stop()
    assert ui.proc is None
    with pytest.raises(urllib.error.URLError):
        get(ui.url + "/healthz")
    ui.stop()   # idempotent


def test_ui_runs_niced_by_default_and_at_normal_priority_on_request(tmp_path):
    """Phoenix's span ingest shares the services' cores under `dflash up`: niced by default
    (the process, not only a wrapper: ``nice`` execs it), as asked with 0, refused out of range."""
    (port,) = free_ports(1)
    ui = TracesUI(executable(tmp_path / "phoenix", FAKE_UI), tmp_path / "run", port=port)
    assert ui.nice == traces_ui.DEFAULT_NICE == 19
    ui.start()
    try:
        assert os.getpriority(os.PRIO_PROCESS, ui.proc.pid) == min(19, os.nice(0) + 19)
    finally:
        ui.stop()
    assert TracesUI("phoenix", tmp_path, nice=0).command() == ["phoenix", "serve"]
    with pytest.raises(ValueError, match="--traces-ui-nice"):
        TracesUI("phoenix", tmp_path, nice=20)


def test_ui_that_exits_fails_the_launch_with_its_log(tmp_path):
    ui = TracesUI(executable(tmp_path / "phoenix", "#!/bin/sh\necho 'no database'\nexit 3\n"),
                  tmp_path / "run", port=free_ports(1)[0])
    with pytest.raises(LaunchError, match=r"(?s)exited with code 3.*no database"):
        ui.start()


class Recorder:
    """A sidecar that records what the stack did with it."""

    def __init__(self, log: list, fail: bool = False):
        self.log, self.fail = log, fail

    def start(self):
        self.log.append("start")
        if self.fail:
            raise LaunchError("sidecar down")

    def env(self):
        return {"SIDECAR": "1"}

    def describe(self):
        return "recorder"

    def stop(self):
        self.log.append("stop")


def test_a_sidecar_that_fails_stops_the_launch_before_any_service(tmp_path):
    log: list = []
    cfg = StackConfig(target=str(tmp_path / "none"), drafters=[], run_dir=str(tmp_path))
    stack = LocalStack(cfg, sidecars=[Recorder(log, fail=True)])
    with pytest.raises(LaunchError, match="sidecar down"):
        stack.start()
    assert stack.procs == {} and log == ["start", "stop"]
    assert not os.listdir(tmp_path)    # no service log: nothing was spawned
