"""What the verifier shows: acceptance metrics per step, a trace per request, the log line.

* Metrics and the vLLM-format log line come from ``VerifierEngine.step_listeners`` (every
  decode step of every request, whoever drives the engine).
* Spans come from wrapping the ``Generate`` response stream: the engine runs one step per
  response, so each ``next()`` is bracketed by that step's span, which is the current span
  while the engine calls the drafter; ``RemoteProposer`` copies it into the ``DraftItem`` and
  the drafter opens its child span. Spans::

      dflash.v1.Verifier/Generate (SERVER, parent: the gateway's span via traceparent metadata)
        verifier.prefill
        verifier.decode            (request totals: tau, drafts, accepted, per position)
          verifier.step            (per DFLASH_TRACE_STEPS: all | every:N | summary)
            drafter.draft          (in the drafter process)
"""

from __future__ import annotations

import dataclasses
import threading
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from dflash.convert import FINISH_NAME
from dflash.metrics import NO_DRAFTER, PolicyGauges, SessionGauges, VerifierMetrics
from dflash.speclog import SpecDecodingLogger
from dflash.telemetry import Telemetry
from dflash.tracing import abort_status, metadata_context, set_error
from verifier_svc.servicer import VerifierServicer


@dataclasses.dataclass(frozen=True)
class StepView:
    """One decode step as the listener saw it (handed to the span of the same step)."""

    label: str
    fallback: str | None
    verify_s: float
    draft_s: float | None          # drafter compute (as the drafter reports it)
    wire_s: float | None           # draft round trip minus drafter compute
    context_bytes: int | None
    batch_size: int = 1
    policy: object = None          # verifier_svc.policy.Decision
    mode: str = ""


def session_key(req) -> str:
    """The engine's session id for ``req`` (``VerifierEngine.generate``: one-shot = req-<id>)."""
    return req.session_id or f"req-{req.request_id}"


class VerifierObserver:
    def __init__(self, telemetry: Telemetry):
        self.metrics = VerifierMetrics(telemetry.registry)
        self.speclog = SpecDecodingLogger()
        self.tracer = telemetry.tracer
        self.steps = telemetry.trace_steps
        self.engine = None
        self._local = threading.local()
        SessionGauges(telemetry.registry, "dflash_verifier", lambda: self.engine)
        PolicyGauges(telemetry.registry, lambda: self.engine)

    def bind(self, engine) -> None:
        """Listen to ``engine``'s steps (idempotent)."""
        if engine is None or engine is self.engine:
            return
        self.engine = engine
        engine.step_listeners.append(self.on_step)

    # ------------------------------------------------------------------ metrics (listener)
    def on_step(self, req, ev) -> None:
        proposer = req.proposer
        label = proposer.card.label if proposer is not None else NO_DRAFTER
        take = getattr(proposer, "take_wire_stat", None)
        wire = take(session_key(req)) if take else None
        if wire is not None:
            draft_s, wire_s = wire.drafter_seconds, max(0.0, ev.draft_seconds - wire.drafter_seconds)
        else:
            draft_s = ev.draft_seconds if (ev.drafted or ev.fallback) else None
            wire_s = None
        mode = (req.spec_mode or self.engine.spec_mode) if proposer is not None else "off"
        view = StepView(label=label, fallback=ev.fallback, verify_s=ev.verify_seconds,
                        draft_s=draft_s, wire_s=wire_s,
                        context_bytes=wire.context_bytes if wire else None,
                        batch_size=ev.batch_size, policy=ev.policy, mode=mode)
        self.metrics.batch_size.observe(ev.batch_size)
        self.metrics.policy_drafts.labels(label, mode).observe(ev.drafted)
        self.metrics.step(label, drafted=ev.drafted, accepted=ev.accepted, fallback=ev.fallback,
                          verify_s=ev.verify_seconds, draft_s=draft_s, wire_s=wire_s,
                          context_bytes=view.context_bytes)
        if ev.drafted:
            self.speclog.record(ev.drafted, ev.accepted)
        self._local.view = view

    # ------------------------------------------------------------------ spans (stream wrapper)
    def stream(self, request, context, chunks):
        """Wrap the servicer's ``Generate`` stream ``chunks`` (a generator) with spans."""
        parent = metadata_context(context)
        span = self.tracer.start_span("dflash.v1.Verifier/Generate", context=parent,
                                      kind=SpanKind.SERVER, attributes=_request_attrs(request))
        server_ctx = trace.set_span_in_context(span, parent)
        decode = decode_ctx = None
        step, last, view = -1, None, None
        self.metrics.running.inc()
        try:
            while True:
                self._local.view = None
                t0, t0_ns = time.perf_counter(), time.time_ns()
                if last is not None and last.finish_reason:
                    cur = None  # drain: the engine finishes (keeps the session) on StopIteration
                elif step < 0:
                    cur = self.tracer.start_span("verifier.prefill", context=server_ctx, attributes={
                        "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids)})
                elif self.steps.span_for(step):
                    cur = self.tracer.start_span("verifier.step", context=decode_ctx)
                else:
                    cur = None  # untraced step: the drafter gets no parent either
                token = otel_context.attach(trace.set_span_in_context(cur or trace.INVALID_SPAN))
                try:
                    chunk = next(chunks)
                except StopIteration:
                    if cur is not None:
                        cur.end()
                    break
                except BaseException as e:
                    if cur is not None:
                        abort_status(cur, context, e)
                        cur.end()
                    raise
                finally:
                    otel_context.detach(token)
                seconds = time.perf_counter() - t0
                view = self._local.view or view
                self.metrics.generation_tokens.inc(len(chunk.token_ids))
                if step < 0:
                    self.metrics.prefill(prompt_tokens=len(request.prompt_token_ids), seconds=seconds)
                    cur.end()
                    decode = self.tracer.start_span("verifier.decode", context=server_ctx)
                    decode_ctx = trace.set_span_in_context(decode, server_ctx)
                else:
                    self._trace_step(cur, decode, decode_ctx, step, chunk, self._local.view, t0_ns)
                step, last = step + 1, chunk
                yield chunk
        except GeneratorExit:
            span.set_attribute("dflash.cancelled", True)
            raise
        except BaseException as e:
            abort_status(span, context, e)
            raise
        finally:
            chunks.close()
            self.metrics.running.dec()
            self._finish(span, decode, last, view)

    def _trace_step(self, cur, decode, decode_ctx, step, chunk, view, t0_ns) -> None:
        attrs = {"dflash.step": step, "dflash.drafted": chunk.drafted,
                 "dflash.block_size": chunk.drafted + 1, "dflash.accepted": chunk.accepted,
                 "dflash.emitted": len(chunk.token_ids)}
        if view is not None:
            attrs["dflash.drafter_version"] = view.label
            attrs["dflash.verify_seconds"] = view.verify_s
            for key, v in (("dflash.draft_seconds", view.draft_s), ("dflash.wire_seconds", view.wire_s),
                           ("dflash.context_bytes", view.context_bytes)):
                if v is not None:
                    attrs[key] = v
            if view.fallback:
                attrs["dflash.fallback"] = view.fallback
            attrs["dflash.batch_size"] = view.batch_size
            attrs["dflash.spec_mode"] = view.mode
            d = view.policy
            if d is not None and d.k >= 0:   # an adaptive choice: what it was made from
                attrs.update({"dflash.policy.drafts": d.k, "dflash.policy.batch": d.batch,
                              "dflash.policy.expected_tokens": d.expected_tokens,
                              "dflash.policy.cost_seconds": d.cost_seconds,
                              "dflash.policy.explored": d.explored,
                              "dflash.policy.waiting": d.waiting})
        if chunk.finish_reason:
            attrs["dflash.finish_reason"] = FINISH_NAME.get(chunk.finish_reason) or "unknown"
        if cur is None and view is not None and view.fallback:
            # Steps that fell back are always traced, even when their step was not sampled.
            cur = self.tracer.start_span("verifier.step", context=decode_ctx, start_time=t0_ns)
        if cur is not None:
            cur.set_attributes(attrs)
            if view is not None and view.fallback:
                set_error(cur, f"drafter fallback: {view.fallback}")
            cur.end()
        elif self.steps.events and decode is not None:
            decode.add_event("spec_step", attrs)

    def _finish(self, span, decode, last, view) -> None:
        if last is not None and last.finish_reason:
            finish = FINISH_NAME.get(last.finish_reason) or "unknown"
            span.set_attribute("gen_ai.response.finish_reasons", [finish])
            span.set_attribute("dflash.cached_prompt_tokens", last.cached_prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(last.cached_prompt_tokens)
        if view is not None:
            span.set_attribute("dflash.drafter_version", view.label)
        if decode is not None:
            if last is not None and last.HasField("stats"):
                st = last.stats
                decode.set_attributes({
                    "dflash.mean_acceptance_length": st.mean_acceptance_length or 1.0,
                    "dflash.drafts": st.drafts, "dflash.draft_tokens": st.draft_tokens,
                    "dflash.accepted_tokens": st.accepted_tokens,
                    "dflash.accepted_per_position": list(st.accepted_per_position),
                    "dflash.fallback_steps": st.fallback_steps})
            decode.end()
        span.end()


def _request_attrs(r) -> dict:
    s = r.sampling
    return {"rpc.system": "grpc", "rpc.service": "dflash.v1.Verifier", "rpc.method": "Generate",
            "dflash.request_id": r.request_id, "dflash.session_id": r.session_id,
            "gen_ai.request.max_tokens": r.max_tokens, "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p, "gen_ai.request.top_k": s.top_k,
            "gen_ai.usage.prompt_tokens": len(r.prompt_token_ids),
            "dflash.speculation": r.speculation.enabled,
            "dflash.drafter_address": r.speculation.drafter_address}


class ObservedVerifierServicer(VerifierServicer):
    """The Verifier servicer with its ``Generate`` stream observed (spans, per-request metrics)."""

    def __init__(self, engine, pool, observer: VerifierObserver):
        super().__init__(engine, pool, metrics=observer.metrics)
        self.observer = observer
        observer.bind(engine)

    def Generate(self, request, context):
        return self.observer.stream(request, context, super().Generate(request, context))
