"""What the drafter shows: per-batch metrics and one span per draft item.

The Draft stream is one long-lived bidi call multiplexing every session of a verifier, so it is
not a span itself. Each ``DraftItem`` carries the W3C context of the verifier step that asked
for it (``trace_context``); the drafter opens ``drafter.draft`` as that step's child, timed from
the batch's arrival to its reply.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind

from dflash.serving import semconv as sc
from dflash.serving.metrics import DrafterMetrics, SessionGauges
from dflash.serving.telemetry import Telemetry
from dflash.serving.tracing import extract_context, set_error
from drafter_svc.servicer import DrafterServicer

# The context cache's gauges (``drafter_svc.prefixes``; engine attribute, help).
PREFIX_GAUGES = (
    ("prefix_context_entries", "prefix_entries", "Finished sessions' contexts kept as prefixes."),
    ("prefix_context_tokens", "prefix_tokens", "Context positions held by kept prefixes."),
    ("prefix_context_bytes", "prefix_bytes", "Bytes of kept prefixes' context K/V "
     "(--prefix-context-mb bounds them)."),
    ("prefix_context_hits_total", "prefix_hits", "Sessions started from a kept prefix."),
    ("prefix_context_hit_tokens_total", "prefix_hit_tokens", "Context positions those sessions "
     "took from it instead of an upload."),
    ("prefix_context_misses_total", "prefix_misses", "Items naming a prefix not held (the "
     "verifier then uploads the whole context)."),
    ("prefix_context_evictions_total", "prefix_evictions", "Kept prefixes evicted for room."),
)


def _card_label(engine) -> str:
    return engine.card.label


class ObservedDrafterServicer(DrafterServicer):
    """The Drafter servicer with its Draft stream observed."""

    def __init__(self, engine, telemetry: Telemetry | None = None):
        super().__init__(engine)
        telemetry = telemetry or Telemetry(service="drafter")
        self.metrics = DrafterMetrics(telemetry.registry)
        self.tracer = telemetry.tracer
        self.tracing = telemetry.tracing
        SessionGauges(telemetry.registry, "dflash_drafter", lambda: self.engine, label=_card_label,
                      extra=PREFIX_GAUGES)

    def Draft(self, request_iterator, context):
        arrived: list = [None, 0]   # the batch being answered, its arrival time (ns)

        def batches():
            for b in request_iterator:
                arrived[0], arrived[1] = b, time.time_ns()
                yield b

        # The servicer answers each batch before reading the next, so a reply pairs with the
        # batch read last.
        results = super().Draft(batches(), context)
        try:
            for result in results:
                if arrived[0] is not None and arrived[0].items:
                    self._observe(arrived[0], result, arrived[1], time.time_ns())
                yield result
        finally:
            results.close()   # the servicer frees this verifier's sessions now

    def _observe(self, batch, result, start_ns: int, end_ns: int) -> None:
        label = self.engine.card.label
        m = self.metrics
        m.batch_seconds.labels(label).observe(result.draft_seconds)
        m.items.labels(label).inc(len(batch.items))
        for item, res in zip(batch.items, result.results):
            m.context_bytes.labels(label).inc(len(item.context.data))
            reason = res.error.split(":", 1)[0] if res.error else ""
            if res.error:
                m.errors.labels(label, reason or "error").inc()
            if not (self.tracing and item.trace_context):
                continue
            span = self.tracer.start_span(
                sc.SPAN_DRAFTER_DRAFT, context=extract_context(item.trace_context), kind=SpanKind.SERVER,
                start_time=start_ns, attributes={
                    sc.DRAFTER_VERSION: label, sc.SESSION_ID: item.session_id,
                    sc.BLOCK_SIZE: item.block_size, sc.CONTEXT_START: item.context_start,
                    sc.CONTEXT_ROWS: int(item.context.shape[0]) if item.context.shape else 0,
                    sc.CONTEXT_BYTES: len(item.context.data),
                    sc.BATCH_ITEMS: len(batch.items),
                    sc.DRAFT_SECONDS: result.draft_seconds, sc.DRAFTED: len(res.tokens)})
            if res.error:
                set_error(span, res.error)
            span.end(end_time=end_ns)
