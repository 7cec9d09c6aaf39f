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
import logging
import os
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("dflash.server")

CONTROL_WORKERS = 32          # workers no stream can take: unary RPCs always find one free
STREAM_RETRY_MS = 200         # retry hint of a stream refused by StreamLimit
RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a RESOURCE_EXHAUSTED refusal
# Never limited: a health Watch or a reflection session is the control plane itself.
UNLIMITED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


@dataclasses.dataclass
class ServiceRuntime:
    """A gRPC server plus its health servicer and the service names it reports."""

    server: grpc.Server
    health: health.HealthServicer
    services: tuple[str, ...]
    port: int
    servicer: object = None
    streams: "StreamLimit | None" = None
    _wanted: bool = False          # the service's own readiness (set_serving)
    _upstream: bool = True         # what it depends on is healthy (set_upstream)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

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
                  max_message_mb: int = 256) -> ServiceRuntime:
    """Build and bind (not start) a server. ``bind`` like "127.0.0.1:0" (port 0 = any free).

    ``max_streams``: response-streaming RPCs open at once (:class:`StreamLimit`; a streaming
    Generate holds a worker thread for its whole generation); the pool has
    ``max_streams + CONTROL_WORKERS`` workers, so unary RPCs (health, Describe, sessions,
    admin) are served whatever the number of open streams.

    Raises RuntimeError when the address cannot be bound, ValueError when ``max_streams`` < 1.
    """
    opts = [("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.max_receive_message_length", max_message_mb << 20),
            ("grpc.so_reuseport", 0)]
    limit = StreamLimit(max_streams)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + CONTROL_WORKERS),
                         interceptors=[limit] + list(interceptors), options=opts)
    add_servicers(server)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(
        service_names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise RuntimeError(f"cannot bind {bind}")
    rt = ServiceRuntime(server=server, health=hs, services=service_names, port=port,
                        streams=limit)
    rt.set_serving(False)
    return rt


def add_common_args(p) -> None:
    """The flags every service has: ``--grace`` (drain seconds on SIGTERM, env DFLASH_GRACE_S)
    and ``--metrics-port`` (Prometheus /metrics, 0 = off, env DFLASH_METRICS_PORT)."""
    env = os.environ.get
    p.add_argument("--grace", type=float, default=float(env("DFLASH_GRACE_S", "10")),
                   help="drain period on SIGTERM, seconds [DFLASH_GRACE_S]")
    p.add_argument("--metrics-port", type=int, default=int(env("DFLASH_METRICS_PORT", "0")),
                   help="Prometheus /metrics port, 0 = off [DFLASH_METRICS_PORT]")


def at_least(low: int):
    """argparse ``type`` for an int flag with a lower bound: a smaller value is refused with an
    error naming the flag (argparse adds the name)."""
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


def positive_float(text: str) -> float:
    """argparse ``type`` for a float flag that must be > 0 (refused naming the flag)."""
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def in_range(low: int, high: int):
    """argparse ``type`` for an int flag within ``[low, high]`` (refused naming the flag)."""
    def parse(text: str) -> int:
        n = int(text)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n
    return parse


def one_of(choices: tuple[str, ...]):
    """argparse ``type`` for a string flag with fixed choices. Unlike ``choices=``, argparse
    also runs it on a string default (an environment variable's value), so a bad value there
    is refused naming the flag too."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def int_list(low: int = 1, high: int | None = None):
    """argparse ``type`` for a comma-separated list of distinct ints, each ``>= low`` and, when
    given, ``<= high`` (e.g.
    ``--concurrency 1,2,4``); returns it normalised (``"1,2,4"``; ``""`` stays empty: the flag
    unset). A bad item is refused with an error naming the flag (argparse adds the name)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [int(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}")
        bad = [v for v in values if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {bad[0]}")
        bad = [v for v in values if high is not None and v > high]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be <= {high}, got {bad[0]}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
        return ",".join(map(str, values))
    return parse


def choice_list(choices: tuple[str, ...]):
    """argparse ``type`` for a non-empty comma-separated list of distinct ``choices`` (e.g.
    ``--spec-modes off,adaptive``); returns it normalised (``"off,adaptive"``)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"must name at least one of {', '.join(choices)}")
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} not one of {', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
        return ",".join(items)
    return parse


def add_compute_args(p, thread: str) -> None:
    """The flags of the services that run a model (verifier, drafter): ``--threads`` (torch
    threads of ``thread``, the one that runs every forward; env DFLASH_TORCH_THREADS) and
    ``--skinny-max-rows`` (``kernels.skinny_linear``; env DFLASH_SKINNY_MAX_ROWS)."""
    from kernels.skinny_linear import AUTO   # here: the gateway never imports torch

    env = os.environ.get
    p.add_argument("--threads", type=int, default=int(env("DFLASH_TORCH_THREADS", "0")),
                   help=f"torch CPU threads of the {thread}, which runs every forward; loading "
                        "runs on one; 0 = torch default [DFLASH_TORCH_THREADS]")
    p.add_argument("--skinny-max-rows", type=at_least(AUTO),
                   default=env("DFLASH_SKINNY_MAX_ROWS", str(AUTO)),
                   help="CPU float32: linear layers with 2..N input rows (a verify block) use the "
                        "transposed product, 0 = off, -1 = measure both at start and keep the "
                        "faster (kernels/skinny_linear.py) [DFLASH_SKINNY_MAX_ROWS]")


def run_until_signal(rt: ServiceRuntime, grace_s: float, on_stop=None) -> None:
    """Block until SIGTERM/SIGINT; then NOT_SERVING, drain for ``grace_s`` seconds, stop."""
    done = threading.Event()

    def handler(signum, _frame):
        log.info("signal %s: NOT_SERVING, draining for %.1fs", signum, grace_s)
        done.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    done.wait()
    rt.stop(grace_s)
    if on_stop:
        on_stop()
    log.info("stopped")


def channel_options(max_message_mb: int = 256) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.max_receive_message_length", max_message_mb << 20)]


def wait_healthy(address: str, timeout_s: float, service: str = "") -> bool:
    """Poll ``grpc.health.v1`` at ``address`` until SERVING or the timeout; returns success."""
    import time

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
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
