"""``--health-bind``: a plaintext health-only listener beside a service port that requires mTLS
(kubelet's gRPC probes cannot present client certificates)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.serving.health_process import HealthProcess
from dflash.serving.server import add_health_listener, create_server
from dflash.serving.tls import ServerTLS, TLSFiles, make_dev_certs

from helpers import wait_until


def status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def test_health_only_listener_follows_the_service_and_serves_nothing_else(tmp_path):
    certs = make_dev_certs(tmp_path, ["localhost", "127.0.0.1"])
    tls = ServerTLS(TLSFiles(cert=str(certs["verifier"][0]), key=str(certs["verifier"][1]),
                             ca=str(certs["ca"][0])))
    rt = create_server("127.0.0.1:0", lambda s: None, ("dflash.v1.Verifier",), tls=tls)
    port = add_health_listener(rt, "127.0.0.1:0")
    assert add_health_listener(rt, "") is None
    rt.server.start()
    try:
        assert status(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        rt.set_serving(True)
        assert status(port) == health_pb2.HealthCheckResponse.SERVING
        # the service port itself refuses a plaintext client
        with pytest.raises(grpc.RpcError):
            status(rt.port)
        # nothing but health on the listener (no reflection, no service)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/dflash.v1.Verifier/Describe")(b"", timeout=2)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        rt.server.stop(0).wait()
    # stopped with the service
    with pytest.raises(grpc.RpcError):
        status(port)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status_or_none(port: int):
    try:
        return status(port)
    except grpc.RpcError:
        return None


def test_the_listener_is_its_own_process_and_goes_not_serving_when_the_service_is_silent():
    """No line from the service for ``stale_s`` (frozen: SIGSTOP, a wedged interpreter) reads
    NOT_SERVING; the next line brings the mirrored status back; heartbeats keep it."""
    import os

    # stale_s 1.0: 20 beats of 0.05 s; at 0.4 one stall of the test process (CI, two cores)
    # read as silence
    child = HealthProcess("127.0.0.1:0", heartbeat_s=60, stale_s=1.0)    # no beat in time
    try:
        assert child.proc.pid != os.getpid() and child.proc.poll() is None
        child.set("", SERVING)
        child.set("dflash.v1.Verifier", SERVING)
        # set() writes a line and returns: the child reads it when it gets the CPU
        wait_until(lambda: status(child.port) == SERVING, 5, "SERVING mirrored")
        wait_until(lambda: status(child.port) == NOT_SERVING, 5, "NOT_SERVING after silence")
        # a line brings it back for stale_s: each try sends one, so a slow poll cannot miss it
        wait_until(lambda: (child.set("", SERVING), status(child.port) == SERVING)[1], 5,
                   "SERVING after the next line")
    finally:
        child.stop()
    beating = HealthProcess("127.0.0.1:0", heartbeat_s=0.05, stale_s=1.0)
    try:
        beating.set("", SERVING)
        beating.start()
        deadline = time.monotonic() + 3.0       # three times stale_s: only beats keep it up
        while time.monotonic() < deadline:   # the behaviour under test is "stays SERVING"
            assert status(beating.port) == SERVING
            time.sleep(0.05)
    finally:
        beating.stop()
    assert status_or_none(beating.port) is None


def test_the_child_exits_when_its_service_is_killed(tmp_path):
    """SIGKILL of the service closes the child's stdin: it stops listening and exits."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from dflash.serving.health_process import HealthProcess\n"
            "c = HealthProcess('127.0.0.1:0'); c.set('', 1); c.start()\n"
            "print(c.port, c.proc.pid, flush=True); time.sleep(600)\n")
    service = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port, child_pid = map(int, service.stdout.readline().split())
        assert status(port) == SERVING
        service.send_signal(signal.SIGKILL)
        service.wait()
        wait_until(lambda: status_or_none(port) is None, 10, "the orphaned listener to close")
        wait_until(lambda: not _alive(child_pid), 10, "the child to exit")
    finally:
        service.kill()


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        return not Path(f"/proc/{pid}/status").read_text().split("State:")[1].strip().startswith("Z")
    except (OSError, IndexError):
        return False


def test_a_dead_child_is_started_again_on_its_port_with_the_status():
    child = HealthProcess("127.0.0.1:0", heartbeat_s=0.05)
    try:
        child.set("", SERVING)
        child.start()
        first = child.proc.pid
        child.proc.kill()
        wait_until(lambda: child.restarts == 1 and status_or_none(child.port) == SERVING, 10,
                   "the restarted listener")
        assert child.proc.pid != first
    finally:
        child.stop()


def test_a_port_in_use_is_refused_naming_the_flag():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="--health-bind: cannot bind"):
            HealthProcess(f"127.0.0.1:{s.getsockname()[1]}")


@pytest.mark.parametrize("bind", ["127.0.0.1:99999", "127.0.0.1", "127.0.0.1:x", ":80"])
def test_a_bind_that_is_not_host_port_is_refused_before_anything_starts(bind):
    with pytest.raises(RuntimeError, match="--health-bind: .* not HOST:PORT"):
        HealthProcess(bind)


def test_the_child_outlives_a_group_sigterm_until_its_service_lets_it_go():
    """SIGTERM to the whole process group (systemd, a container runtime) reaches the child as
    well as the service: the child keeps answering (the service drains with NOT_SERVING) and is
    not restarted; it ends when the service stops it."""
    import signal

    child = HealthProcess("127.0.0.1:0", heartbeat_s=0.05)
    try:
        child.set("", NOT_SERVING)          # draining
        child.start()
        child.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)                     # the behaviour under test is "nothing happens"
        assert child.proc.poll() is None and child.restarts == 0
        assert status(child.port) == NOT_SERVING
    finally:
        child.stop()
    assert child.proc.poll() is not None and status_or_none(child.port) is None


@pytest.mark.parametrize("service", ["gateway", "verifier_svc", "drafter_svc"])
def test_each_service_refuses_a_bad_health_bind_before_loading(service):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", service, "--target", "nowhere", "--drafter", "nowhere",
                        "--verifier", "nowhere", "--health-bind", "127.0.0.1:99999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--health-bind: '127.0.0.1:99999' is not HOST:PORT" in r.stderr
