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
from gateway.replicas import NoReplica, ReplicaSet
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

    ``verifier``: a ``gateway.replicas.ReplicaSet`` (or one verifier's stub). A replica that
    fails before the first token is replaced by another, invisibly; one that fails mid-stream
    is **resumed** on another from the tokens already received (:func:`resumed`): the same
    output as an uninterrupted run for greedy and seeded requests (seeded noise is keyed by
    sequence position, ``dflash.core.sampling.position_noise``), and ``usage.resumes`` /
    ``acceptance.resumes`` count the moves.

    ``prefilled`` is set at the verifier's first chunk (its prompt is in its cache) and when the
    stream ends, whichever comes first.

    Returns quietly when ``cancel`` was cancelled; raises UpstreamError when the verifier
    refuses the request, or when no replica is left (UNAVAILABLE naming each)."""
    try:
        yield from _sample_stream(upstream_of(verifier), tokenizer, vreq, stop, index, cancel,
                                  t0, prefilled)
    finally:
        if prefilled is not None:
            prefilled.set()


def resumed(vreq: verifier_pb2.VerifierGenerateRequest, got: list[int]
            ) -> verifier_pb2.VerifierGenerateRequest:
    """``vreq`` continued after ``got`` (the ids its stream already sent): they join the prompt
    as ``resumed_tokens`` and ``max_tokens`` shrinks by as many."""
    if not got:
        return vreq
    out = verifier_pb2.VerifierGenerateRequest()
    out.CopyFrom(vreq)
    out.prompt_token_ids.extend(got)
    out.max_tokens = vreq.max_tokens - len(got)
    out.resumed_tokens = vreq.resumed_tokens + len(got)
    return out


# Codes after which another replica may serve the request (the replica failed, not the request).
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
         grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)


def _sample_stream(upstream, tokenizer, vreq, stop, index, cancel, t0, prefilled):
    detok = IncrementalDetokenizer(tokenizer, stop)
    emitted = EmittedStats()
    ttft = None
    last = None
    got: list[int] = []                # ids the verifiers sent, every replica together
    tried: set[str] = set()
    resumes = 0
    while True:
        req = resumed(vreq, got)
        replica, stub = upstream.pick(vreq.tenant, req.prompt_token_ids, vreq.session_id,
                                      frozenset(tried))
        call = stub.Generate(req)
        cancel.add(call.cancel)
        try:
            for chunk in call:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if prefilled is not None:
                        prefilled.set()
                got.extend(chunk.token_ids)
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
            upstream.served(replica, vreq.tenant, [*vreq.prompt_token_ids, *got])
            break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and cancel.cancelled:
                return
            overloaded = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not got
            if e.code() not in RETRY and not overloaded:
                raise UpstreamError.from_rpc(e) from None
            tried.add(upstream.failed(replica, e, overloaded=overloaded))
            upstream.last_error = e
            if got and len(got) >= vreq.max_tokens:
                break           # it failed after sending everything but its last chunk
            resumes += bool(got)
        finally:
            upstream.release(replica)
    if not detok.stopped:
        d = detok.finish()
        if d.text or d.token_ids:
            yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids,
                                               logprobs=d.extras, index=index)
    yield _final(vreq, detok, emitted, last, ttft, index, resumes, len(got))


def _final(vreq, detok, emitted: EmittedStats, last, ttft, index: int, resumes: int, sent: int
           ) -> gateway_pb2.GenerateResponse:
    final = gateway_pb2.GenerateResponse(ttft_seconds=ttft or 0.0, index=index)
    if detok.stopped:
        final.finish_reason = common_pb2.FINISH_REASON_STOP
    elif last is not None and last.finish_reason:
        final.finish_reason = last.finish_reason
    elif last is not None and sent >= vreq.max_tokens:
        final.finish_reason = common_pb2.FINISH_REASON_LENGTH
    else:
        final.finish_reason = common_pb2.FINISH_REASON_CANCELLED
    final.usage.prompt_tokens = len(vreq.prompt_token_ids)
    final.usage.completion_tokens = detok.num_tokens
    final.usage.resumes = resumes
    verifier_stats = last.stats if last is not None and last.HasField("stats") else None
    if last is not None:   # a resumed stream's prompt grew by what it had sent: not the client's
        final.usage.cached_prompt_tokens = min(last.cached_prompt_tokens, len(vreq.prompt_token_ids))
    if resumes:            # the last replica's statistics cover its part only: the chunks' sums
        final.acceptance.CopyFrom(emitted.to_proto(None))
        final.acceptance.resumes = resumes
    elif verifier_stats is not None and not detok.stopped:
        final.acceptance.CopyFrom(verifier_stats)   # every token it committed was emitted
    else:   # a stop string cut the output (or the stream ended without statistics)
        final.acceptance.CopyFrom(emitted.to_proto(verifier_stats))
    return final


class _Single:
    """One verifier's stub as an upstream: nowhere to retry (the gateway's behaviour before
    replicas; test doubles)."""

    def __init__(self, stub):
        self.stub = stub
        self.last_error: grpc.RpcError | None = None

    def pick(self, tenant, prompt, session, exclude):
        if exclude:
            assert self.last_error is not None
            raise UpstreamError.from_rpc(self.last_error)
        return None, self.stub

    def failed(self, replica, error, *, overloaded=False) -> str:
        return "verifier"

    def served(self, replica, tenant, ids) -> None:
        pass

    def release(self, replica) -> None:
        pass


class _Routed:
    """A ReplicaSet as an upstream: pick by route, count streams, take failed replicas out."""

    def __init__(self, replicas):
        self.replicas = replicas
        self.last_error: grpc.RpcError | None = None

    def pick(self, tenant, prompt, session, exclude):
        try:
            r, _choice = self.replicas.pick(tenant, prompt, session, exclude)
        except NoReplica as e:
            last = self.last_error
            if last is not None and last.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise UpstreamError.from_rpc(last) from None   # every replica full: its retry hint
            if last is not None:
                raise UpstreamError(grpc.StatusCode.UNAVAILABLE,
                                    f"verifier: {last.details()} ({e.details.removeprefix('verifier: ')})"
                                    ) from None
            raise
        return r, r.stub

    def failed(self, replica, error, *, overloaded=False) -> str:
        if not overloaded:        # a full replica is healthy: only this request goes elsewhere
            self.replicas.failed(replica)
        return replica.address

    def served(self, replica, tenant, ids) -> None:
        self.replicas.served(replica, tenant, ids)

    def release(self, replica) -> None:
        self.replicas.release(replica)


def upstream_of(verifier):
    """The upstream a sample streams from: a ReplicaSet routed, a plain stub as it is."""
    return _Routed(verifier) if isinstance(verifier, ReplicaSet) else _Single(verifier)


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
