"""The health-only listener (``--health-bind``) as a child process with its own interpreter.

In the service's own process a health check waits for the interpreter lock and the CPU share
that a flood of streams and the decode loop compete for, so a check can stall for hundreds of
milliseconds (``docs/robustness.md`` has the measurements). The listener that probes use
(kubelet's gRPC probes, ``deploy/k8s``) therefore runs here, in a process that serves health and
nothing else.

The service mirrors its status into the child (:meth:`HealthProcess.set`, one JSON line per
change on the child's stdin) and sends a heartbeat every ``heartbeat_s``. The child reports
what it was told, except:

* no line for ``stale_s`` seconds (the service is frozen: stopped, or its interpreter wedged):
  every name NOT_SERVING until lines arrive again;
* its stdin closes (the service stopped or died, even by SIGKILL): it stops and exits. It
  ignores SIGINT and SIGTERM, which a terminal or a process group sends to both: its end is
  the service's.

A child that dies is started again on the same port by the heartbeat thread.

``python -m dflash.serving.health_process --bind HOST:PORT`` is the child; it prints
``port N`` once it listens (``error: ...`` and exit code 2 when it cannot bind).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dflash.serving.argtypes import split_host_port
from dflash.serving.server import BindError, bind_port

log = logging.getLogger("dflash.serving.health_process")

HEARTBEAT_S = 0.5     # how often the service says it is alive
STALE_S = 10.0        # silence after which the child reports NOT_SERVING: far above a busy
                      # service's pauses, while a frozen one is silent for good
START_TIMEOUT_S = 30.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthProcess:
    """Parent side: spawns the child at ``bind`` now (so a bad address fails at start), mirrors
    statuses into it, heartbeats once :meth:`start` is called, ends it on :meth:`stop`.

    Duck-compatible with the ``grpc.Server`` calls :func:`dflash.serving.server.tie_server`
    makes (``start()``, ``stop(grace)``).

    Args:
        bind: host:port; port 0 = any free port (:attr:`port` is the one bound; a restarted
            child binds that same port).
        heartbeat_s / stale_s: seconds; see the module docstring.

    Raises:
        dflash.serving.server.BindError: ``bind`` is not HOST:PORT, or the child could not
            listen there (``--health-bind: cannot bind ...``).
        RuntimeError: the child did not start within ``START_TIMEOUT_S``.
    """

    def __init__(self, bind: str, *, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        try:
            self.host, _ = split_host_port(bind)
        except ValueError as e:
            raise BindError(f"--health-bind: {e}") from None
        self._statuses: dict[str, int] = {"": NOT_SERVING}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self.proc, self.port = self._spawn(bind)

    def _spawn(self, bind: str) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash.serving.health_process", "--bind", bind,
             "--stale-s", str(self.stale_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        out = proc.stdout
        assert out is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        first = line[0].strip() if line else ""
        if not first.startswith("port "):
            proc.kill()
            proc.wait()
            if first.startswith("error"):
                raise BindError(f"--health-bind: cannot bind {bind}")
            raise RuntimeError(f"--health-bind: the health process did not start ({first!r})")
        return proc, int(first.split()[1])

    def set(self, name: str, status: int) -> None:
        """Mirror ``name``'s status (a ``HealthCheckResponse.ServingStatus``) into the child."""
        with self._lock:
            self._statuses[name] = status
            self._send_locked({"set": {name: status}})

    def _send_locked(self, msg: dict) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False             # the child is gone: the heartbeat thread restarts it

    def start(self) -> None:
        """Start heartbeats (and restarts of a dead child)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="health-process")
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self.proc.poll() is None and self._send_locked({"beat": 1}):
                    continue
                if self._stop.is_set():
                    return
                log.warning("health process exited (code %s): starting it again on port %d",
                            self.proc.poll(), self.port)
                try:
                    self.proc.kill()
                    self.proc.wait()
                    self.proc, _ = self._spawn(f"{self.host}:{self.port}")
                except (RuntimeError, OSError) as e:
                    log.error("health process restart failed: %s", e)
                    continue
                self.restarts += 1
                self._send_locked({"set": dict(self._statuses)})

    def stop(self, grace: float | None = 0) -> None:
        """End the child (its stdin closes; it stops listening and exits)."""
        self._stop.set()
        with self._lock:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve(bind: str, stale_s: float) -> int:
    """The child: listen on ``bind``, apply status lines from stdin until it closes."""
    # A terminal's Ctrl-C and a group's SIGTERM (systemd, a container runtime) are the service's
    # to handle: it drains with health NOT_SERVING, then closes our stdin, which ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # no SO_REUSEPORT: a port another process listens on is an error, not a shared port
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    try:
        port = bind_port(server, bind)
    except BindError as e:
        print(f"error: {e}", flush=True)
        return 2
    told: dict[str, int] = {"": NOT_SERVING}
    hs.set("", NOT_SERVING)
    server.start()
    print(f"port {port}", flush=True)
    last = [time.monotonic()]
    stale = [False]
    lock = threading.Lock()

    def watchdog() -> None:
        while True:
            time.sleep(min(0.25, stale_s / 4))
            with lock:
                if not stale[0] and time.monotonic() - last[0] > stale_s:
                    stale[0] = True
                    for name in told:
                        hs.set(name, NOT_SERVING)

    threading.Thread(target=watchdog, daemon=True).start()
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        with lock:
            last[0] = time.monotonic()
            told.update({str(k): int(v) for k, v in msg.get("set", {}).items()})
            if stale[0] or "set" in msg:
                stale[0] = False
                for name, status in told.items():
                    hs.set(name, status)
    server.stop(0).wait()
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.serving.health_process",
                                description="(internal) the health-only listener of a service")
    p.add_argument("--bind", required=True)
    p.add_argument("--stale-s", type=float, default=STALE_S)
    a = p.parse_args(argv)
    sys.exit(_serve(a.bind, a.stale_s))


if __name__ == "__main__":
    main()
