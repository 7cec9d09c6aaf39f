"""Client side of the verifier <-> drafter stream: a ``Proposer`` backed by a remote drafter.

One long-lived bidirectional ``Draft`` stream per drafter address multiplexes every session of
this verifier. Requests carry a ``batch_id``; a reader thread resolves the waiting caller when
the reply with that id arrives. Every failure (unreachable, stream broken, deadline exceeded,
an error string) becomes a ``DraftError`` for that step, never an exception into the decode
loop; a broken stream is reopened on a later call after a short back-off.

A step waits for its drafts at most the step's **deadline**: what speculating is worth this
step (``budget_s``, ``StepCostModel.draft_budget``), within ``[BreakerConfig.deadline_floor_s,
timeout_s]`` (``--draft-timeout``); ``timeout_s`` without a budget, for an **upload**
(``draft_wire.is_upload``: not priced by the cost model) and behind one. A later reply goes
unused (``DraftError(LATE)``; its context still lands on the drafter) and the miss counts.

A :class:`~verifier_svc.breaker.CircuitBreaker` per drafter takes one that is too slow or keeps
failing out of the step path (verifier_svc/breaker.py); this client counts its misses and runs
its prober.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout

import grpc

from dflash.core.convert import card_from_proto
from dflash.core.proposer import DrafterCard, DraftError, FallbackReason, Proposal, ProposalRequest
from dflash.serving.server import channel_options
from dflash.serving.tls import ClientTLS, channel as tls_channel
from dflash.v1 import drafter_pb2, drafter_pb2_grpc
from verifier_svc.breaker import FAILING, SLOW, BreakerConfig, CircuitBreaker, TripReason
from verifier_svc.cost_model import EMA
from verifier_svc.draft_wire import (
    WireLog,
    WireStat,
    failed_sessions,
    from_result,
    is_upload,
    probe_item,
    to_items,
)
from verifier_svc.drafter_sync import LATE

log = logging.getLogger("dflash.verifier.drafter_client")
PROBE_SESSION = "dflash-breaker-probe"     # the prober's session on the drafter (released)

def describe(address: str, timeout_s: float = 5.0, tls: ClientTLS | None = None) -> DrafterCard:
    """Fetch the drafter card at ``address`` (over TLS when ``tls``). Raises grpc.RpcError when
    unreachable (UNAVAILABLE also when the TLS handshake fails: wrong CA, name, expired)."""
    with tls_channel(address, tls) as ch:
        return card_from_proto(drafter_pb2_grpc.DrafterStub(ch).Describe(
            drafter_pb2.DescribeDrafterRequest(), timeout=timeout_s))


class RemoteProposer:
    """``Proposer`` over the Draft stream of the drafter at ``address``.

    Args:
        address: host:port of a Drafter service.
        card: its card (already checked against the target by the caller).
        timeout_s: the longest a step waits for its drafts (``--draft-timeout``); past it the
            step runs without speculation. A step with a budget waits less (module docstring).
        reconnect_backoff_s: after a broken stream, calls fail fast for this long.
        wire_dtype: dtype of context features on the wire (float32 keeps tests bit-exact).
        breaker: when the drafter is taken out of the step path (:class:`BreakerConfig`).
        tls: connect with TLS (mTLS when it carries a client certificate); None = plaintext.
    """

    MAX_IN_FLIGHT = 4   # unanswered send_context batches before the next one waits

    def __init__(self, address: str, card: DrafterCard, *, timeout_s: float = 2.0,
                 reconnect_backoff_s: float = 0.5, wire_dtype=None,
                 breaker: BreakerConfig = BreakerConfig(), tls: ClientTLS | None = None):
        self.address = address
        self.card = card
        self.timeout_s = timeout_s
        self.backoff_s = reconnect_backoff_s
        self.wire_dtype = wire_dtype
        # Reconnect quickly after a drafter restart (gRPC's default back-off grows to minutes).
        self._channel = tls_channel(address, tls, options=channel_options() + [
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._queue: queue.Queue | None = None
        self._broken_at = 0.0
        self.last_wire_bytes = 0
        self.wire_stats = WireLog()   # each session's last call (take_wire_stat)
        self._in_flight: collections.deque[Future] = collections.deque()   # send_context's
        self._uploads: list[Future] = []    # unanswered batches that carry an upload
        self.breaker_config = breaker
        self.breaker = CircuitBreaker(breaker.failures)
        self.latency = EMA(0.1)        # seconds per answered draft call (late replies included)
        self.last_deadline_s = 0.0     # the last draft call's deadline
        self._closed = threading.Event()

    # ------------------------------------------------------------------ stream management
    def _open_locked(self) -> queue.Queue | None:
        if self._queue is not None:
            return self._queue
        if time.monotonic() - self._broken_at < self.backoff_s:
            return None
        if self._broken_at:
            try:  # the drafter came back: it may be another version at the same address
                card = card_from_proto(self._stub.Describe(drafter_pb2.DescribeDrafterRequest(),
                                                           timeout=self.timeout_s))
            except grpc.RpcError:
                self._broken_at = time.monotonic()
                return None
            if card.target_layer_ids != self.card.target_layer_ids or card.hidden_size != self.card.hidden_size:
                log.warning("drafter at %s changed taps/hidden size; not using it", self.address)
                self._broken_at = time.monotonic()
                return None
            self.card = card
        q: queue.Queue = queue.Queue()

        def requests():
            while (item := q.get()) is not None:
                yield item

        call = self._stub.Draft(requests())
        threading.Thread(target=self._read, args=(call, q), daemon=True,
                         name=f"drafter-reader-{self.address}").start()
        self._queue = q
        return q

    def _read(self, call, q: queue.Queue) -> None:
        try:
            for resp in call:
                with self._lock:
                    fut = self._pending.pop(resp.batch_id, None)
                if fut is not None:
                    fut.set_result(resp)
        except grpc.RpcError as e:
            log.warning("drafter stream %s broken: %s", self.address, e.code())
        finally:
            with self._lock:
                if self._queue is q:
                    self._queue = None
                    self._broken_at = time.monotonic()
                pending, self._pending = self._pending, {}
            q.put(None)
            for fut in pending.values():
                fut.set_exception(DraftError(FallbackReason.UNAVAILABLE, "drafter stream closed"))

    def _reachable(self) -> bool:
        """Describe answers (outside the lock: reopening the stream describes it again under
        the lock, and a dead drafter must not hold that lock for a whole timeout)."""
        try:
            self._stub.Describe(drafter_pb2.DescribeDrafterRequest(), timeout=self.timeout_s)
            return True
        except grpc.RpcError:
            return False

    # ------------------------------------------------------------------ Proposer
    def _items(self, requests: list[ProposalRequest]) -> list:
        items, self.last_wire_bytes = to_items(requests, self.wire_dtype)
        return items

    def _send(self, items: list, requests: Sequence[ProposalRequest] = ()) -> tuple[int, Future] | None:
        """Queue one DraftBatch on the stream: (batch id, future of its reply), or None in
        reconnect back-off. A batch whose ``requests`` upload context is remembered until
        answered (:meth:`behind_upload`)."""
        bid = next(self._ids)
        fut: Future = Future()
        with self._lock:
            q = self._open_locked()
            if q is None:
                return None
            self._pending[bid] = fut
            self._uploads = [f for f in self._uploads if not f.done()]
            if any(map(is_upload, requests)):
                self._uploads.append(fut)
        q.put(drafter_pb2.DraftBatch(batch_id=bid, items=items))
        return bid, fut

    def behind_upload(self) -> bool:
        """Whether an upload sent on the stream is still unanswered (a call sent now queues
        behind it on the drafter)."""
        with self._lock:
            return any(not f.done() for f in self._uploads)

    def deadline(self, budget_s: float | None) -> float:
        """Seconds a draft call waits: ``budget_s`` clamped to [deadline floor, ``timeout_s``];
        ``timeout_s`` without a budget."""
        if budget_s is None:
            return self.timeout_s
        return min(self.timeout_s, max(self.breaker_config.deadline_floor_s, budget_s))

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        """``Proposer.propose``: waits up to ``timeout_s``."""
        return self.propose_within(requests, None, lambda ids: None)

    def propose_within(self, requests: list[ProposalRequest], budget_s: float | None,
                       on_late_failure: Callable[[list[str]], None]
                       ) -> list[Proposal | DraftError]:
        """One draft call waiting at most :meth:`deadline` of ``budget_s`` (seconds this
        step's drafts are worth; None = not known: ``timeout_s``).

        Past a budget-derived deadline (shorter than ``timeout_s``) every result is
        ``DraftError(LATE)`` and the batch stays on the stream: the drafter still takes in
        its context, and the sessions whose late reply is an error (or never comes: the stream
        broke) are passed to ``on_late_failure`` from the reader thread, so the caller resends
        their context. Past ``timeout_s`` they are ``DraftError(FallbackReason.TIMEOUT)``, the reply is
        dropped and the caller must resend. Each miss counts against the breaker (SLOW,
        FAILING); a reply in time with a budget resets its count."""
        if self.breaker.is_open:
            return [DraftError(FallbackReason.CIRCUIT_OPEN, f"drafter {self.address} out of the step path")] \
                * len(requests)
        if budget_s is not None and (self.behind_upload() or any(map(is_upload, requests))):
            budget_s = None                      # an upload: the budget does not price it
        deadline = self.last_deadline_s = self.deadline(budget_s)
        cut = deadline < self.timeout_s          # the budget, not the cap, set this deadline
        items = self._items(requests)
        t_send = time.perf_counter()
        sent = self._send(items, requests)
        if sent is None:
            return self._failed(DraftError(FallbackReason.UNAVAILABLE, "drafter stream reconnect back-off"),
                                len(requests))
        bid, fut = sent
        try:
            resp = fut.result(timeout=deadline)
        except FutureTimeout:
            if cut:
                self._late(fut, [r.session_id for r in requests], t_send, on_late_failure)
                return self._failed(DraftError(LATE, f"no draft within {deadline:.3f}s, what "
                                               "speculating is worth this step"),
                                    len(requests), SLOW, deadline)
            with self._lock:
                self._pending.pop(bid, None)
            return self._failed(DraftError(FallbackReason.TIMEOUT, f"no draft within {self.timeout_s}s"),
                                len(requests))
        except DraftError as e:
            return self._failed(e, len(requests))
        if len(resp.results) != len(requests):
            return self._failed(DraftError(FallbackReason.MALFORMED_BLOCK, "result count mismatch"),
                                len(requests))
        seconds = time.perf_counter() - t_send
        with self._lock:
            self.latency.add(seconds)
        if budget_s is not None:
            # answered in time; per-session errors are not its health. A call without a
            # budget (a whole-context upload) says nothing about the steady wait.
            self.breaker.success()
        self.wire_stats.record(items, seconds, resp.draft_seconds)
        return [from_result(r) for r in resp.results]

    def _late(self, fut: Future, ids: list[str], t_send: float,
              on_failed: Callable[[list[str]], None]) -> None:
        """A reply the step stopped waiting for: its latency still counts, and the sessions it
        failed (an error, a broken stream) are reported."""

        def done(f: Future) -> None:
            try:
                resp = f.result()
            except Exception:
                on_failed(ids)
                return
            with self._lock:
                self.latency.add(time.perf_counter() - t_send)
            if bad := failed_sessions(resp, ids):
                on_failed(bad)

        fut.add_done_callback(done)

    # ------------------------------------------------------------------ circuit breaker
    def _failed(self, e: DraftError, n: int, reason: TripReason = FAILING,
                readmit_s: float | None = None) -> list[Proposal | DraftError]:
        """Count a miss (a deadline missed: ``reason`` SLOW when the budget set it) or a failed
        call (stream down, bad reply); open the breaker and start the prober when that makes
        ``failures`` in a row. A probe must then answer within ``readmit_s`` (default
        ``timeout_s``)."""
        if self.breaker.failure(reason, self.timeout_s if readmit_s is None else readmit_s):
            log.warning("drafter %s: %d misses or failed calls in a row (last: %s); circuit open "
                        "(%s), its sessions run without speculation", self.address,
                        self.breaker.consecutive, e.reason, reason)
            threading.Thread(target=self._probe_until_healthy, daemon=True,
                             name=f"drafter-prober-{self.address}").start()
        return [e] * n

    def _probe_until_healthy(self) -> None:
        """While open: every ``probe_interval_s`` one tiny draft (a one-row zero context, one
        draft position) on the stream; the first answered within the breaker's ``readmit_s``
        (the deadline it tripped on) closes the breaker. Any answer counts, an error one
        included: it shows the drafter replies in time, and it queues behind every batch still
        on the stream."""
        width = len(self.card.target_layer_ids) * self.card.hidden_size
        while not self._closed.wait(self.breaker_config.probe_interval_s):
            item = probe_item(PROBE_SESSION, width, self.wire_dtype)
            if self._queue is None and not self._reachable():
                continue
            t0 = time.perf_counter()
            sent = self._send([item])
            ok = False
            if sent is not None:
                try:
                    sent[1].result(timeout=self.breaker.readmit_s or self.timeout_s)
                    ok = True
                except (FutureTimeout, DraftError):
                    with self._lock:
                        self._pending.pop(sent[0], None)
                self.release([PROBE_SESSION])
            if ok:
                log.warning("drafter %s answered a probe in %.3fs after %.2fs open (%s); circuit "
                            "closed, speculation resumes", self.address, time.perf_counter() - t0,
                            self.breaker.close(), self.breaker.reason)
                return

    def send_context(self, requests: list[ProposalRequest],
                     on_failed: Callable[[list[str]], None]) -> None:
        """Send context-only requests (``block_size`` 1) without waiting for the reply.

        The stream is ordered and the drafter handles its batches one after the other, so a
        later ``propose`` for the same sessions sees this context. The verifier's step does not
        wait for the drafter's round trip (it would be paid on most no-speculation steps of a
        busy batch: every join uploads its prompt). Sessions
        whose update failed (error reply, broken stream, back-off) are passed to ``on_failed``
        from the reader thread; the caller resends their whole context. A later ``propose``
        of such a session also fails (``context_gap``) instead of drafting from a stale
        context.
        """
        ids = [r.session_id for r in requests]
        while len(self._in_flight) >= self.MAX_IN_FLIGHT and not self.breaker.is_open:
            # A drafter slower than the steps: bound its backlog, waiting no longer than the
            # floor (this step drafts nothing, so waiting buys nothing), or than the timeout
            # behind an upload.
            wait = self.timeout_s if self.behind_upload() else self.deadline(0.0)
            try:
                self._in_flight.popleft().result(timeout=wait)
            except FutureTimeout:
                self._failed(DraftError(LATE, "context backlog"), 0,
                             SLOW if wait < self.timeout_s else FAILING, wait)
            except Exception:
                pass   # its callback reports the failure
        if self.breaker.is_open:   # resent in full once the drafter is back
            on_failed(ids)
            return
        items = self._items(requests)
        t_send = time.perf_counter()
        sent = self._send(items, requests)
        if sent is None:
            self._failed(DraftError(FallbackReason.UNAVAILABLE, "drafter stream reconnect back-off"), 0)
            on_failed(ids)
            return

        def done(f: Future) -> None:
            try:
                resp = f.result()
            except Exception:
                on_failed(ids)
                return
            if bad := failed_sessions(resp, ids):
                on_failed(bad)
            if len(resp.results) == len(ids):
                self.wire_stats.record(items, time.perf_counter() - t_send, resp.draft_seconds)

        sent[1].add_done_callback(done)
        self._in_flight.append(sent[1])
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft()

    def take_wire_stat(self, session_id: str) -> WireStat | None:
        """The session's last successful draft call, once (None when the step sent nothing)."""
        return self.wire_stats.take(session_id)

    def release(self, session_ids: list[str]) -> None:
        with self._lock:
            q = self._queue
        self.wire_stats.drop(session_ids)
        if q is not None and session_ids:
            q.put(drafter_pb2.DraftBatch(batch_id=0, release_sessions=list(session_ids)))

    def keep_prefix(self, session_id: str, key: bytes, length: int) -> None:
        """The session ends on the drafter; its context is kept as the prefix ``key`` when the
        drafter holds ``length`` positions (``dflash.core.proposer.PrefixKeeper``). Queued
        behind the session's calls on the stream; a stream that is down keeps nothing (a
        later use of ``key`` is a miss, answered with a full upload)."""
        with self._lock:
            q = self._queue
        self.wire_stats.drop([session_id])
        if q is not None:
            q.put(drafter_pb2.DraftBatch(batch_id=0, keep_prefixes=[drafter_pb2.KeepPrefix(
                session_id=session_id, key=key, length=length)]))

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            q, self._queue = self._queue, None
        if q is not None:
            q.put(None)
        self._channel.close()
