"""What the gateway shows: the request's root span and the client-facing latency metrics.

``dflash.v1.Gateway/Generate`` (SERVER) carries the request's sampling parameters, prompt and
completion tokens, TTFT, end-to-end latency, finish reason and tau (``gen_ai.*`` keys as vLLM and
SGLang emit them, plus ``dflash.*``). It is the current span while the servicer calls the
verifier, whose channel injects it as ``traceparent`` metadata.
"""

from __future__ import annotations

import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from dflash.convert import FINISH_NAME
from dflash.metrics import NO_DRAFTER, GatewayMetrics
from dflash.telemetry import Telemetry
from dflash.tracing import abort_status, metadata_context
from gateway.servicer import GatewayServicer


class ObservedGatewayServicer(GatewayServicer):
    """The Gateway servicer with ``Generate`` traced and measured; same constructor plus
    ``telemetry``."""

    def __init__(self, *args, telemetry: Telemetry | None = None, **kw):
        super().__init__(*args, **kw)
        telemetry = telemetry or Telemetry(service="gateway")
        self.metrics = GatewayMetrics(telemetry.registry)
        self.tracer = telemetry.tracer

    def Generate(self, request, context):
        return self._observe(request, context, super().Generate(request, context))

    def _observe(self, request, context, responses):
        parent = metadata_context(context)
        span = self.tracer.start_span("dflash.v1.Gateway/Generate", context=parent,
                                      kind=SpanKind.SERVER, attributes=_request_attrs(request))
        ctx = trace.set_span_in_context(span, parent)
        t0 = time.perf_counter()
        first = last = None
        gaps: list[float] = []     # inter-token latencies, labelled once the drafter is known
        final = None
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
                    elif n:
                        gaps += [(now - last) / n] * n
                    last = now
                if r.HasField("usage"):
                    final = r
                yield r
        except GeneratorExit:
            self._count(NO_DRAFTER, "cancelled")
            span.set_attribute("dflash.cancelled", True)
            raise
        except BaseException as e:
            self._count(NO_DRAFTER, "error")
            abort_status(span, context, e)
            raise
        finally:
            responses.close()
            self.metrics.running.dec()
            if final is not None:
                self._finish(span, final, first, gaps, time.perf_counter() - t0)
            span.end()

    def _count(self, label: str, finish: str) -> None:
        self.metrics.requests.labels(label, finish).inc()

    def _finish(self, span, final, first, gaps, e2e: float) -> None:
        label = final.drafter or NO_DRAFTER
        finish = FINISH_NAME.get(final.finish_reason) or "unknown"
        ttft = final.ttft_seconds or first or 0.0
        m = self.metrics
        self._count(label, finish)
        m.ttft.labels(label).observe(ttft)
        m.e2e.labels(label).observe(e2e)
        for g in gaps:
            m.itl.labels(label).observe(g)
        m.prompt_tokens.labels(label).inc(final.usage.prompt_tokens)
        m.completion_tokens.labels(label).inc(final.usage.completion_tokens)
        a = final.acceptance
        tau = a.mean_acceptance_length or 1.0
        if a.drafts:
            m.tau.labels(label).observe(tau)
        span.set_attributes({
            "gen_ai.usage.prompt_tokens": final.usage.prompt_tokens,
            "gen_ai.usage.completion_tokens": final.usage.completion_tokens,
            "gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.e2e": e2e,
            "gen_ai.response.finish_reasons": [finish], "dflash.drafter_version": label,
            "dflash.cached_prompt_tokens": final.usage.cached_prompt_tokens,
            "dflash.mean_acceptance_length": tau, "dflash.drafts": a.drafts,
            "dflash.accepted_tokens": a.accepted_tokens, "dflash.draft_tokens": a.draft_tokens})


def _request_attrs(r) -> dict:
    s = r.sampling
    attrs = {"rpc.system": "grpc", "rpc.service": "dflash.v1.Gateway", "rpc.method": "Generate",
             "gen_ai.request.max_tokens": r.max_tokens, "gen_ai.request.temperature": s.temperature,
             "gen_ai.request.top_p": s.top_p, "gen_ai.request.top_k": s.top_k,
             "dflash.session_id": r.session_id, "dflash.block_size": r.block_size,
             "dflash.speculation": r.speculation if r.HasField("speculation") else True,
             "dflash.drafter_requested": r.drafter}
    if s.HasField("seed"):
        attrs["gen_ai.request.seed"] = s.seed
    return attrs
