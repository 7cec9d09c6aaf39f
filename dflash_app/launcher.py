"""Start drafter(s), verifier and gateway as separate local processes (``dflash up``).

The same topology as docker-compose.yml, without Docker: each service is its own
``python -m <service>`` process with flags, logs to ``<run_dir>/<name>.log``, and is health
checked through ``grpc.health.v1`` before the next one starts. A process that exits while
starting fails the launch at once with the tail of its log.

``StackConfig.verifiers`` > 1 (``dflash up --verifiers N``) runs N verifier replicas behind the
one gateway (given every verifier's address: ``gateway.replicas`` routes and fails over), each
with its own drafters, as a Kubernetes pool pod has them (deploy/k8s/overlays/pool). The gateway
names replica 0's drafter addresses; replica r's verifier dials its own drafters for those names
(``--drafter-alias``). The host's cores are split among the replicas: each replica's verifier and
drafters get ``--threads cores // N`` (they take turns within a step, so they share a share).
``StackConfig.verifier_args_per_replica`` gives each replica's verifier flags of its own (a bench
comparing two settings on one stack: ``scripts/bench_prefix_overhead.py``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dflash.serving.server import wait_healthy


class LaunchError(RuntimeError):
    pass


@dataclasses.dataclass(kw_only=True)
class DrafterSpec:
    path: str
    port: int
    name: str | None = None
    version: str | None = None


@dataclasses.dataclass(kw_only=True)
class StackConfig:
    """Everything ``dflash up`` needs; ports are on 127.0.0.1 unless ``host`` says otherwise."""

    target: str
    drafters: list[DrafterSpec]
    host: str = "127.0.0.1"
    gateway_port: int = 50050
    http_port: int = 0                 # the gateway's OpenAI-compatible HTTP API; 0 = off
    admin_port: int | None = None      # GatewayAdmin (loopback, no token); None: gateway_port + 10
    verifier_port: int = 50051
    dtype: str = "auto"               # each service's --dtype (dflash.core.device: auto = float32 on
                                      # a CPU, bfloat16 for a drafter on a CPU with bf16 instructions)
    run_dir: str = "runs/up"
    metrics_ports: dict[str, int] = dataclasses.field(default_factory=dict)
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    health_timeout_s: float = 600.0
    verifier_args: list[str] = dataclasses.field(default_factory=list)
    # more flags for one replica's verifier, after verifier_args: entry r for replica r (empty:
    # none; else one entry per replica), e.g. a bench comparing ``--prefix-cache on`` and ``off``
    verifier_args_per_replica: list[list[str]] = dataclasses.field(default_factory=list)
    gateway_args: list[str] = dataclasses.field(default_factory=list)
    # mTLS on every link with certificates made at start in <run_dir>/tls (dflash.serving.tls)
    tls: bool = False
    # verifier replicas behind the gateway (module docstring): replica r listens on
    # verifier_port + r and runs drafter i on drafters[i].port + r * len(drafters)
    verifiers: int = 1


def verifier_name(replica: int, replicas: int) -> str:
    """The process (and log file) name of verifier ``replica`` of ``replicas``: "verifier" when
    there is one, as before replicas, else "verifier0", "verifier1", ..."""
    return "verifier" if replicas == 1 else f"verifier{replica}"


def free_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive TCP ports free on ``host`` right now (a replica's ports
    are derived: verifier_port + r, drafter port + r). Raises LaunchError after 100 tries."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise LaunchError(f"no {n} consecutive free ports on {host}")


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count: a
    container or ``taskset`` may allow fewer)."""
    return len(os.sched_getaffinity(0))


class Sidecar(Protocol):
    """A process the stack's services use (a trace UI): started before them, its ``env()``
    added to theirs, stopped after them (``dflash_app.traces_ui.TracesUI``)."""

    def start(self) -> None: ...

    def env(self) -> dict[str, str]: ...

    def describe(self) -> str: ...

    def stop(self) -> None: ...


def _exit_on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class LocalStack:
    """Context manager owning the service processes."""

    def __init__(self, cfg: StackConfig, *, sidecars: Sequence[Sidecar] = ()):
        self.cfg = cfg
        self.sidecars = list(sidecars)
        self.procs: dict[str, subprocess.Popen] = {}
        self.run_dir = Path(cfg.run_dir)
        self.client_tls = None   # dflash.serving.tls.ClientTLS of the "client" certificate (cfg.tls)
        self._tls = lambda name, upstream=False: []   # a service's TLS flags (cfg.tls: start)

    @property
    def gateway_addr(self) -> str:
        return f"{self.cfg.host}:{self.cfg.gateway_port}"

    @property
    def admin_addr(self) -> str:
        """The gateway's admin plane: always loopback (``dflash up`` sets no admin token)."""
        port = self.cfg.admin_port if self.cfg.admin_port is not None else self.cfg.gateway_port + 10
        return f"127.0.0.1:{port}"

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (``.../v1``); None when it is off."""
        if not self.cfg.http_port:
            return None
        scheme = "https" if self.cfg.tls else "http"
        return f"{scheme}://{self.cfg.host}:{self.cfg.http_port}/v1"

    @property
    def verifier_addr(self) -> str:
        """Replica 0's address (the only one unless ``cfg.verifiers`` > 1)."""
        return self.verifier_addrs[0]

    @property
    def verifier_addrs(self) -> list[str]:
        return [f"{self.cfg.host}:{self.cfg.verifier_port + r}" for r in range(self.cfg.verifiers)]

    def verifier_name(self, replica: int = 0) -> str:
        return verifier_name(replica, self.cfg.verifiers)

    def drafter_addr(self, i: int = 0, replica: int = 0) -> str:
        """Drafter ``i`` of verifier ``replica``."""
        return f"{self.cfg.host}:{self.cfg.drafters[i].port + replica * len(self.cfg.drafters)}"

    def drafter_name(self, i: int = 0, replica: int = 0) -> str:
        return f"drafter{replica * len(self.cfg.drafters) + i}"

    def _check_ports(self) -> None:
        """Raises LaunchError naming the first two uses of one port (replicas' ports are
        derived, so N replicas can run into the gateway's or each other's)."""
        c = self.cfg
        if c.verifiers < 1:
            raise LaunchError(f"verifiers: must be >= 1, got {c.verifiers}")
        if c.verifier_args_per_replica and len(c.verifier_args_per_replica) != c.verifiers:
            raise LaunchError(f"verifier_args_per_replica: one list per replica ({c.verifiers}), "
                              f"got {len(c.verifier_args_per_replica)}")
        used = {"gateway": c.gateway_port, "gateway admin": int(self.admin_addr.rpartition(":")[2])}
        if c.http_port:
            used["gateway HTTP"] = c.http_port
        for r in range(c.verifiers):
            used[self.verifier_name(r)] = c.verifier_port + r
            for i in range(len(c.drafters)):
                used[self.drafter_name(i, r)] = int(self.drafter_addr(i, r).rpartition(":")[2])
        used.update({f"{name} /metrics": port for name, port in c.metrics_ports.items()})
        seen: dict[int, str] = {}
        for name, port in used.items():
            if port in seen:
                raise LaunchError(f"port {port}: both {seen[port]} and {name} would listen there "
                                  "(pick other --*-port values or fewer --verifiers)")
            seen[port] = name

    def _threads(self) -> list[str]:
        """``--threads`` of each model service: a replica's share of the cores (none with one
        replica: each service keeps torch's default, as before replicas)."""
        n = self.cfg.verifiers
        return [] if n == 1 else ["--threads", str(max(1, cores() // n))]

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.run_dir / f"{name}.log", "w")
        # OpenMP wait policy: the services' entry points shorten libgomp's spin before sleep
        # (dflash.serving.omp.default_spin_count: GOMP_SPINCOUNT=10000 unless the user's env sets it):
        # sleeping at every barrier and spinning forever are both slower when three processes
        # share a few cores (docs/bench/perf-history/README.md, "OpenMP spin count").
        env = {**os.environ, **self.cfg.extra_env}
        if name in self.cfg.metrics_ports:
            env["DFLASH_METRICS_PORT"] = str(self.cfg.metrics_ports[name])
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def _wait(self, name: str, addr: str) -> None:
        deadline = time.monotonic() + self.cfg.health_timeout_s
        p = self.procs[name]
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise LaunchError(f"{name} exited with code {p.returncode} while starting:\n"
                                  f"{self.log_tail(name)}")
            if wait_healthy(addr, 1.0, tls=self.client_tls):
                return
        raise LaunchError(f"{name} at {addr} not healthy after {self.cfg.health_timeout_s}s:\n"
                          f"{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self) -> "LocalStack":
        """Spawn the drafters and the verifier, then the gateway, each once the ones before it
        are healthy. Raises ``LaunchError`` (everything started is stopped) if one exits or is
        not healthy within ``health_timeout_s``.

        The services run in their own sessions (a Ctrl-C in a terminal reaches only the owner,
        which drains them in order), so an owner killed by SIGTERM (``timeout``, a CI runner)
        would leave them running: if SIGTERM still has its default action, it is made to raise
        ``SystemExit`` in the owner, so ``stop()`` in its ``finally`` / ``with`` runs (when the
        owner's main thread next runs Python: the kernel may hand the signal to a gRPC thread,
        so an owner blocked in one long C call notices it only when that call returns)."""
        c = self.cfg
        if self.procs:
            # A second start would spawn a second set on the same ports (gRPC binds them with
            # SO_REUSEPORT) and orphan the first: it would outlive stop().
            raise LaunchError("LocalStack.start: already started (``with LocalStack(...)`` starts it)")
        self._check_ports()
        _exit_on_sigterm()
        self._tls = tls = self._make_certs() if c.tls else self._tls
        try:
            for sc in self.sidecars:
                sc.start()
                c.extra_env.update(sc.env())
            for r in range(c.verifiers):
                self._start_replica(r, tls)
            self._start_gateway("gateway", self.gateway_addr, self.admin_addr, self.verifier_addrs,
                                ["--http-port", str(c.http_port), *c.gateway_args])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, name: str, bind: str, admin: str, verifiers: Sequence[str],
                       args: Sequence[str]) -> None:
        c = self.cfg
        gw = ["--target", c.target, "--bind", bind, "--admin-bind", admin, *args,
              *self._tls("gateway", upstream=True)]
        for addr in verifiers:
            gw += ["--verifier", addr]
        for i in range(len(c.drafters)):
            gw += ["--drafter", self.drafter_addr(i)]
        self._spawn(name, "gateway", gw)
        self._wait(name, bind)

    def add_gateway(self, name: str, port: int, admin_port: int, *,
                    verifiers: Sequence[str] | None = None, args: Sequence[str] = (),
                    metrics_port: int | None = None) -> str:
        """One more gateway process of the started stack (a bench comparing gateway flags on
        the same verifiers): on ``port`` (its admin plane on ``admin_port``, no HTTP API),
        calling ``verifiers`` (default every replica) with the stack's drafters, logging to
        ``<run_dir>/<name>.log``, stopped with the stack; returns its address. Raises
        LaunchError when the stack is not started, ``name`` is taken, or it does not become
        healthy (it is stopped then)."""
        if not self.procs:
            raise LaunchError("LocalStack.add_gateway: start the stack first")
        if name in self.procs:
            raise LaunchError(f"LocalStack.add_gateway: {name!r} is already a process of the stack")
        if metrics_port is not None:
            self.cfg.metrics_ports[name] = metrics_port
        bind = f"{self.cfg.host}:{port}"
        try:
            self._start_gateway(name, bind, f"127.0.0.1:{admin_port}",
                                self.verifier_addrs if verifiers is None else verifiers,
                                ["--http-port", "0", *args])
        except LaunchError:
            p = self.procs.pop(name, None)
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
            raise
        return bind

    def _start_replica(self, r: int, tls) -> None:
        """Verifier replica ``r``'s drafters, then the verifier, each once healthy."""
        c = self.cfg
        for i, d in enumerate(c.drafters):
            args = ["--drafter", d.path, "--target", c.target, "--bind", self.drafter_addr(i, r),
                    "--dtype", c.dtype, *self._threads(), *tls("drafter")]
            if d.name:
                args += ["--name", d.name]
            if d.version:
                args += ["--version", d.version]
            # One service at a time: each times its forwards at start (skinny-product
            # tuning), and two tuning at once on a few cores time each other's load.
            self._spawn(self.drafter_name(i, r), "drafter_svc", args)
            self._wait(self.drafter_name(i, r), self.drafter_addr(i, r))
        # the gateway names replica 0's drafters: this replica dials its own for those names
        aliases = [] if r == 0 else [
            a for i in range(len(c.drafters))
            for a in ("--drafter-alias", f"{self.drafter_addr(i)}={self.drafter_addr(i, r)}")]
        name, addr = self.verifier_name(r), self.verifier_addrs[r]
        self._spawn(name, "verifier_svc", ["--target", c.target, "--bind", addr, "--dtype", c.dtype,
                                           *self._threads(), *aliases, *c.verifier_args,
                                           *(c.verifier_args_per_replica[r]
                                             if c.verifier_args_per_replica else []),
                                           *tls("verifier", upstream=True)])
        self._wait(name, addr)

    @property
    def tls_dir(self) -> Path:
        return self.run_dir / "tls"

    def _make_certs(self):
        """A fresh development CA and per-service certificates in ``tls_dir``; returns
        ``flags(service, upstream=False)``: the service's TLS flags (mTLS: every server requires
        a certificate of this CA; ``upstream``: it presents its own to the next service)."""
        from dflash.serving.tls import DEFAULT_HOSTS, ClientTLS, TLSFiles, make_dev_certs

        paths = make_dev_certs(self.tls_dir, [*DEFAULT_HOSTS, self.cfg.host])
        ca = str(paths["ca"][0])
        cert, key = paths["client"]
        self.client_tls = ClientTLS.from_files(TLSFiles(str(cert), str(key), ca))

        def flags(name: str, upstream: bool = False) -> list[str]:
            cert, key = map(str, paths[name])
            out = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
            if upstream:
                out += ["--upstream-tls-ca", ca, "--upstream-tls-cert", cert,
                        "--upstream-tls-key", key]
            return out
        return flags

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process (they drain), then SIGKILL what is left after ``grace_s``; the
        sidecars last (they receive the services' final spans)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sc in reversed(self.sidecars):
            sc.stop()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
