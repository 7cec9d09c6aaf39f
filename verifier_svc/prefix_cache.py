"""The prefix cache: finished requests' target K/V (and taps) kept by token ids, per tenant.

An entry is one finished sequence: its cached positions' token ids, its K/V as a spilled
``PoolSeq`` of exactly that length (``Target.own``) and, when a drafter tapped it, its taps
(``TapRows``, one row per position). A new request copies the longest cached prefix of its
prompt into its own pool row (``Target.fork``) and prefills only the rest
(``verifier_svc.prefix_reuse``). Entries are immutable while they are in the cache: a hit
copies, it never shares rows, so a running request holds no reference once its copy is made.

Keys are salted by the tenant (the gateway's client identity, ``Request.tenant``): a lookup
reads only its own tenant's entries and the operator's declared shared prefixes
(``shared``), so one tenant never reuses, or times, another's prefix. Lookup walks the
prompt's chain of block hashes (``block`` tokens each, salted at the root) to the deepest
block some entry holds, then checks the entry's tokens and extends the match token by token:
exact to the token, whatever the block size.

Memory: entries are counted at ``kv_bytes_per_token`` per position plus their taps' bytes;
past ``max_bytes`` the least recently used unreferenced entries go first. A referenced entry
(``lookup`` until ``release``: a hit being copied) is never evicted; a session's pin
(``put(pin=True)`` until ``checkout`` or ``unpin``) is never evicted and lies outside the
bound (sessions are bounded in number, ``--max-sessions``); an entry covered by a
longer one of the same tenant (a conversation's earlier turn) is dropped when the longer one
arrives. Thread-safe (one lock): lookups run on the scheduler's thread, insertions on the
readers' threads. KV events (off by default): ``CacheEvents.attach_events``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dflash.core.prefix_blocks import BLOCK, block_hashes
from verifier_svc.block_journal import CacheEvents, Snapshot
from verifier_svc.sessions import CacheHandle
from verifier_svc.tap_buffer import TapRows

__all__ = ["BLOCK", "CacheStats", "DrafterPrefix", "Entry", "PrefixCache", "block_hashes", "drafter_key"]

# This process's salt of the drafter's keys: a restarted verifier (an empty cache) names none
# of the prefixes a drafter kept for the one before.
_DRAFTER_SALT = os.urandom(16)


@dataclasses.dataclass(frozen=True)
class DrafterPrefix:
    """What the entry's drafter kept of it: the session's context under ``key``, ``length``
    positions (its first ones; the drafter may hold fewer than the entry's tokens)."""

    proposer: object                   # the drafter it was kept on (a hit on another: no use)
    key: bytes
    length: int


@dataclasses.dataclass(eq=False)
class Entry:
    """One cached sequence (read-only while it is in the cache)."""

    tenant: str
    tokens: tuple[int, ...]            # the ids of its cached positions
    seq: CacheHandle                   # its K/V: a spilled pool sequence of len(tokens) positions
    taps: TapRows | None               # one row per position for ``tap_ids``; None: no taps
    tap_ids: tuple[int, ...]
    nbytes: int
    hashes: list[int] = dataclasses.field(default_factory=list)   # its full blocks' chain hashes
    refs: int = 0                      # acquired (copying, pinned by a session): never evicted
    pinned: bool = False               # a session's between its turns (outside the bound)
    shared: bool = False               # an operator's declared prefix: every tenant reads it
    drafter: DrafterPrefix | None = None   # its drafter's kept context, when it kept one

    @property
    def length(self) -> int:
        return len(self.tokens)

    def usable(self, tap_ids: tuple[int, ...]) -> int:
        """Positions a request tapping ``tap_ids`` may take from it (taps must match too)."""
        if not tap_ids:
            return len(self.tokens)
        if self.taps is None or self.tap_ids != tap_ids:
            return 0
        return min(len(self.tokens), len(self.taps))


def drafter_key(tenant: str, tokens: Sequence[int], tap_ids: Sequence[int]) -> bytes:
    """The key a drafter keeps the context of ``tokens`` (tapped at ``tap_ids``) under for
    ``tenant``: salted like the block hashes (the tenant, then the ids), but a 32-byte digest
    (and this process's salt): the drafter never sees prompt ids, so it cannot check a match
    and trusts the key alone."""
    h = hashlib.blake2b(digest_size=32, key=_DRAFTER_SALT, person=b"dflash-prefix")
    h.update(tenant.encode())
    h.update(b"\0" + ",".join(map(str, tap_ids)).encode() + b"\0")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def _common(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclasses.dataclass
class CacheStats:
    """Counts since start (tokens, as vLLM's ``prefix_cache_queries`` / ``_hits``)."""

    queries: int = 0                   # prompt tokens looked up
    hits: int = 0                      # of those, found cached (what the lookups returned)
    inserted: int = 0                  # entries kept
    evicted: int = 0                   # entries dropped for room
    covered: int = 0                   # entries dropped because a longer one holds them


class PrefixCache(CacheEvents):
    """Cached prefixes by tenant and token ids, bounded in bytes.

    Args:
        max_bytes: bound on the unreferenced entries' bytes (entries past it are evicted,
            least recently used first); >= 0 (0 keeps nothing but pins and shared prefixes).
        kv_bytes_per_token: K/V bytes one position takes (every layer, K and V).
        block: tokens per hashed block, >= 1.
        shared: token-id prefixes the operator declares readable by every tenant (e.g. a
            system prompt); the first request whose prompt starts with one fills it, and it
            stays (pinned) once filled.

    Raises:
        ValueError: naming ``max_bytes``, ``kv_bytes_per_token`` or ``block`` when out of range.
    """

    def __init__(self, max_bytes: int, kv_bytes_per_token: int, *, block: int = BLOCK,
                 shared: Iterable[Sequence[int]] = ()):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token: must be >= 1, got {kv_bytes_per_token}")
        if block < 1:
            raise ValueError(f"block: must be >= 1, got {block}")
        self.max_bytes, self.kv_bytes_per_token, self.block = max_bytes, kv_bytes_per_token, block
        self.shared_prefixes: list[tuple[int, ...]] = sorted(
            {tuple(int(t) for t in p) for p in shared if len(p)}, key=len, reverse=True)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._lru: OrderedDict[int, Entry] = OrderedDict()      # id(entry) -> entry, oldest first
        self._index: dict[int, dict[int, Entry]] = {}            # block hash -> entries holding it
        self._shared: dict[tuple[tuple[int, ...], tuple[int, ...]], Entry] = {}   # (prefix, taps)
        self._bytes = 0
        self._journal, self._sink = None, None          # KV events: CacheEvents.attach_events

    # ------------------------------------------------------------------ KV events (CacheEvents)
    def _snapshot(self) -> Snapshot:
        return [(e.tenant, e.tokens, len(e.hashes)) for e in self._lru.values() if e.hashes]

    # ------------------------------------------------------------------ gauges
    @property
    def nbytes(self) -> int:
        """Bytes of every entry held (pinned and shared ones included)."""
        return self._bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes outside ``max_bytes``: sessions' pins and the shared prefixes."""
        with self._lock:
            return self._pinned_bytes()

    def _pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._lru.values() if e.pinned) + \
            sum(e.nbytes for e in self._shared.values())

    @property
    def entries(self) -> int:
        return len(self._lru) + len(self._shared)

    @property
    def tokens(self) -> int:
        """Positions held by every entry."""
        with self._lock:
            return sum(e.length for e in self._lru.values()) + \
                sum(e.length for e in self._shared.values())

    def entry_bytes(self, length: int, taps: TapRows | None) -> int:
        """Bytes an entry of ``length`` positions with ``taps`` takes."""
        tap_bytes = 0
        if taps is not None and len(taps):
            rows = taps.rows(0)
            tap_bytes = rows.numel() * rows.element_size()
        return length * self.kv_bytes_per_token + tap_bytes

    # ------------------------------------------------------------------ lookup
    def lookup(self, tenant: str, prompt: Sequence[int], tap_ids: tuple[int, ...], limit: int
               ) -> tuple[Entry | None, int]:
        """The entry holding the longest prefix of ``prompt`` (at most ``limit`` positions)
        that ``tenant`` may read, with ``tap_ids``' taps when it taps any, and that prefix's
        length; the entry is acquired (the caller must :meth:`release` it). ``(None, 0)``:
        nothing cached. Counts ``len(prompt)`` queried tokens, and the length as hits."""
        with self._lock:
            best, best_n = self._lookup(tenant, prompt, tap_ids, limit)
            self.stats.queries += len(prompt)
            self.stats.hits += best_n
            if best is None:
                return None, 0
            best.refs += 1
            if not best.shared:
                self._lru.move_to_end(id(best))
            return best, best_n

    def _lookup(self, tenant: str, prompt: Sequence[int], tap_ids: tuple[int, ...], limit: int
                ) -> tuple[Entry | None, int]:
        best, best_n = None, 0
        for p in self.shared_prefixes:
            e = self._shared.get((p, tap_ids)) or (None if tap_ids else self._any_shared(p))
            n = min(len(p), limit)
            if e is not None and n > best_n and tuple(prompt[:len(p)]) == p:
                best, best_n = e, n
                break                           # longest first
        depths: list[dict[int, Entry]] = []
        for h in block_hashes(tenant, prompt[:limit], self.block):
            found = self._index.get(h)
            if not found:
                break
            depths.append(found)
        for depth in range(len(depths), 0, -1):
            base = depth * self.block
            if base <= best_n:
                break
            for e in reversed(list(depths[depth - 1].values())):     # most recently added first
                if e.tokens[:base] != tuple(prompt[:base]):
                    continue                    # a hash collision: not this prefix
                n = min(_common(e.tokens, prompt, base), e.usable(tap_ids), limit)
                if n > best_n:
                    best, best_n = e, n
            if best is not None and best_n >= base:
                break
        return best, best_n

    def _any_shared(self, prefix: tuple[int, ...]) -> Entry | None:
        return next((e for (p, _), e in self._shared.items() if p == prefix), None)

    def acquire(self, entry: Entry) -> None:
        with self._lock:
            entry.refs += 1

    def release(self, entry: Entry) -> None:
        """Drop a reference (:meth:`lookup`, :meth:`acquire`); an unreferenced entry may be
        evicted."""
        with self._lock:
            entry.refs = max(0, entry.refs - 1)
            self._evict()
            self._flush()

    def unpin(self, entry: Entry) -> None:
        """Its session is gone: a pinned entry becomes an ordinary one (within the bound,
        evictable once unreferenced)."""
        with self._lock:
            if entry.pinned:
                entry.pinned = False
                entry.refs = max(0, entry.refs - 1)
            self._evict()
            self._flush()

    # ------------------------------------------------------------------ insertion
    def put(self, tenant: str, tokens: Sequence[int], seq: CacheHandle, taps: TapRows | None,
            tap_ids: tuple[int, ...], *, pin: bool = False) -> Entry | None:
        """Keep ``seq`` (a spilled sequence of ``len(tokens)`` positions, handed over: the
        caller never writes it again) and ``taps`` as ``tenant``'s entry for ``tokens``.

        ``pin``: the entry is returned acquired (a session's K/V between its turns: never
        evicted, and :meth:`checkout` takes it back). Without it the entry is kept unless a
        cached entry already holds ``tokens`` (with these taps) or it does not fit
        ``max_bytes``; returns the entry kept, or None."""
        tokens = tuple(tokens)
        taps = taps if tap_ids else None
        e = Entry(tenant, tokens, seq, taps, tap_ids, self.entry_bytes(len(tokens), taps),
                  block_hashes(tenant, tokens, self.block))
        with self._lock:
            holders = self._holders(e)
            if not pin and (e.nbytes > self.max_bytes or not e.hashes or
                            any(o.length >= e.length and o.usable(tap_ids) >= e.length
                                for o in holders)):
                return None
            for o in holders:            # an earlier turn of the same conversation: covered
                if not o.refs and o.length < e.length and e.usable(o.tap_ids) >= o.length:
                    self._remove(o)
                    self.stats.covered += 1
            if pin:
                e.refs, e.pinned = 1, True
            self._lru[id(e)] = e
            for depth, h in enumerate(e.hashes):
                held = self._index.setdefault(h, {})
                if not held and self._journal is not None:
                    self._journal.note(h, True, e.tenant, e.tokens, depth)
                held[id(e)] = e
            self._bytes += e.nbytes
            self.stats.inserted += 1
            self._evict()
            self._flush()
        return e

    def _holders(self, e: Entry) -> list[Entry]:
        """Entries whose tokens are a prefix of ``e``'s or hold ``e``'s as their prefix."""
        out: list[Entry] = []
        last = len(e.hashes)
        for depth, h in enumerate(e.hashes, 1):
            for o in self._index.get(h, {}).values():
                full = o.length // self.block
                # each entry once: where its own blocks end, or at e's last block if it goes on
                if full != depth and not (depth == last and full > depth):
                    continue
                n = min(o.length, e.length)
                if o.tokens[:n] == e.tokens[:n]:
                    out.append(o)
        return out

    def wants_shared(self, tokens: Sequence[int], tap_ids: tuple[int, ...]) -> list[int]:
        """Lengths of the declared shared prefixes ``tokens`` starts with that are not filled
        yet for ``tap_ids`` (the caller copies them and calls :meth:`put_shared`)."""
        with self._lock:
            return [len(p) for p in self.shared_prefixes
                    if (p, tap_ids) not in self._shared and len(tokens) >= len(p)
                    and tuple(tokens[:len(p)]) == p]

    def put_shared(self, tokens: Sequence[int], seq: CacheHandle, taps: TapRows | None,
                   tap_ids: tuple[int, ...]) -> None:
        """Keep the filled shared prefix ``tokens`` (one of ``shared``; never evicted)."""
        key = (tuple(tokens), tap_ids)
        taps = taps if tap_ids else None
        e = Entry("", key[0], seq, taps, tap_ids, self.entry_bytes(len(tokens), taps), shared=True)
        with self._lock:
            if key[0] in self.shared_prefixes and key not in self._shared:
                self._shared[key] = e
                self._bytes += e.nbytes

    def checkout(self, entry: Entry) -> tuple[CacheHandle, TapRows | None]:
        """Take a pinned entry back out of the cache (its session's next turn): its sequence
        and taps, which the caller owns and writes again."""
        with self._lock:
            if id(entry) in self._lru:
                self._remove(entry)
                self._flush()
            entry.refs, entry.pinned = 0, False
        return entry.seq, entry.taps

    # ------------------------------------------------------------------ eviction
    def _remove(self, e: Entry) -> None:
        del self._lru[id(e)]
        for depth, h in enumerate(e.hashes):
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(id(e), None)
                if not holders:
                    del self._index[h]
                    if self._journal is not None:
                        self._journal.note(h, False, e.tenant, e.tokens, depth)
        self._bytes -= e.nbytes

    def _evict(self) -> None:
        """Drop the least recently used unreferenced entries while the bytes outside the pins
        are past ``max_bytes`` (``_lock`` held; an entry being copied counts, and waits)."""
        over = self._bytes - self._pinned_bytes() - self.max_bytes
        if over <= 0:
            return
        for e in [e for e in self._lru.values() if not e.refs]:
            if over <= 0:
                break
            self._remove(e)
            self.stats.evicted += 1
            over -= e.nbytes

    def clear(self) -> None:
        """Drop every unreferenced entry and the shared prefixes."""
        with self._lock:
            for e in [e for e in self._lru.values() if not e.refs]:
                self._remove(e)
            self._bytes -= sum(e.nbytes for e in self._shared.values())
            self._shared.clear()
            self._flush()
