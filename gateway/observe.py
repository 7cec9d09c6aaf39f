"""What the gateway shows: the request's root span and the client-facing latency metrics.

The request's span is the GenAI one: ``"{operation} {model}"`` (``chat`` or
``text_completion``) with the OpenTelemetry GenAI attributes (operation, request and
response model, response id, sampling parameters, input / output tokens, finish reasons, time
to first chunk) plus ``dflash.*`` acceptance (tau, drafts, accepted, drafter version); the keys
live in :mod:`dflash.serving.semconv`. Over gRPC it is the child of the RPC's server span (the
OpenTelemetry gRPC instrumentation's, ``dflash.serving.tracing.server_interceptors``); over
HTTP it is the server span itself. It is the current span while the servicer calls the
verifier, whose channel injects it as ``traceparent`` metadata.
"""

from __future__ import annotations

import time
import uuid

from opentelemetry import context as otel_context, propagate, trace
from opentelemetry.trace import SpanKind

from dflash.core.convert import FINISH_NAME
from dflash.core.finish import FINISH_CANCELLED
from dflash.serving import semconv as sc
from dflash.serving.metrics import NO_DRAFTER, GatewayMetrics, ResentAnswersSpliced
from dflash.serving.telemetry import Telemetry
from dflash.serving.tracing import abort_status, set_error
from gateway.servicer import GatewayServicer
from gateway.status import grpc_code


class ObservedGatewayServicer(GatewayServicer):
    """The Gateway servicer with ``Generate`` traced and measured; same constructor plus
    ``telemetry`` and ``model_name`` (the served model: ``gen_ai.request.model``)."""

    def __init__(self, *args, telemetry: Telemetry | None = None, model_name: str = "dflash", **kw):
        super().__init__(*args, **kw)
        self.model_name = model_name
        telemetry = telemetry or Telemetry(service="gateway")
        self.metrics = GatewayMetrics(telemetry.registry)
        ResentAnswersSpliced(telemetry.registry, lambda: self.resent.spliced if self.resent else 0)
        self.tracer = telemetry.tracer
        self.tracer_provider = telemetry.tracer_provider

    def Generate(self, request, context):
        # the RPC's server span is current (tracing.server_interceptors): ours is its child
        return self._observe(request, otel_context.get_current(), super().Generate(request, context),
                             lambda span, e: abort_status(span, context, e), kind=SpanKind.INTERNAL)

    def observed_stream(self, request, owner, cancel, *, trace_headers=None, response_id=None,
                        stream=None, **kw):
        """``response_id``: the id the HTTP response carries; ``stream``: whether it streams."""
        parent = propagate.extract(trace_headers or {}, context=otel_context.Context())
        responses = self.stream(request, owner, cancel, **kw)
        attrs: dict = {"rpc.system": "http", "rpc.service": "openai"}
        if stream is not None:
            attrs[sc.STREAM] = stream
        return self._observe(request, parent, responses, _record_error, attrs=attrs,
                             response_id=response_id, kind=SpanKind.SERVER)

    def _observe(self, request, parent, responses, on_error, *, kind: SpanKind, attrs=None,
                 response_id=None):
        op = sc.OP_CHAT if request.WhichOneof("input") == "chat" else sc.OP_TEXT_COMPLETION
        attrs = {**_request_attrs(request), sc.OPERATION: op, sc.REQUEST_MODEL: self.model_name,
                 sc.RESPONSE_ID: response_id or uuid.uuid4().hex, **(attrs or {})}
        span = self.tracer.start_span(sc.span_name(op, self.model_name), context=parent,
                                      kind=kind, attributes=sc.with_aliases(attrs))
        ctx = trace.set_span_in_context(span, parent)
        t0 = time.perf_counter()
        first = None
        last: dict[int, float] = {}   # per sample: when its previous delta came
        gaps: list[float] = []     # inter-token latencies, labelled once the drafter is known
        finals = []
        self.metrics.running.inc()
        try:
            while True:
                token = otel_context.attach(ctx)
                try:
                    r = next(responses)
                except StopIteration:
                    break
                finally:
                    otel_context.detach(token)
                now = time.perf_counter()
                n = len(r.token_ids)
                if n or r.text:
                    if first is None:
                        first = now - t0
                    elif n and r.index in last:
                        gaps += [(now - last[r.index]) / n] * n
                    last[r.index] = now
                if r.HasField("usage"):
                    finals.append(r)
                yield r
        except GeneratorExit:
            self._count(NO_DRAFTER, FINISH_CANCELLED)
            span.set_attribute(sc.CANCELLED, True)
            raise
        except BaseException as e:
            self._count(NO_DRAFTER, "error")
            on_error(span, e)
            raise
        finally:
            responses.close()
            self.metrics.running.dec()
            if finals:
                self._finish(span, finals, first, gaps, time.perf_counter() - t0)
            span.end()

    def _count(self, label: str, finish: str) -> None:
        self.metrics.requests.labels(label, finish).inc()

    def _finish(self, span, finals, first, gaps, e2e: float) -> None:
        """Metrics per request and tau per sample; the span sums the samples (n > 1)."""
        final = finals[0]
        label = final.drafter or NO_DRAFTER
        finishes = [FINISH_NAME.get(f.finish_reason) or "unknown" for f in finals]
        ttft = min(f.ttft_seconds for f in finals) or first or 0.0
        m = self.metrics
        self._count(label, finishes[0])
        m.ttft.labels(label).observe(ttft)
        m.e2e.labels(label).observe(e2e)
        for g in gaps:
            m.itl.labels(label).observe(g)
        completion = sum(f.usage.completion_tokens for f in finals)
        m.prompt_tokens.labels(label).inc(final.usage.prompt_tokens)
        m.completion_tokens.labels(label).inc(completion)
        drafts = accepted = drafted = 0
        for f in finals:
            a = f.acceptance
            drafts, accepted, drafted = (drafts + a.drafts, accepted + a.accepted_tokens,
                                         drafted + a.draft_tokens)
            if a.drafts:
                m.tau.labels(label).observe(a.mean_acceptance_length or 1.0)
        span.set_attributes(sc.with_aliases({
            sc.RESPONSE_MODEL: self.model_name,
            sc.INPUT_TOKENS: final.usage.prompt_tokens, sc.OUTPUT_TOKENS: completion,
            sc.CACHE_READ_INPUT_TOKENS: final.usage.cached_prompt_tokens,
            "gen_ai.usage.num_sequences": len(finals),
            sc.TIME_TO_FIRST_CHUNK: ttft, sc.E2E_SECONDS: e2e,
            sc.FINISH_REASONS: finishes, sc.DRAFTER_VERSION: label,
            sc.TAU: 1.0 + accepted / drafts if drafts else 1.0,
            sc.DRAFTS: drafts, sc.ACCEPTED_TOKENS: accepted, sc.DRAFT_TOKENS: drafted}))


def _record_error(span, e: BaseException) -> None:
    """A failed request outside gRPC: the code the core's exception maps to."""
    code = grpc_code(e)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    set_error(span, f"{code.name}: {e}")


def _request_attrs(r) -> dict:
    s = r.sampling
    attrs = {"rpc.system": "grpc", "rpc.service": "dflash.v1.Gateway", "rpc.method": "Generate",
             sc.MAX_TOKENS: r.max_tokens, sc.TEMPERATURE: s.temperature,
             sc.TOP_P: s.top_p, sc.TOP_K: s.top_k, sc.CHOICE_COUNT: max(1, r.n),
             sc.SESSION_ID: r.session_id, sc.BLOCK_SIZE: r.block_size,
             sc.SPECULATION: r.speculation if r.HasField("speculation") else True,
             sc.DRAFTER_REQUESTED: r.drafter}
    if s.HasField("seed"):
        attrs[sc.SEED] = s.seed
    return attrs
