"""OpenTelemetry tracing shared by the three services.

Configuration (all optional; without any of them tracing is off and costs nothing):

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (and the other
  standard ``OTEL_*`` variables: headers, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER``): export spans over OTLP/gRPC.
* ``DFLASH_TRACE_FILE``: append spans as JSON lines (one span per line) to this file, for use
  without a collector.
* ``DFLASH_TRACE_STEPS`` = ``all`` | ``every:N`` | ``summary``: how the verifier traces decode
  steps (see :class:`StepTracing`).

Context crosses gRPC as W3C ``traceparent`` metadata (gateway -> verifier, injected by
:class:`InjectTraceContext`) and, on the verifier -> drafter stream that multiplexes many
requests, inside each ``DraftItem.trace_context``. Every server's RPC spans (and the extraction
of their parent from the metadata) come from the OpenTelemetry gRPC instrumentation
(:func:`server_interceptors`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from collections.abc import Mapping, Sequence

import grpc
from opentelemetry import context as otel_context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

SERVICE_PREFIX = "dflash-"


@dataclasses.dataclass(frozen=True)
class StepTracing:
    """Which verifier decode steps get their own span (``DFLASH_TRACE_STEPS``).

    * ``all``: every step (and the drafter's span for it).
    * ``every:N``: steps 0, N, 2N, ... of each request; steps that fell back are always traced.
    * ``summary``: no step spans; one event per step on the request's ``verifier.decode`` span.
    """

    mode: str = "all"
    every: int = 1

    @classmethod
    def parse(cls, text: str) -> "StepTracing":
        t = (text or "all").strip().lower()
        if t in ("all", "summary"):
            return cls(mode=t)
        if t.startswith("every:"):
            try:
                n = int(t.split(":", 1)[1])
            except ValueError:
                n = 0
            if n >= 1:
                return cls(mode="every", every=n)
        raise ValueError(f"DFLASH_TRACE_STEPS: {text!r}; use all, every:N (N >= 1) or summary")

    def span_for(self, step: int) -> bool:
        if self.mode == "all":
            return True
        return self.mode == "every" and step % self.every == 0

    @property
    def events(self) -> bool:
        return self.mode == "summary"


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line (``ReadableSpan.to_json``)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json())) + "\n" for s in spans)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def provider_from_env(service: str, env: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A TracerProvider for ``service`` configured from the environment; None = tracing off."""
    exporters: list[SpanExporter] = []
    if env.get("DFLASH_TRACE_FILE"):
        exporters.append(JsonLinesSpanExporter(env["DFLASH_TRACE_FILE"]))
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if not exporters or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_PREFIX + service}
    provider = TracerProvider(resource=Resource.create(attrs))
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))
    return provider


# ---------------------------------------------------------------------- propagation
def inject_context() -> dict[str, str]:
    """W3C trace context of the current span (empty when none is being traced)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> otel_context.Context | None:
    """Parent context from a carrier (gRPC metadata dict or ``DraftItem.trace_context``)."""
    return propagate.extract(dict(carrier)) if carrier else None


def server_interceptors(tracer_provider: trace.TracerProvider | None) -> list[grpc.ServerInterceptor]:
    """The OpenTelemetry gRPC server interceptor for ``tracer_provider`` (none when tracing is
    off): one SERVER span per RPC (``/package.Service/Method``, ``rpc.*`` attributes, the
    aborted code as its status), parented by the caller's ``traceparent`` and current while
    the handler runs. Left out: health and reflection (``grpc.*``), the Verifier's Load (the
    gateway's replica watch polls it: a trace a second per replica would bury the requests'),
    and the Drafter's Draft stream, one call that lives as long as its verifier and carries
    every request (its items carry their own context: ``DraftItem.trace_context``)."""
    if tracer_provider is None:
        return []
    from opentelemetry.instrumentation.grpc import filters, server_interceptor

    skip = filters.any_of(filters.service_prefix("grpc."),
                          filters.full_method_name("/dflash.v1.Verifier/Load"),
                          filters.full_method_name("/dflash.v1.Drafter/Draft"))
    return [server_interceptor(tracer_provider=tracer_provider, filter_=filters.negate(skip))]


def set_error(span: trace.Span, description: str) -> None:
    span.set_status(Status(StatusCode.ERROR, description))


def abort_status(span: trace.Span, servicer_context, exc: BaseException) -> None:
    """Record a failed RPC handler on ``span``: the aborted gRPC code, or the exception."""
    code = None
    try:
        code = servicer_context.code()
    except Exception:  # older grpcio: no code()
        pass
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        details = servicer_context.details()
        if isinstance(details, bytes):
            details = details.decode("utf-8", "replace")
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        set_error(span, f"{code.name}: {details or ''}")
    else:
        span.record_exception(exc)
        set_error(span, f"{type(exc).__name__}: {exc}")


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class InjectTraceContext(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client interceptor adding the current W3C trace context to each call's metadata.

    It only propagates (no client span): the server side opens the span. The call object the
    caller gets back is the real one (``cancel()`` keeps working on streams) — why this stays
    instead of the OpenTelemetry client interceptor, which wraps a response stream in a plain
    generator (no ``cancel()``: the gateway could no longer stop a verifier call).
    """

    @staticmethod
    def _details(d):
        carrier = inject_context()
        if not carrier:
            return d
        md = list(d.metadata or ()) + list(carrier.items())
        return _CallDetails(d.method, d.timeout, md, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)
