"""KV events: the prefix cache's blocks, published over ZeroMQ in vLLM's wire format, so that a
KV-aware router (llm-d's precise prefix scorer, NVIDIA Dynamo's KV router) knows which replica
holds which prefix (``--kv-events-endpoint``; off by default; docs/kv-events.md).

Wire (vLLM's ``vllm.distributed.kv_events``, ``ZmqEventPublisher``): each message has three
frames: the topic (``--kv-events-topic``, UTF-8), the sequence number (8 bytes, big-endian,
from 0, one per batch) and a msgpack ``KVEventBatch``: the array ``[ts, events,
data_parallel_rank]`` (ts: UNIX seconds, float; the rank: 0). An event is a tagged struct as
msgspec encodes vLLM's: with ``--kv-events-encoding array`` (the default; every vLLM up to the
one that dropped ``array_like``, and what llm-d and Dynamo decode, old and new) a list whose
first item is the tag, with ``map`` (vLLM since it dropped ``array_like``) a map whose
``"type"`` is the tag:

    BlockStored:      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
    BlockRemoved:     block_hashes, medium
    AllBlocksCleared: (no fields)

Hashes are :func:`dflash.core.prefix_blocks.stable_block_hashes` (unsigned 64-bit, the chain over
the tenant's salt and the token ids, recomputable in any process); ``lora_id`` and ``lora_name``
are nil (no adapters); ``medium`` is where the cached K/V lives ("GPU" or "CPU").

The cache queues its changes (:class:`KVEventPublisher` is its ``BlockSink``; a bounded queue,
never waited on: a full queue drops the batch, counts it, and the next drained moment sends a
snapshot instead) and one thread, the only one touching the sockets, encodes and sends them.
The PUB side is an XPUB socket: every new subscription makes the cache send a snapshot
(``AllBlocksCleared`` then its blocks, one batch), so a consumer that joins late, or that
reconnects to a restarted verifier, holds exactly this process's blocks. The first batch
(sequence 0) is that snapshot too: a restarted verifier starts with ``AllBlocksCleared``.
Optional replay (``--kv-events-replay-endpoint``, a ROUTER socket, vLLM's protocol): a request
``[b"", start_seq (8 bytes big-endian)]`` is answered with every buffered ``[b"", seq, payload]``
from it on, then ``[b"", -1 (8 bytes, signed), b""]``; a DEALER reads them all (a REQ socket,
which adds the empty frame itself, reads only the first answer).

The events carry tenants' token ids: the endpoints are the operator's (bound to loopback unless
told otherwise), never a client port.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from prometheus_client.core import CounterMetricFamily

from dflash.core.prefix_blocks import stable_block_hashes
from verifier_svc.block_journal import BlockChange, Snapshot

log = logging.getLogger("dflash.verifier")

ENCODINGS = ("array", "map")
END_SEQ = (-1).to_bytes(8, "big", signed=True)         # the replay's last message
_POLL_S = 0.05        # how often the thread looks at subscriptions and replay requests when idle


class KVEventsError(ValueError):
    """An endpoint that cannot be bound or connected (the message names the flag)."""


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """The publisher's settings (vLLM's ``KVEventsConfig`` names, where it has them).

    ``endpoint``: ZeroMQ endpoints bound, ``connect``: connected (a consumer that binds, as
    llm-d's indexer does), comma-separated; neither = off. ``max_queue_size``: batches queued
    for the thread, ``buffer_steps``: batches kept for replay, ``hwm``: ZeroMQ's high-water mark
    per subscriber (messages; past it ZeroMQ drops, the consumer's next resync heals).
    """

    endpoint: str = ""
    connect: str = ""
    topic: str = ""
    replay_endpoint: str = ""
    encoding: str = "array"
    max_queue_size: int = 10_000
    buffer_steps: int = 10_000
    hwm: int = 100_000
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding: must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size: must be >= 1, got {self.max_queue_size}")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.connect)


# ---------------------------------------------------------------------- the events (wire shapes)
def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 medium: str, encoding: str) -> Any:
    """A ``BlockStored``: ``hashes`` of consecutive blocks after ``parent`` (None: from the
    root), ``token_ids`` their ids (``len(hashes) * block_size``)."""
    if encoding == "map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": token_ids, "block_size": block_size, "lora_id": None,
                "medium": medium, "lora_name": None}
    return ["BlockStored", hashes, parent, token_ids, block_size, None, medium, None]


def block_removed(hashes: list[int], medium: str, encoding: str) -> Any:
    if encoding == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def all_blocks_cleared(encoding: str) -> Any:
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[Any], data_parallel_rank: int) -> bytes:
    """The msgpack ``KVEventBatch`` payload."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


class EventBuilder:
    """Block changes and snapshots of the cache as vLLM events (stable hashes, runs of blocks)."""

    def __init__(self, block: int, medium: str, encoding: str):
        self.block, self.medium, self.encoding = block, medium, encoding

    def _stored_runs(self, chain: list[int], tokens: tuple[int, ...], depths: tuple[int, ...]
                     ) -> list[Any]:
        """One ``BlockStored`` per run of consecutive ``depths`` of the entry ``tokens``."""
        out, b = [], self.block
        start = prev = depths[0]
        for d in [*depths[1:], None]:
            if d is not None and d == prev + 1:
                prev = d
                continue
            parent = chain[start - 1] if start else None
            out.append(block_stored(chain[start:prev + 1], parent, list(tokens[start * b:(prev + 1) * b]),
                                    b, self.medium, self.encoding))
            if d is not None:
                start = prev = d
        return out

    def changes(self, changes: list[BlockChange]) -> list[Any]:
        """One operation's events: its removals (one ``BlockRemoved``), then its stores."""
        removed: list[int] = []
        stored: list[Any] = []
        for c in changes:
            chain = stable_block_hashes(c.tenant, c.tokens, self.block, upto=c.depths[-1] + 1)
            if c.stored:
                stored.extend(self._stored_runs(chain, c.tokens, c.depths))
            else:
                removed.extend(chain[d] for d in c.depths)
        head = [block_removed(removed, self.medium, self.encoding)] if removed else []
        return head + stored

    def snapshot(self, entries: Snapshot) -> list[Any]:
        """``AllBlocksCleared`` then every held block once (entries sharing a prefix: its
        blocks in the first of them, the rest after them as their parent)."""
        events = [all_blocks_cleared(self.encoding)]
        seen: set[int] = set()
        for tenant, tokens, n in entries:
            chain = stable_block_hashes(tenant, tokens, self.block, upto=n)
            first = next((i for i, h in enumerate(chain) if h not in seen), n)
            if first < n:
                events.extend(self._stored_runs(chain, tokens, tuple(range(first, n))))
                seen.update(chain[first:])
        return events


# ---------------------------------------------------------------------- the publisher
class KVEventPublisher:
    """The prefix cache's ``BlockSink``: queues its changes (never blocking the caller) and
    publishes them from one thread. ``queued`` / ``published`` / ``dropped``: batches queued /
    sent (batch ``queued - 1`` is the last one that will go out: its sequence number) / not
    queued.

    Args:
        config: the endpoints and bounds (``config.enabled`` must hold).
        block: tokens per block (the cache's), medium: "GPU" or "CPU".
        start: start the thread now (tests start it later to fill the queue).

    Raises:
        KVEventsError: an endpoint cannot be bound or connected (naming it).
    """

    def __init__(self, config: KVEventsConfig, *, block: int, medium: str, start: bool = True):
        if not config.enabled:
            raise ValueError("config: no endpoint to bind or connect")
        self.config = config
        self.builder = EventBuilder(block, medium, config.encoding)
        self.queued = self.published = self.dropped = 0
        self.endpoints: list[str] = []               # where it publishes (bound ports resolved)
        self.replay_endpoints: list[str] = []
        self._queue: queue.Queue[tuple[str, float, Any] | None] = queue.Queue(config.max_queue_size)
        self._lost = False                           # a batch was dropped: a snapshot is due
        self._resync: Callable[[], None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 0))
        self._seq = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._pub, self._replay = self._open()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        if start:
            self.start()

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        c = self.config
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)          # every subscription, not only a topic's first
        pub.setsockopt(zmq.SNDHWM, c.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        for flag, endpoints, bind in (("--kv-events-endpoint", c.endpoint, True),
                                      ("--kv-events-connect", c.connect, False)):
            for ep in filter(None, (e.strip() for e in endpoints.split(","))):
                self.endpoints.append(_attach(pub, ep, bind, flag))
        replay = None
        for ep in filter(None, (e.strip() for e in c.replay_endpoint.split(","))):
            if replay is None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoints.append(_attach(replay, ep, True, "--kv-events-replay-endpoint"))
        return pub, replay

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (what is still queued is sent first, if it can be) and the sockets."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass                                     # the thread sees _stop between batches
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ BlockSink (cache's lock held)
    def attached(self, resync: Callable[[], None]) -> None:
        self._resync = resync

    def changed(self, changes: list[BlockChange]) -> None:
        if self._lost:                               # the coming snapshot covers this batch
            self.dropped += 1
            return
        self._offer(("changes", time.time(), changes))

    def snapshot(self, entries: Snapshot) -> None:
        self._lost = False
        self._offer(("snapshot", time.time(), entries))

    def _offer(self, item: tuple[str, float, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._lost = True
            self.dropped += 1
        else:
            self.queued += 1

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            want = self._serve_sockets()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                item = None
                if self._stop.is_set():
                    break
            else:
                if item is None:
                    break                            # close()'s sentinel
                try:
                    self._send(item)
                except Exception:                    # never let one batch end the stream
                    log.exception("kv events: a batch could not be sent; a snapshot follows")
                    self.dropped += 1
                    self._lost = True
                if self._stop.is_set() and self._queue.empty():
                    break
            # a new subscriber, or dropped batches once the queue has drained: the whole state
            if (want or (self._lost and self._queue.empty())) and self._resync is not None:
                self._resync()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _send(self, item: tuple[str, float, Any]) -> None:
        kind, ts, body = item
        events = self.builder.snapshot(body) if kind == "snapshot" else self.builder.changes(body)
        payload = encode_batch(ts, events, self.config.data_parallel_rank)
        seq = self._seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart([self.config.topic.encode(), seq, payload], zmq.NOBLOCK)
        except zmq.Again:                            # XPUB drops past the HWM itself; never wait
            pass
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += 1

    def _serve_sockets(self) -> bool:
        """Read new subscriptions (True: one arrived, a snapshot is due) and answer replay
        requests; never waits."""
        subscribed = False
        while self._pub.poll(0):
            frame = self._pub.recv()
            subscribed |= frame[:1] == b"\x01"
        while self._replay is not None and self._replay.poll(0):
            self._answer_replay(self._replay.recv_multipart())
        return subscribed

    def _answer_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request (%d frames) ignored", len(frames))
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([peer, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([peer, b"", END_SEQ, b""])


def _attach(sock: zmq.Socket, endpoint: str, bind: bool, flag: str) -> str:
    """Bind or connect ``sock``; the endpoint it ended at (a bound wildcard port resolved)."""
    try:
        if bind:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as e:
        raise KVEventsError(f"{flag}: cannot {'bind' if bind else 'connect'} {endpoint!r}: {e}") from None


class KVEventsMetrics:
    """``dflash_verifier_kv_events_{published,dropped}_total`` of a publisher, read at scrape."""

    def __init__(self, registry, publisher: KVEventPublisher):
        self.publisher = publisher
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        p = self.publisher
        for name, value, doc in (
                ("published", p.published, "KV event batches published (ZeroMQ)."),
                ("dropped", p.dropped, "KV event batches dropped because the publisher's queue "
                 "was full (a snapshot follows once it drains).")):
            c = CounterMetricFamily(f"dflash_verifier_kv_events_{name}", doc)
            c.add_metric([], float(value))
            yield c
