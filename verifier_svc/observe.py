"""What the verifier shows: acceptance metrics per step, a trace per request, the log line.

* Metrics and the vLLM-format log line come from ``VerifierEngine.step_listeners`` (every
  decode step of every request, on the scheduler thread, whoever drives the engine).
* Spans: the ``Generate`` handler opens the request's server span and gives the request a
  :class:`RequestSpans` (``Request.trace``); the scheduler thread opens and ends the prefill,
  decode and step spans as the steps run (not when the client reads them: events are
  buffered), and hands each traced step's context to the drafter in its ``DraftItem``::

      /dflash.v1.Verifier/Generate (SERVER: the OpenTelemetry gRPC instrumentation's span,
                                    parent: the gateway's span via traceparent metadata)
        verifier.prefill
        verifier.decode            (request totals: tau, drafts, accepted, per position)
          verifier.step            (per DFLASH_TRACE_STEPS: all | every:N | summary)
            drafter.draft          (in the drafter process)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context, propagate, trace

from dflash.core.convert import FINISH_NAME
from dflash.core.finish import FINISH_CANCELLED
from dflash.core.speculation import SpecMode
from dflash.serving import semconv as sc
from dflash.serving.metrics import NO_DRAFTER, PolicyGauges, SessionGauges, VerifierMetrics
from dflash.serving.speclog import SpecDecodingLogger
from dflash.serving.telemetry import Telemetry
from dflash.serving.tracing import abort_status, set_error
from verifier_svc.draft_wire import WireStats
from verifier_svc.servicer import VerifierServicer

if TYPE_CHECKING:
    from verifier_svc.decision import Decision


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
    policy: Decision | None = None
    mode: str = ""


class VerifierObserver:
    def __init__(self, telemetry: Telemetry):
        self.metrics = VerifierMetrics(telemetry.registry)
        self.speclog = SpecDecodingLogger()
        self.tracer = telemetry.tracer
        self.steps = telemetry.trace_steps
        self.engine: Any = None            # verifier_svc.engine.VerifierEngine, once bound
        SessionGauges(telemetry.registry, "dflash_verifier", lambda: self.engine, extra=(
            ("suffix_index_tokens", "suffix_index_tokens", "Tokens in the sessions' suffix indexes."),
            ("suffix_answer_tokens", "suffix_answer_tokens", "Tokens of recent answers kept for "
             "suffix candidates (all tenants)."),
            ("suffix_corpus_tokens", "suffix_corpus_tokens", "Tokens of the operator's suffix "
             "corpus (--suffix-corpus)."),
            ("suffix_memory_bytes", "suffix_index_bytes", "Approximate bytes of the suffix "
             "indexes, the kept answers and the corpus."),
            ("suffix_lookup_seconds_total", "suffix_lookup_seconds", "Seconds spent looking up "
             "suffix candidates (summed over decode steps)."),
            ("suffix_lookups_total", "suffix_lookups", "Decode steps that looked up suffix "
             "candidates."),
            ("grammar_seconds_total", "grammar_seconds", "Seconds decode steps spent on "
             "grammars: pruning drafts, computing and applying masks, advancing matchers "
             "(summed over the rows that had a grammar)."),
            ("grammar_rows_total", "grammar_rows", "Decode-step rows verified under a grammar "
             "(at batch 1, steps)."),
            ("prefix_cache_bytes", "prefix_cache_bytes", "Bytes of cached prefixes (K/V and "
             "taps), pinned ones included."),
            ("prefix_cache_pinned_bytes", "prefix_cache_pinned_bytes", "Of those, bytes never "
             "evicted: sessions between turns and the declared shared prefixes."),
            ("prefix_cache_entries", "prefix_cache_entries", "Cached prefixes."),
            ("prefix_cache_tokens", "prefix_cache_tokens", "Positions held by cached prefixes."),
            ("prefix_cache_evictions_total", "prefix_cache_evictions", "Cached prefixes "
             "evicted for room."),
            ("drafter_prefix_hits_total", "drafter_prefix_hits", "Sessions whose drafter "
             "started them from its kept context of a cached prefix (only the rest uploaded)."),
            ("drafter_prefix_hit_tokens_total", "drafter_prefix_hit_tokens", "Context "
             "positions those sessions did not upload to their drafter."),
            ("drafter_prefix_misses_total", "drafter_prefix_misses", "Sessions whose drafter "
             "no longer held the cached prefix's context (restarted, evicted): uploaded in "
             "full.")))
        PolicyGauges(telemetry.registry, lambda: self.engine)

    def bind(self, engine) -> None:
        """Listen to ``engine``'s steps (idempotent)."""
        if engine is None or engine is self.engine:
            return
        self.engine = engine
        engine.step_listeners.append(self.on_step)

    # ------------------------------------------------------------------ metrics (listener)
    def on_step(self, req, ev) -> None:
        """One decode step of ``req`` (scheduler thread): metrics, and the view its span shows."""
        proposer = req.proposer
        label = proposer.card.label if proposer is not None else NO_DRAFTER
        wire = proposer.take_wire_stat(req.session_key) if isinstance(proposer, WireStats) else None
        draft_s: float | None
        if wire is not None:
            draft_s, wire_s = wire.drafter_seconds, max(0.0, ev.draft_seconds - wire.drafter_seconds)
        else:
            draft_s = ev.draft_seconds if (ev.drafted or ev.fallback) else None
            wire_s = None
        # a request without a drafter speculates only from suffix candidates, in its mode
        mode = (req.spec_mode or self.engine.spec_mode) if proposer is not None or ev.suffix_nodes \
            else SpecMode.OFF
        view = StepView(label=label, fallback=ev.fallback, verify_s=ev.verify_seconds,
                        draft_s=draft_s, wire_s=wire_s,
                        context_bytes=wire.context_bytes if wire else None,
                        batch_size=ev.batch_size, policy=ev.policy, mode=mode)
        self.metrics.batch_size.observe(ev.batch_size)
        self.metrics.policy_drafts.labels(label, mode).observe(ev.drafted)
        self.metrics.step(label, drafted=ev.drafted, accepted=ev.accepted, fallback=ev.fallback,
                          verify_s=ev.verify_seconds, draft_s=draft_s, wire_s=wire_s,
                          context_bytes=view.context_bytes, tree_nodes=ev.tree_nodes,
                          suffix_nodes=ev.suffix_nodes, suffix_accepted=ev.suffix_accepted,
                          grammar_accepted=ev.grammar_accepted)
        if ev.drafted:
            self.speclog.record(ev.drafted, ev.accepted)
        if isinstance(req.trace, RequestSpans):
            req.trace.view = view

    # ------------------------------------------------------------------ spans
    def stream(self, request, context, generate):
        """Run the servicer's ``Generate`` (``generate(trace)`` -> chunk generator) inside the
        request's server span (the gRPC instrumentation's, current here; the no-op span when
        tracing is off); the scheduler thread adds the prefill/decode/step spans."""
        span = trace.get_current_span()
        span.set_attributes(_request_attrs(request))
        spans = RequestSpans(self, otel_context.get_current(), len(request.prompt_token_ids))
        last = None
        self.metrics.running.inc()
        chunks = generate(spans)
        try:
            for chunk in chunks:
                self.metrics.generation_tokens.inc(len(chunk.token_ids))
                last = chunk
                yield chunk
        except GeneratorExit:
            span.set_attribute(sc.CANCELLED, True)
            raise
        except BaseException as e:
            abort_status(span, context, e)
            spans.fail(context, e)
            raise
        finally:
            chunks.close()   # the engine lets go of the request before the spans close
            self.metrics.running.dec()
            spans.close()
            if last is not None and last.finish_reason:
                span.set_attributes(sc.with_aliases({
                    sc.FINISH_REASONS: [FINISH_NAME.get(last.finish_reason) or "unknown"],
                    sc.CACHE_READ_INPUT_TOKENS: last.cached_prompt_tokens}))
                self.metrics.cached_prompt_tokens.inc(last.cached_prompt_tokens)
                self.metrics.prefix_cache_queries.inc(last.prompt_tokens)
                self.metrics.prefix_cache_hits.inc(last.cached_prompt_tokens)
            if spans.view is not None:
                span.set_attribute(sc.DRAFTER_VERSION, spans.view.label)


class RequestSpans:
    """One request's prefill, decode and step spans (``verifier_svc.request.RequestTrace``),
    opened and ended on the scheduler thread as its steps run."""

    def __init__(self, observer: VerifierObserver, server_ctx, prompt_tokens: int):
        self.o, self.server_ctx, self.prompt_tokens = observer, server_ctx, prompt_tokens
        self.view: StepView | None = None    # the last decode step's (VerifierObserver.on_step)
        self._lock = threading.Lock()
        self._prefill: Any = None          # opentelemetry spans (SDK or no-op)
        self._prefill_t0: float | None = None
        self._decode: Any = None
        self._decode_ctx: Any = None
        self._step: Any = None
        self._step_t0_ns = 0

    def prefill_started(self) -> None:
        with self._lock:
            self._prefill_t0 = time.perf_counter()
            self._prefill = self.o.tracer.start_span(
                sc.SPAN_VERIFIER_PREFILL, context=self.server_ctx,
                attributes=sc.with_aliases({sc.INPUT_TOKENS: self.prompt_tokens}))

    def step_started(self, step: int) -> dict[str, str]:
        with self._lock:
            self._step_t0_ns = time.time_ns()
            if self._decode_ctx is None or not self.o.steps.span_for(step):
                self._step = None
                return {}   # untraced step: the drafter gets no parent either
            self._step = self.o.tracer.start_span(sc.SPAN_VERIFIER_STEP, context=self._decode_ctx)
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(self._step))
            return carrier

    def event(self, req, ev) -> None:
        with self._lock:
            if ev.step < 0 and self._prefill is not None:
                if ev.finish != FINISH_CANCELLED and self._prefill_t0 is not None:
                    self.o.metrics.prefill(prompt_tokens=self.prompt_tokens,
                                           seconds=time.perf_counter() - self._prefill_t0)
                self._prefill.set_attributes(sc.with_aliases(
                    {sc.CACHE_READ_INPUT_TOKENS: ev.cached_prompt_tokens}))
                self._prefill.end()
                self._prefill = None
                self._decode = self.o.tracer.start_span(sc.SPAN_VERIFIER_DECODE, context=self.server_ctx)
                self._decode_ctx = trace.set_span_in_context(self._decode, self.server_ctx)
            elif ev.step >= 0:
                self._end_step(ev)
            if ev.finish and self._decode is not None:
                self._end_decode(ev.stats)

    def _end_step(self, ev) -> None:
        view, cur, self._step = self.view, self._step, None
        attrs = {sc.STEP: ev.step, sc.DRAFTED: ev.drafted,
                 sc.BLOCK_SIZE: ev.drafted + 1, sc.ACCEPTED: ev.accepted,
                 sc.EMITTED: len(ev.tokens)}
        if ev.tree_nodes:   # a tree: drafted = its depth, accepted = the accepted path's length
            attrs.update({sc.STEP_TREE_NODES: ev.tree_nodes, sc.STEP_TREE_PATH_LENGTH: ev.accepted})
            attrs[sc.BLOCK_SIZE] = ev.tree_nodes + 1
        if ev.suffix_nodes:   # accepted by source: suffix alone, the rest the drafter's
            attrs.update({sc.STEP_SUFFIX_NODES: ev.suffix_nodes,
                          sc.ACCEPTED_SUFFIX: ev.suffix_accepted,
                          sc.ACCEPTED_DRAFTER: ev.accepted - ev.suffix_accepted})
        if view is not None:
            attrs[sc.DRAFTER_VERSION] = view.label
            attrs[sc.VERIFY_SECONDS] = view.verify_s
            for key, v in ((sc.DRAFT_SECONDS, view.draft_s), (sc.WIRE_SECONDS, view.wire_s),
                           (sc.CONTEXT_BYTES, view.context_bytes)):
                if v is not None:
                    attrs[key] = v
            if view.fallback:
                attrs[sc.FALLBACK] = view.fallback
            attrs[sc.BATCH_SIZE] = view.batch_size
            attrs[sc.SPEC_MODE] = view.mode
            d = view.policy
            if d is not None and d.k >= 0:   # an adaptive choice: what it was made from
                attrs.update({sc.POLICY_DRAFTS: d.k, sc.POLICY_BATCH: d.batch,
                              sc.POLICY_EXPECTED_TOKENS: d.expected_tokens,
                              sc.POLICY_COST_SECONDS: d.cost_seconds,
                              sc.POLICY_EXPLORED: d.explored,
                              sc.POLICY_WAITING: d.waiting,
                              sc.POLICY_TREE_BUDGET: d.budget})
        if ev.finish:
            attrs[sc.FINISH_REASON] = ev.finish
        if cur is None and ev.fallback:
            # Steps that fell back are always traced, even when their step was not sampled.
            cur = self.o.tracer.start_span(sc.SPAN_VERIFIER_STEP, context=self._decode_ctx,
                                           start_time=self._step_t0_ns)
        if cur is not None:
            cur.set_attributes(attrs)
            if ev.fallback:
                set_error(cur, f"drafter fallback: {ev.fallback}")
            cur.end()
        elif self.o.steps.events and self._decode is not None:
            self._decode.add_event("spec_step", attrs)

    def _end_decode(self, st) -> None:
        if st is not None:
            self._decode.set_attributes({
                sc.TAU: st.mean_acceptance_length or 1.0,
                sc.DRAFTS: st.drafts, sc.DRAFT_TOKENS: st.draft_tokens,
                sc.ACCEPTED_TOKENS: st.accepted_tokens,
                sc.ACCEPTED_PER_POSITION: list(st.accepted_per_position),
                sc.FALLBACK_STEPS: st.fallback_steps,
                sc.TREE_DRAFTS: st.tree_drafts, sc.TREE_NODES: st.tree_nodes,
                sc.SUFFIX_DRAFTS: st.suffix_drafts, sc.SUFFIX_NODES: st.suffix_nodes,
                sc.ACCEPTED_TOKENS_SUFFIX: st.suffix_accepted_tokens,
                sc.ACCEPTED_TOKENS_DRAFTER: st.drafter_accepted_tokens})
        self._decode.end()
        self._decode = None

    def fail(self, context, e: BaseException) -> None:
        """The request failed: the span that was open says so."""
        with self._lock:
            for s in (self._step, self._prefill):
                if s is not None:
                    abort_status(s, context, e)

    def close(self) -> None:
        """End whatever is still open (a cancelled or failed request); idempotent."""
        with self._lock:
            for s in (self._step, self._prefill, self._decode):
                if s is not None:
                    s.end()
            self._step = self._prefill = self._decode = None


def _request_attrs(r) -> dict:
    s = r.sampling
    return {sc.REQUEST_ID: r.request_id, sc.SESSION_ID: r.session_id,
            sc.MAX_TOKENS: r.max_tokens, sc.TEMPERATURE: s.temperature,
            sc.TOP_P: s.top_p, sc.TOP_K: s.top_k,
            sc.INPUT_TOKENS: len(r.prompt_token_ids),
            sc.ALIASES[sc.INPUT_TOKENS]: len(r.prompt_token_ids),
            sc.SPECULATION: r.speculation.enabled,
            sc.DRAFTER_ADDRESS: r.speculation.drafter_address}


class ObservedVerifierServicer(VerifierServicer):
    """The Verifier servicer with its ``Generate`` observed (spans, per-request metrics)."""

    def __init__(self, engine, pool, observer: VerifierObserver):
        super().__init__(engine, pool, metrics=observer.metrics)
        self.observer = observer
        self.admission_metrics: Any = None     # dflash.serving.metrics.AdmissionMetrics, set by server.build
        observer.bind(engine)

    def Generate(self, request, context):
        return self.observer.stream(request, context,
                                    lambda spans: self._generate(request, context, spans))
