"""What one service instance observes with: a tracer, a Prometheus registry, the step policy.

Each service's ``build()`` takes a ``Telemetry`` (default: tracing off, a fresh registry), so
several services in one process (the in-process test stacks) never share metric objects;
``main()`` uses :meth:`Telemetry.from_env` and :func:`serve_metrics` for ``--metrics-port``
(bound to loopback unless ``DFLASH_METRICS_HOST`` says otherwise).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from opentelemetry import trace
from prometheus_client import CollectorRegistry, start_http_server

from dflash.serving.tracing import StepTracing, provider_from_env

log = logging.getLogger("dflash.serving.telemetry")


@dataclasses.dataclass(kw_only=True)
class Telemetry:
    """Args:
        service: "gateway" | "verifier" | "drafter" (span instrumentation scope, service name).
        registry: where this instance's metrics live.
        tracer_provider: None = tracing off (a no-op tracer).
        trace_steps: the verifier's per-step span policy.
    """

    service: str
    registry: CollectorRegistry = dataclasses.field(default_factory=CollectorRegistry)
    tracer_provider: trace.TracerProvider | None = None
    trace_steps: StepTracing = dataclasses.field(default_factory=StepTracing)

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] = os.environ) -> "Telemetry":
        """OTLP / ``DFLASH_TRACE_FILE`` exporters and ``DFLASH_TRACE_STEPS`` from ``env``."""
        return cls(service=service, tracer_provider=provider_from_env(service, env),
                   trace_steps=StepTracing.parse(env.get("DFLASH_TRACE_STEPS", "all")))

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    @property
    def tracer(self) -> trace.Tracer:
        if self.tracer_provider is None:
            return trace.NoOpTracer()
        return self.tracer_provider.get_tracer(f"dflash.{self.service}")

    def shutdown(self) -> None:
        """Flush and stop span export (call once at process exit)."""
        if self.tracer_provider is not None and hasattr(self.tracer_provider, "shutdown"):
            self.tracer_provider.shutdown()


METRICS_HOST = "127.0.0.1"    # loopback like the gRPC binds: exposing /metrics is explicit


def metrics_host(env: Mapping[str, str] = os.environ) -> str:
    """The /metrics bind host: ``DFLASH_METRICS_HOST`` (``DFLASH_METRICS_ADDR``, its older
    name, when unset), default loopback; 0.0.0.0 (what Prometheus in another container
    needs) must be asked for."""
    return (env.get("DFLASH_METRICS_HOST") or env.get("DFLASH_METRICS_ADDR")
            or METRICS_HOST).strip()


def serve_metrics(registry: CollectorRegistry, port: int, addr: str | None = None):
    """Serve ``registry`` as Prometheus text on ``http://addr:port/metrics`` (port 0 = any free;
    ``addr`` None = :func:`metrics_host`).

    Returns the HTTP server (``server.server_port`` is the bound port; ``shutdown()`` stops it).
    Raises OSError when the address cannot be bound.
    """
    addr = addr or metrics_host()
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    log.info("Prometheus /metrics on %s:%d", addr, server.server_port)
    return server
