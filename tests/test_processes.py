"""End to end with separate processes: `dflash up` (drafter, verifier, gateway, its HTTP API on
a free port), `dflash generate`, health checking, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from dflash.serving.server import wait_healthy

from helpers import free_ports, health, wait_until


@pytest.mark.slow
def test_dflash_up_generate_and_clean_stop(tmp_path, tiny_target, make_drafter, hf_target, tokenizer):
    # every port free, the HTTP API's too: `dflash up` alone would take 8000
    gw, ver, dr, http = free_ports(4)
    env = {**os.environ, "DFLASH_LOG_LEVEL": "INFO"}
    up = subprocess.Popen(
        [sys.executable, "-m", "dflash_app.cli", "up", "--target", str(tiny_target),
         "--drafter", str(make_drafter(block_size=8)), "--gateway-port", str(gw),
         "--verifier-port", str(ver), "--drafter-port", str(dr), "--http-port", str(http),
         "--run-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert wait_healthy(f"127.0.0.1:{gw}", 120), up.stdout.read() if up.poll() is not None else "timeout"
        printed = []
        while not printed or not printed[-1].startswith("logs in"):   # the summary `up` prints
            line = up.stdout.readline()
            assert line, "".join(printed)
            printed.append(line)
        url = f"http://127.0.0.1:{http}/v1"
        assert any(line.split()[:3] == ["HTTP", "API", url] for line in printed), "".join(printed)
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == Path(tiny_target).name   # --served-model-name
        for addr, svc in ((f"127.0.0.1:{ver}", "dflash.v1.Verifier"),
                          (f"127.0.0.1:{dr}", "dflash.v1.Drafter"),
                          (f"127.0.0.1:{gw}", "dflash.v1.Gateway")):
            assert health(addr, svc) == health_pb2.HealthCheckResponse.SERVING
        out = subprocess.run(
            [sys.executable, "-m", "dflash_app.cli", "generate", "Hello", "--raw", "--max-tokens", "20",
             "--gateway", f"127.0.0.1:{gw}"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert "tau" in out.stderr and "tiny-drafter@1" in out.stderr
        import torch

        ids = tokenizer.encode("Hello")
        want = hf_target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):]
        assert out.stdout.rstrip("\n") == tokenizer.decode(want, skip_special_tokens=True)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert set(logs) == {"drafter0.log", "verifier.log", "gateway.log"}
    for name, text in logs.items():
        assert "stopped" in text, f"{name} did not drain and stop:\n{text[-2000:]}"
    for port in (gw, ver, dr):  # every service is gone
        with pytest.raises(grpc.RpcError):
            health(f"127.0.0.1:{port}")
    with pytest.raises(urllib.error.URLError):   # the HTTP API with its gateway
        urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5)


@pytest.mark.slow
def test_verifier_not_serving_until_loaded_and_drains_on_sigterm(tmp_path, tiny_target):
    (port,) = free_ports(1)
    p = subprocess.Popen([sys.executable, "-m", "verifier_svc", "--target", str(tiny_target),
                          "--bind", f"127.0.0.1:{port}", "--grace", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses = []

        def serving():
            try:
                statuses.append(health(f"127.0.0.1:{port}"))
            except grpc.RpcError:
                return False
            return statuses[-1] == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, 120, lambda: f"the verifier to serve (statuses so far {statuses[-3:]})",
                   interval=0.05)
        assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING  # answered while loading
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert "NOT_SERVING, draining" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()


_OWNER = """
import sys, time
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig
target, drafter, run_dir, gw, ver, dr = sys.argv[1:]
cfg = StackConfig(target=target, drafters=[DrafterSpec(path=drafter, port=int(dr))],
                  gateway_port=int(gw), verifier_port=int(ver), run_dir=run_dir)
stack = LocalStack(cfg).start()
try:
    print("PIDS", *[p.pid for p in stack.procs.values()], flush=True)
    # short sleeps, as an owner doing work returns to Python often: the kernel may deliver the
    # SIGTERM to a gRPC thread, and the handler then runs when the main thread next runs Python
    for _ in range(3000):
        time.sleep(0.2)
finally:
    stack.stop()
"""


@pytest.mark.slow
def test_owner_killed_by_sigterm_stops_the_stack(tmp_path, tiny_target, make_drafter):
    """`timeout dflash bench --start` sends SIGTERM to the owner only (the services run in their
    own sessions): the owner must unwind and stop them, not orphan them."""
    gw, ver, dr = free_ports(3)
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tiny_target), str(make_drafter(block_size=8)),
         str(tmp_path / "logs"), str(gw), str(ver), str(dr)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = owner.stdout.readline()
        while line and not line.startswith("PIDS"):
            line = owner.stdout.readline()
        assert line.startswith("PIDS"), owner.stdout.read()
        pids = [int(x) for x in line.split()[1:]]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(60) == 128 + signal.SIGTERM
    finally:
        if owner.poll() is None:
            owner.kill()
    try:
        wait_until(lambda: not any(_alive(p) for p in pids), 30,
                   "the services to stop with their owner (orphans: they outlived it)", interval=0.2)
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    for name, text in logs.items():
        assert "stopped" in text, f"{name} did not drain and stop:\n{text[-2000:]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a reaped child is gone; an unreaped zombie of the (dead) owner is re-parented and reaped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
