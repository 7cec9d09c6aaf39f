"""Server lifecycle shared by the three services (grpc/grpc examples pattern).

``create_server`` returns an unstarted server with health checking (``grpc.health.v1``, overall
and per service, NOT_SERVING until :meth:`ServiceRuntime.set_serving`) and server reflection.
``run_until_signal`` flips health to NOT_SERVING on SIGTERM/SIGINT, then stops with a grace
period so in-flight streams drain.

The control plane never starves: every open response stream holds a worker thread of the
synchronous server, so the streams are bounded (``max_streams``, :class:`StreamLimit`: one past
the bound is refused at once with RESOURCE_EXHAUSTED) and the pool has ``CONTROL_WORKERS``
more workers than that, always free for health, Describe, session and admin RPCs.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import signal
import threading
import typing
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dflash.serving.argtypes import at_least, host_port_or_empty, one_of
from dflash.serving.authz import DEFAULT_TRUST_DOMAIN, AuthzConfigError, PeerIds, RoleAuthz

if typing.TYPE_CHECKING:
    from dflash.serving.tls import ClientTLS, ServerTLS

log = logging.getLogger("dflash.serving.server")

CONTROL_WORKERS = 32          # workers no stream can take: unary RPCs always find one free
STREAM_RETRY_MS = 200         # retry hint of a stream refused by StreamLimit
RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a RESOURCE_EXHAUSTED refusal
# Never limited: a health Watch or a reflection session is the control plane itself.
UNLIMITED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class BindError(RuntimeError):
    """An address a server cannot listen on (taken, not an address, a port out of range); the
    message names the flag where one caller knows it."""


@dataclasses.dataclass
class ServiceRuntime:
    """A gRPC server plus its health servicer and the service names it reports."""

    server: grpc.Server
    health: health.HealthServicer
    services: tuple[str, ...]
    port: int
    servicer: typing.Any = None    # the service's servicer (its own type in each service)
    streams: "StreamLimit | None" = None
    tls: "ServerTLS | None" = None  # reloading credentials (SIGHUP: run_until_signal)
    _wanted: bool = False          # the service's own readiness (set_serving)
    _upstream: bool = True         # what it depends on is healthy (set_upstream)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # (name, status) callbacks told every status this publishes (add_mirror): the health process
    mirrors: list[typing.Callable[[str, int], None]] = dataclasses.field(default_factory=list)

    def set_serving(self, serving: bool) -> None:
        """The service's own readiness (loaded, not draining). Health reports SERVING only while
        this and :meth:`set_upstream` both say so."""
        with self._lock:
            self._wanted = serving
            self._publish_locked()

    def set_upstream(self, healthy: bool) -> None:
        """Whether the service this one forwards to is healthy (the gateway's verifier)."""
        with self._lock:
            self._upstream = healthy
            self._publish_locked()

    @property
    def serving(self) -> bool:
        """What health reports now."""
        return self._wanted and self._upstream

    def _publish_locked(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self._wanted and self._upstream
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("",) + self.services:
            self.health.set(name, status)
            for mirror in self.mirrors:
                mirror(name, status)

    def add_mirror(self, mirror: typing.Callable[[str, int], None]) -> None:
        """Tell ``mirror(name, status)`` every status from now on, starting with the current."""
        with self._lock:
            self.mirrors.append(mirror)
            self._publish_locked()

    def stop(self, grace_s: float) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()


class StreamLimit(grpc.ServerInterceptor):
    """At most ``limit`` response-streaming RPCs open at once (health and reflection exempt).

    One past the limit is refused at once with RESOURCE_EXHAUSTED (trailing metadata
    ``retry-after-ms``), instead of queueing for a worker behind the open streams where it
    would wait without a deadline and delay every unary RPC queued behind it. A slot is held
    from the handler's first step until the RPC terminates (``context.add_callback``: a
    cancelled stream gives it back even if its handler never resumes).

    Raises ValueError when ``limit`` < 1.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_streams: must be >= 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._open = 0
        self.refused = 0

    @property
    def open(self) -> int:
        """Streams holding a slot now."""
        return self._open

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if (handler is None or not handler.response_streaming
                or handler_call_details.method.startswith(UNLIMITED_PREFIXES)):
            return handler
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._limited(handler.stream_stream), handler.request_deserializer,
                handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(
            self._limited(handler.unary_stream), handler.request_deserializer,
            handler.response_serializer)

    def _limited(self, behavior):
        def run(request, context):
            if not self._acquire():
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(STREAM_RETRY_MS)),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"server busy: {self.limit} streams open; retry after "
                              f"{STREAM_RETRY_MS} ms")
            released = threading.Event()

            def release():
                if not released.is_set():
                    released.set()
                    with self._lock:
                        self._open -= 1

            if not context.add_callback(release):   # the RPC already ended
                release()
            yield from behavior(request, context)
        return run

    def _acquire(self) -> bool:
        with self._lock:
            if self._open >= self.limit:
                self.refused += 1
                return False
            self._open += 1
            return True


def create_server(bind: str, add_servicers, service_names: tuple[str, ...], *,
                  max_streams: int = 512, interceptors=(),
                  max_message_mb: int = 256, tls: "ServerTLS | None" = None,
                  authz: "typing.Mapping[str, str] | None" = None,
                  runtime: type[ServiceRuntime] = ServiceRuntime) -> ServiceRuntime:
    """Build and bind (not start) a server. ``bind`` like "127.0.0.1:0" (port 0 = any free).

    ``max_streams``: response-streaming RPCs open at once (:class:`StreamLimit`; a streaming
    Generate holds a worker thread for its whole generation); the pool has
    ``max_streams + CONTROL_WORKERS`` workers, so unary RPCs (health, Describe, sessions,
    admin) are served whatever the number of open streams.

    ``tls``: listen with TLS (mTLS when it has a CA; :class:`dflash.serving.tls.ServerTLS`, whose files
    are re-read at the next handshake after they change); None = plaintext.

    ``authz``: the role each RPC needs (full method name -> role,
    :class:`dflash.serving.authz.RoleAuthz`), enforced first, before any other interceptor,
    when ``tls`` requires client certificates; without mTLS there is no identity to check and
    it is not installed (plaintext for local development).

    ``runtime``: the class returned, :class:`ServiceRuntime` or a subclass whose added fields
    have defaults (the gateway's ``gateway.server.GatewayRuntime``).

    Raises BindError (a RuntimeError) when the address cannot be bound, ValueError when
    ``max_streams`` < 1.
    """
    opts = [("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.max_receive_message_length", max_message_mb << 20),
            ("grpc.so_reuseport", 0)]
    limit = StreamLimit(max_streams)
    first: list[grpc.ServerInterceptor] = []
    if authz is not None and tls is not None and tls.require_client_cert:
        first.append(RoleAuthz(authz, tls.peer_ids))    # refused before taking a stream slot
    elif authz is not None and not is_loopback_bind(bind):
        log.warning("%s on %s without mTLS (--tls-ca): whoever reaches it may call every RPC "
                    "(docs/deployment.md, \"Trust model\")", "/".join(service_names), bind)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + CONTROL_WORKERS),
                         interceptors=first + [limit] + list(interceptors), options=opts)
    add_servicers(server)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(
        service_names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = bind_port(server, bind, tls.credentials() if tls else None)
    rt = runtime(server=server, health=hs, services=service_names, port=port,
                 streams=limit, tls=tls)
    rt.set_serving(False)
    return rt


def is_loopback_bind(bind: str) -> bool:
    """True when ``bind`` ("host:port", "[::1]:port", "localhost:port") listens on loopback only."""
    host = bind.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_port(server: grpc.Server, bind: str, credentials=None) -> int:
    """Listen on ``bind`` (with TLS ``credentials`` when given); returns the port bound.

    Raises BindError (``cannot bind ...``) when it cannot: grpc returns 0 or, in newer
    releases, raises."""
    try:
        port = (server.add_secure_port(bind, credentials) if credentials is not None
                else server.add_insecure_port(bind))
    except RuntimeError:
        port = 0
    if port == 0:
        raise BindError(f"cannot bind {bind}")
    return port


def tie_server(main: grpc.Server, other: grpc.Server) -> None:
    """Start ``other`` with ``main`` and stop it when ``main`` stops, so every caller of
    ``main`` (``run_until_signal``, the test stacks) manages both (the gateway's admin plane,
    a health-only listener)."""
    start = main.start

    def start_both():
        start()
        other.start()
        threading.Thread(target=lambda: (main.wait_for_termination(), other.stop(0)),
                         daemon=True, name="tied-server-stop").start()

    main.start = start_both


def add_health_listener(rt: ServiceRuntime, bind: str) -> int | None:
    """``--health-bind``: a plaintext listener serving only ``grpc.health.v1`` (the same
    status as the service's port), for probes that cannot present a client certificate
    (kubelet's gRPC probes) when the service port requires mTLS, and for probes that must be
    answered at once whatever the load: it is a child process with its own interpreter
    (:class:`dflash.serving.health_process.HealthProcess`; NOT_SERVING when the service goes
    silent). Started and stopped with ``rt.server``. Returns its port (None when ``bind`` is
    empty).

    Raises BindError when ``bind`` is not HOST:PORT (0-65535) or cannot be bound."""
    if not bind:
        return None
    from dflash.serving.health_process import HealthProcess

    child = HealthProcess(bind)
    log.info("health-only listener on %s:%d (process %d)", child.host, child.port, child.proc.pid)
    rt.add_mirror(child.set)
    tie_server(rt.server, child)      # start() / stop(grace), as a server
    return child.port


def add_common_args(p) -> None:
    """The flags every service has: ``--grace`` (drain seconds on SIGTERM, env DFLASH_GRACE_S),
    ``--metrics-port`` (Prometheus /metrics, 0 = off, env DFLASH_METRICS_PORT) and the server's
    TLS files ``--tls-cert``/``--tls-key``/``--tls-ca`` (env DFLASH_TLS_CERT/_KEY/_CA;
    :func:`server_tls_from_args`)."""
    env = os.environ.get
    p.add_argument("--grace", type=float, default=float(env("DFLASH_GRACE_S", "10")),
                   help="drain period on SIGTERM, seconds [DFLASH_GRACE_S]")
    p.add_argument("--metrics-port", type=int, default=int(env("DFLASH_METRICS_PORT", "0")),
                   help="Prometheus /metrics port, 0 = off [DFLASH_METRICS_PORT]")
    p.add_argument("--health-bind", default=env("DFLASH_HEALTH_BIND", ""), type=host_port_or_empty,
                   help="host:port of a plaintext listener serving only grpc.health.v1 from "
                        "a child process (answers at once under any load; NOT_SERVING if this "
                        "service freezes), for probes, also when the service port requires "
                        "mTLS; empty = none [DFLASH_HEALTH_BIND]")
    p.add_argument("--metrics-host", default=None,
                   help="/metrics bind host, default 127.0.0.1 (DFLASH_METRICS_ADDR, its older "
                        "name, is read too); 0.0.0.0 exposes it [DFLASH_METRICS_HOST]")
    p.add_argument("--tls-cert", default=env("DFLASH_TLS_CERT") or None,
                   help="PEM certificate chain: with --tls-key, listen with TLS; re-read when "
                        "the file changes or on SIGHUP [DFLASH_TLS_CERT]")
    p.add_argument("--tls-key", default=env("DFLASH_TLS_KEY") or None,
                   help="PEM private key of --tls-cert [DFLASH_TLS_KEY]")
    p.add_argument("--tls-ca", default=env("DFLASH_TLS_CA") or None,
                   help="PEM CA bundle: require client certificates signed by it (mTLS); each "
                        "RPC then also needs its caller's role (dflash/serving/authz.py) "
                        "[DFLASH_TLS_CA]")
    p.add_argument("--tls-trust-domain", default=env("DFLASH_TLS_TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN),
                   help="with mTLS: role R is the certificate whose SAN URI is "
                        "spiffe://<this>/dflash/R (what `dflash certs --trust-domain` issues) "
                        "[DFLASH_TLS_TRUST_DOMAIN]")
    p.add_argument("--tls-peer-ids", default=env("DFLASH_TLS_PEER_IDS", ""),
                   help="with mTLS: your own identities, ROLE=URI[,ROLE=URI...] (roles gateway, "
                        "verifier, drafter, client, admin), replacing that role's default "
                        "SPIFFE ID [DFLASH_TLS_PEER_IDS]")


def add_upstream_tls_args(p, upstream: str) -> None:
    """The client-side TLS flags of a service that calls ``upstream`` (the gateway: the
    verifier; the verifier: its drafters): ``--upstream-tls-ca`` (verify it; env
    DFLASH_UPSTREAM_TLS_CA) and ``--upstream-tls-cert``/``--upstream-tls-key`` (this service's
    client certificate for mTLS; env DFLASH_UPSTREAM_TLS_CERT/_KEY)."""
    env = os.environ.get
    p.add_argument("--upstream-tls-ca", default=env("DFLASH_UPSTREAM_TLS_CA") or None,
                   help=f"PEM CA bundle: connect to the {upstream} with TLS and verify its "
                        "certificate against it [DFLASH_UPSTREAM_TLS_CA]")
    p.add_argument("--upstream-tls-cert", default=env("DFLASH_UPSTREAM_TLS_CERT") or None,
                   help=f"PEM client certificate chain presented to the {upstream} (mTLS) "
                        "[DFLASH_UPSTREAM_TLS_CERT]")
    p.add_argument("--upstream-tls-key", default=env("DFLASH_UPSTREAM_TLS_KEY") or None,
                   help="PEM private key of --upstream-tls-cert [DFLASH_UPSTREAM_TLS_KEY]")


def server_tls_from_args(a: argparse.Namespace) -> "ServerTLS | None":
    """The server credentials ``--tls-*`` ask for (None: plaintext), with the identities
    ``--tls-trust-domain`` / ``--tls-peer-ids`` give the roles. Raises
    ``dflash.serving.tls.TLSConfigError`` naming the flag (a cert without its key, a file missing or
    invalid, an expired certificate, a trust domain or peer id that is not one)."""
    from dflash.serving.tls import ServerTLS, TLSConfigError, TLSFiles

    files = TLSFiles(a.tls_cert, a.tls_key, a.tls_ca)
    if not files.enabled:
        return None
    try:
        peer_ids = PeerIds.parse(a.tls_trust_domain or DEFAULT_TRUST_DOMAIN, a.tls_peer_ids)
    except AuthzConfigError as e:
        raise TLSConfigError(str(e)) from None
    return ServerTLS(files, peer_ids)


def upstream_tls_from_args(a: argparse.Namespace) -> "ClientTLS | None":
    """The client TLS ``--upstream-tls-*`` ask for (None: plaintext). Raises
    ``dflash.serving.tls.TLSConfigError`` naming the flag."""
    from dflash.serving.tls import ClientTLS, TLSFiles

    return ClientTLS.from_files(TLSFiles(a.upstream_tls_cert, a.upstream_tls_key,
                                         a.upstream_tls_ca, prefix="--upstream-tls"))


def add_compute_args(p, thread: str) -> None:
    """The flags of the services that run a model (verifier, drafter): ``--threads`` (torch
    threads of ``thread``, the one that runs every forward; env DFLASH_TORCH_THREADS) and
    ``--skinny-max-rows`` (``kernels.skinny_linear``; env DFLASH_SKINNY_MAX_ROWS) and
    ``--packed-linear`` (``kernels.packed_linear``; env DFLASH_PACKED_LINEAR) and
    ``--panel-linear`` (``kernels.panel_linear``; env DFLASH_PANEL_LINEAR) and
    ``--batch-invariant`` (``kernels.invariant``; env DFLASH_BATCH_INVARIANT)."""
    from dflash.core.flags import INVARIANT_CHOICES, PACKED_CHOICES
    from kernels.skinny_linear import AUTO  # here: the gateway never imports torch

    env = os.environ.get
    p.add_argument("--threads", type=int, default=int(env("DFLASH_TORCH_THREADS", "0")),
                   help=f"torch CPU threads of the {thread}, which runs every forward; loading "
                        "runs on one; 0 = torch default [DFLASH_TORCH_THREADS]")
    p.add_argument("--skinny-max-rows", type=at_least(AUTO),
                   default=env("DFLASH_SKINNY_MAX_ROWS", str(AUTO)),
                   help="CPU float32: linear layers with 2..N input rows (a verify block) use the "
                        "transposed product, 0 = off, -1 = measure both at start and keep the "
                        "faster (kernels/skinny_linear.py) [DFLASH_SKINNY_MAX_ROWS]")
    p.add_argument("--packed-linear", type=one_of(PACKED_CHOICES),
                   default=env("DFLASH_PACKED_LINEAR", "auto"),
                   help="CPU: linear layers take oneDNN products on weights prepacked once (one "
                        "more copy of the weights in memory); auto = measure at start and keep "
                        "the faster (kernels/packed_linear.py) [DFLASH_PACKED_LINEAR]")
    p.add_argument("--panel-linear", type=one_of(PACKED_CHOICES),
                   default=env("DFLASH_PANEL_LINEAR", "auto"),
                   help="CPU float32 on AVX-512: linear layers take this project's kernel on "
                        "weights packed once into column panels (compiled on first use; one more "
                        "copy of the weights); auto = measure at start from which row count it "
                        "wins (kernels/panel_linear.py) [DFLASH_PANEL_LINEAR]")
    p.add_argument("--batch-invariant", type=one_of(INVARIANT_CHOICES),
                   default=env("DFLASH_BATCH_INVARIANT", "auto"),
                   help="batch-invariant kernels: a verify of k rows gives the bits of k one-token "
                        "decodes, so greedy speculation is plain decoding bit for bit in every "
                        "dtype; auto = off until it costs <= 10%% at every shape (kernels/"
                        "invariant.py, docs/batch-invariance.md) [DFLASH_BATCH_INVARIANT]")


def run_until_signal(rt: ServiceRuntime, grace_s: float, on_stop=None) -> None:
    """Block until SIGTERM/SIGINT; then NOT_SERVING, drain for ``grace_s`` seconds, stop.
    SIGHUP re-reads the TLS files at the next handshake (``rt.tls``)."""
    done = threading.Event()

    def handler(signum, _frame):
        log.info("signal %s: NOT_SERVING, draining for %.1fs", signum, grace_s)
        done.set()

    def reload(_signum, _frame):
        if rt.tls is not None:
            log.info("SIGHUP: TLS files re-read at the next handshake")
            rt.tls.request_reload()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGHUP, reload)
    done.wait()
    rt.stop(grace_s)
    if on_stop:
        on_stop()
    log.info("stopped")


def channel_options(max_message_mb: int = 256) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.max_receive_message_length", max_message_mb << 20)]


def wait_healthy(address: str, timeout_s: float, service: str = "",
                 tls: "ClientTLS | None" = None) -> bool:
    """Poll ``grpc.health.v1`` at ``address`` (over TLS when ``tls``) until SERVING or the
    timeout; returns success."""
    import time

    from dflash.serving.tls import channel

    deadline = time.monotonic() + timeout_s
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False
