"""KV events of the prefix cache (``verifier_svc.kv_events``), read the way a KV-aware router
reads vLLM's: a plain ZeroMQ SUB socket and msgpack, decoded from vLLM's documented schema
(``KVEventBatch`` = [ts, events, data_parallel_rank]; ``BlockStored`` = block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name; ``BlockRemoved`` =
block_hashes, medium; ``AllBlocksCleared``; events as tagged arrays or tagged maps), with none of
the publisher's classes. After every step of a real ``PrefixCache`` put / evict / cover / pin /
checkout / clear sequence (fake K/V, no model) the consumer's blocks (hash -> token ids, and
each block's parent) equal the cache's own, with hashes recomputed from the documented recipe.
Also: the flags off open no socket, a full queue drops and counts instead of blocking (and a
snapshot heals the consumer), a new subscriber gets the whole state, and replay answers
vLLM's replay protocol."""

from __future__ import annotations

import hashlib
import random
import struct

import msgpack
import pytest
import zmq

from verifier_svc.flags import parse_args, zmq_endpoints
from verifier_svc.kv_events import KVEventPublisher, KVEventsConfig
from verifier_svc.prefix_cache import PrefixCache
from verifier_svc.server import start_kv_events

KVB = 10                  # bytes per position in these tests
B = 4                     # tokens per block
WAIT_MS = 20_000          # a hang guard only: every wait below ends on a message


class Seq:
    """A stand-in for a spilled pool sequence."""

    def __init__(self, n: int):
        self.n = n

    def get_seq_length(self) -> int:
        return self.n


def put(cache, tenant, tokens, *, pin=False):
    return cache.put(tenant, tokens, Seq(len(tokens)), None, (), pin=pin)


# ---------------------------------------------------------------------- the consumer (vLLM's schema)
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name")
REMOVED_FIELDS = ("block_hashes", "medium")


def fields(event) -> tuple[str, dict]:
    """(tag, fields) of a msgspec tagged struct: an array [tag, *fields in declaration order] or
    a map with the tag under "type"."""
    if isinstance(event, dict):
        return event["type"], event
    tag, values = event[0], event[1:]
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
    return tag, dict(zip(names, values, strict=False))


class Blocks:
    """The blocks a stream of events says are held: hash -> token ids, hash -> parent."""

    def __init__(self):
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, int | None] = {}
        self.last_events: list = []
        self.mediums: set[str] = set()

    def apply(self, events: list) -> None:
        self.last_events = [fields(e) for e in events]
        for tag, f in self.last_events:
            if tag == "AllBlocksCleared":
                self.blocks.clear()
                self.parents.clear()
            elif tag == "BlockStored":
                self._stored(f)
            else:
                assert tag == "BlockRemoved", tag
                self.mediums.add(f["medium"])
                for h in f["block_hashes"]:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
                    del self.parents[h]

    def _stored(self, f: dict) -> None:
        hashes, n = f["block_hashes"], f["block_size"]
        assert n == B and len(f["token_ids"]) == len(hashes) * n
        assert f["lora_id"] is None and f["lora_name"] is None
        self.mediums.add(f["medium"])
        parent = f["parent_block_hash"]
        assert parent is None or parent in self.blocks, "a block whose parent is not held"
        for i, h in enumerate(hashes):
            assert 0 <= h < 2**64
            self.blocks[h] = tuple(f["token_ids"][i * n:(i + 1) * n])
            self.parents[h] = parent
            parent = h


class Consumer(Blocks):
    """Subscribes to ``endpoint`` and applies each batch as it reads it."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        super().__init__()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.last_seq = -1

    def close(self):
        self.ctx.destroy(linger=0)

    def read(self) -> None:
        assert self.sub.poll(WAIT_MS), "no KV event batch arrived"
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        self.last_seq = int.from_bytes(seq, "big")
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        self.apply(events)

    def read_until(self, seq: int) -> None:
        while self.last_seq < seq:
            self.read()


# ---------------------------------------------------------------------- the cache's own state
def recipe(tenant: str, tokens, n: int) -> list[int]:
    """docs/kv-events.md's hash recipe, written out here (not the project's function)."""
    prev = hashlib.blake2b(tenant.encode(), digest_size=8, person=b"dflash-kv-root").digest()
    out = []
    for i in range(n):
        data = prev + struct.pack(f"<{B}q", *tokens[i * B:(i + 1) * B])
        prev = hashlib.blake2b(data, digest_size=8, person=b"dflash-kv-block").digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def cache_state(cache) -> tuple[dict, dict]:
    blocks, parents = {}, {}
    for tenant, tokens, n in cache.indexed():
        chain = recipe(tenant, tokens, n)
        for i, h in enumerate(chain):
            blocks[h] = tuple(tokens[i * B:(i + 1) * B])
            parents[h] = chain[i - 1] if i else None
    return blocks, parents


def in_sync(consumer, pub, cache) -> None:
    """The consumer has every queued batch and holds exactly the cache's blocks."""
    consumer.read_until(pub.queued - 1)
    assert (consumer.blocks, consumer.parents) == cache_state(cache)


def subscribed(cache, **config):
    """A cache publishing on a loopback port with one consumer connected and caught up."""
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", **config), block=B,
                           medium="CPU")
    cache.attach_events(pub)
    consumer = Consumer(pub.endpoints[0])
    while not any(tag == "AllBlocksCleared" for tag, _ in consumer.last_events):
        consumer.read()                 # the snapshot its subscription asked for
    in_sync(consumer, pub, cache)
    return pub, consumer


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_consumer_holds_the_caches_blocks_after_every_step(encoding):
    cache = PrefixCache(60 * KVB, KVB, block=B)
    pub, consumer = subscribed(cache, encoding=encoding)
    try:
        def step(fn, batches):
            before = pub.queued
            fn()
            assert pub.queued - before == batches
            in_sync(consumer, pub, cache)

        t1, t2 = list(range(10)), list(range(10)) + list(range(50, 60))
        step(lambda: put(cache, "A", t1), 1)
        step(lambda: put(cache, "A", t2), 1)              # covers t1: only its new blocks
        (tag, f), = consumer.last_events
        assert tag == "BlockStored" and len(f["block_hashes"]) == 3
        assert f["parent_block_hash"] == recipe("A", t2, 2)[1]
        step(lambda: put(cache, "B", t2), 1)              # another tenant: its own hashes
        assert set(recipe("A", t2, 5)).isdisjoint(recipe("B", t2, 5))
        sibling = list(range(8)) + list(range(70, 78))
        step(lambda: put(cache, "A", sibling), 1)         # shares A's first two blocks
        step(lambda: put(cache, "C", list(range(100, 112))), 1)   # past the bound: evicts A's t2
        assert [tag for tag, _ in consumer.last_events] == ["BlockRemoved", "BlockStored"]
        pinned = {}
        step(lambda: pinned.update(e=put(cache, "A", sibling + [80, 81, 82, 83], pin=True)), 1)
        step(lambda: cache.checkout(pinned["e"]), 1)      # the session's next turn takes it
        held = {}
        step(lambda: held.update(e=cache.lookup("B", t2 + [1], (), 20)[0]), 0)
        step(cache.clear, 1)                              # B's entry is referenced: it stays
        step(lambda: cache.release(held["e"]), 0)
        step(lambda: put(cache, "B", t2), 0)              # already held: nothing kept
        step(lambda: put(cache, "B", [1, 2, 3]), 0)       # no full block: nothing kept
        assert consumer.blocks and consumer.mediums == {"CPU"}
        assert pub.dropped == 0
    finally:
        consumer.close()
        pub.close()


def test_random_operations_keep_the_consumer_in_sync():
    rng = random.Random(7)
    cache = PrefixCache(80 * KVB, KVB, block=B)
    pub, consumer = subscribed(cache)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    pins, refs = [], []
    try:
        for _ in range(150):
            op = rng.random()
            tenant = rng.choice("AB")
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            if op < 0.55:
                e = put(cache, tenant, tokens, pin=rng.random() < 0.15)
                if e is not None and e.pinned:
                    pins.append(e)
            elif op < 0.7 and pins:
                e = pins.pop(rng.randrange(len(pins)))
                if rng.random() < 0.5:
                    cache.checkout(e)
                else:
                    cache.unpin(e)
            elif op < 0.85:
                e, _ = cache.lookup(tenant, tokens, (), len(tokens))
                if e is not None:
                    refs.append(e)
            elif refs:
                cache.release(refs.pop(rng.randrange(len(refs))))
            in_sync(consumer, pub, cache)
        assert len(consumer.blocks) > 0 and pub.dropped == 0
    finally:
        consumer.close()
        pub.close()


def test_a_full_queue_drops_and_counts_and_a_snapshot_heals():
    cache = PrefixCache(1 << 20, KVB, block=B)
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", max_queue_size=2),
                           block=B, medium="GPU", start=False)     # nothing drains the queue
    cache.attach_events(pub)                                        # its snapshot: 1 queued
    put(cache, "A", list(range(8)))                                 # 2 queued: full
    put(cache, "A", list(range(8)) + [9, 9, 9, 9])                  # dropped, not waited for
    put(cache, "B", list(range(12)))                                # dropped too
    assert (pub.queued, pub.dropped) == (2, 2)
    consumer = Consumer(pub.endpoints[0])
    try:
        pub.start()
        consumer.read_until(2)           # past the two queued: a snapshot of the whole state
        in_sync(consumer, pub, cache)
        assert {tag for tag, _ in consumer.last_events} == {"AllBlocksCleared", "BlockStored"}
        assert consumer.mediums == {"GPU"}
        put(cache, "C", list(range(20, 28)))                        # and changes flow again
        in_sync(consumer, pub, cache)
        assert pub.dropped == 2
    finally:
        consumer.close()
        pub.close()


def test_replay_answers_from_a_sequence_number():
    cache = PrefixCache(1 << 20, KVB, block=B)
    pub, consumer = subscribed(cache, replay_endpoint="tcp://127.0.0.1:*")
    # vLLM's protocol answers one request with many messages: a DEALER reads them all (a REQ
    # socket reads only the first), sending the empty delimiter a REQ would add itself
    req = consumer.ctx.socket(zmq.DEALER)
    try:
        put(cache, "A", list(range(8)))
        put(cache, "A", list(range(16)))
        put(cache, "B", list(range(4)))
        in_sync(consumer, pub, cache)
        req.connect(pub.replay_endpoints[0])
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed, seqs = Blocks(), []
        while True:
            assert req.poll(WAIT_MS), "the replay did not end"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            seqs.append(int.from_bytes(seq, "big"))
            replayed.apply(msgpack.unpackb(payload)[1])
        assert seqs == list(range(pub.queued))
        assert (replayed.blocks, replayed.parents) == cache_state(cache)
    finally:
        consumer.close()
        pub.close()


def test_the_flags_off_open_no_socket(monkeypatch):
    class NoContext:
        def __init__(self, *a, **k):
            raise AssertionError("a ZeroMQ context was opened")

    cache = PrefixCache(1 << 20, KVB, block=B)
    with monkeypatch.context() as m:
        m.setattr(zmq, "Context", NoContext)
        assert start_kv_events(parse_args(["--target", "t"]), cache, "CPU") is None
        assert cache._sink is None
        with pytest.raises(AssertionError, match="ZeroMQ context"):         # the flag on: one
            start_kv_events(parse_args(["--target", "t", "--kv-events-endpoint",
                                        "tcp://127.0.0.1:*"]), cache, "CPU")
    pub = start_kv_events(parse_args(["--target", "t", "--kv-events-endpoint",
                                      "tcp://127.0.0.1:*"]), cache, "CPU")
    try:
        assert pub is not None and cache._sink is pub
        assert pub.endpoints[0].startswith("tcp://127.0.0.1:")
    finally:
        pub.close()


def test_endpoint_flags_default_to_loopback_and_refuse_client_ports(capsys):
    assert zmq_endpoints("5557") == "tcp://127.0.0.1:5557"
    assert zmq_endpoints("tcp://*:5557, ipc:///tmp/kv") == "tcp://*:5557,ipc:///tmp/kv"
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--kv-events-endpoint", "http://x:1"])
    assert "--kv-events-endpoint" in capsys.readouterr().err
    cache = PrefixCache(1 << 20, KVB, block=B)
    a = parse_args(["--target", "t", "--bind", "0.0.0.0:50051", "--kv-events-endpoint", "50051"])
    with pytest.raises(SystemExit, match="--kv-events-endpoint"):
        start_kv_events(a, cache, "CPU")
    a = parse_args(["--target", "t", "--metrics-port", "9100",
                    "--kv-events-replay-endpoint", "9100", "--kv-events-endpoint", "tcp://127.0.0.1:*"])
    with pytest.raises(SystemExit, match="--kv-events-replay-endpoint"):
        start_kv_events(a, cache, "CPU")
    assert cache._sink is None
