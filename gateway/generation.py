"""One request's samples streamed from the verifier: detokenised, cut at stop strings, counted.

:func:`sample_stream` turns one verifier Generate stream into gateway responses (text deltas
with their token ids and logprobs, then a final message with usage and acceptance statistics);
:func:`merge` runs the ``n`` samples of a request concurrently and interleaves their messages
(each carries its ``index``). Verifier failures raise :class:`gateway.status.UpstreamError`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator

import grpc
from opentelemetry import context as otel_context

from dflash.v1 import common_pb2, gateway_pb2, verifier_pb2
from gateway.detok import IncrementalDetokenizer
from gateway.emitted import EmittedStats
from gateway.status import UpstreamError


class Cancel:
    """Cancellation shared by a request's verifier calls: :meth:`cancel` (the client went away,
    or another sample failed) cancels every call registered with :meth:`add`, also those
    registered after it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self.cancelled = False

    def add(self, fn: Callable[[], object]) -> None:
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(fn)
                return
        fn()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


def _logprobs(chunk: verifier_pb2.VerifierGenerateChunk) -> list | None:
    """The chunk's TokenLogprobs, one per token id; None when it carries none.
    Raises UpstreamError when they do not match its token ids."""
    if not chunk.logprobs:
        return None
    if len(chunk.logprobs) != len(chunk.token_ids):
        raise UpstreamError(grpc.StatusCode.UNAVAILABLE, f"verifier: {len(chunk.logprobs)} "
                            f"logprobs for {len(chunk.token_ids)} tokens")
    return list(chunk.logprobs)


def sample_stream(verifier, tokenizer, vreq: verifier_pb2.VerifierGenerateRequest, *,
                  stop: list[str], index: int, cancel: Cancel, t0: float,
                  prefilled: threading.Event | None = None
                  ) -> Generator[gateway_pb2.GenerateResponse, None, None]:
    """The responses of one sample: deltas (text, the ids whose text completed in it and, when
    the verifier sent them, one TokenLogprob per id: a stop string cuts both where it cuts the
    ids), then the final message (finish reason, usage, acceptance statistics of what the
    client received, ``ttft_seconds`` since ``t0``, a ``perf_counter`` time).

    ``prefilled`` is set at the verifier's first chunk (its prompt is in its cache) and when the
    stream ends, whichever comes first.

    Returns quietly when ``cancel`` was cancelled; raises UpstreamError when the verifier
    refuses or fails."""
    try:
        yield from _sample_stream(verifier, tokenizer, vreq, stop, index, cancel, t0, prefilled)
    finally:
        if prefilled is not None:
            prefilled.set()


def _sample_stream(verifier, tokenizer, vreq, stop, index, cancel, t0, prefilled):
    call = verifier.Generate(vreq)
    cancel.add(call.cancel)
    detok = IncrementalDetokenizer(tokenizer, stop)
    emitted = EmittedStats()
    ttft = None
    last = None
    try:
        for chunk in call:
            if ttft is None:
                ttft = time.perf_counter() - t0
                if prefilled is not None:
                    prefilled.set()
            before = detok.num_tokens
            d = detok.push(list(chunk.token_ids), _logprobs(chunk))
            emitted.chunk(detok.num_tokens - before, chunk)
            if d.text or d.token_ids:
                yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids,
                                                   logprobs=d.extras, index=index)
            last = chunk
            if detok.stopped:
                call.cancel()
                break
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel.cancelled:
            return
        raise UpstreamError.from_rpc(e) from None
    if not detok.stopped:
        d = detok.finish()
        if d.text or d.token_ids:
            yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids,
                                               logprobs=d.extras, index=index)
    final = gateway_pb2.GenerateResponse(ttft_seconds=ttft or 0.0, index=index)
    final.finish_reason = (common_pb2.FINISH_REASON_STOP if detok.stopped
                           else (last.finish_reason if last else common_pb2.FINISH_REASON_CANCELLED))
    final.usage.prompt_tokens = len(vreq.prompt_token_ids)
    final.usage.completion_tokens = detok.num_tokens
    verifier_stats = last.stats if last is not None and last.HasField("stats") else None
    if last is not None:
        final.usage.cached_prompt_tokens = last.cached_prompt_tokens
    if verifier_stats is not None and not detok.stopped:
        final.acceptance.CopyFrom(verifier_stats)   # every token it committed was emitted
    else:   # a stop string cut the output (or the stream ended without statistics)
        final.acceptance.CopyFrom(emitted.to_proto(verifier_stats))
    yield final


_DONE = object()


def merge(streams: list[Generator], cancel: Cancel, lead: threading.Event | None = None
          ) -> Generator:
    """The messages of ``streams`` as they come; one stream is iterated in the caller's thread,
    several each in a thread of its own (started with the caller's OpenTelemetry context, so
    their verifier calls join the request's trace). With ``lead``, streams 1.. start once it is
    set (stream 0's prompt is in the verifier's cache: the others copy it instead of prefilling
    it again, ``sample_stream``'s ``prefilled``) or the request is cancelled.

    The first exception of any stream cancels the others and is raised here; closing this
    generator early (the client went away) cancels them all."""
    if len(streams) == 1:
        try:
            yield from streams[0]
        finally:
            streams[0].close()
        return
    q: queue.Queue = queue.Queue()
    ctx = otel_context.get_current()

    if lead is not None:
        cancel.add(lead.set)

    def pump(s: Generator) -> None:
        token = otel_context.attach(ctx)
        try:
            if lead is not None and s is not streams[0]:
                lead.wait()
            for item in s:
                q.put(item)
                if cancel.cancelled:
                    break
            q.put(_DONE)
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            cancel.cancel()
            q.put(e)
        finally:
            s.close()
            otel_context.detach(token)

    threads = [threading.Thread(target=pump, args=(s,), daemon=True, name=f"sample-{i}")
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    running = len(threads)
    try:
        while running:
            item = q.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        if running:
            cancel.cancel()
