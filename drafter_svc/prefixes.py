"""The drafter's context cache: finished sessions' context K/V kept as prefixes, by key.

The verifier's prefix cache keeps a finished request's target K/V and taps under its tenant
and token ids (``verifier_svc.prefix_cache``); when it keeps one, it asks the drafter to keep
that session's context too, under a key it chose (``verifier_svc.prefix_cache.drafter_key``: a
digest of the tenant and the positions' token ids; the drafter never sees prompt ids, so it
cannot check them and trusts the key). A later session whose prompt starts from that cached
prefix names the key and the length it starts from (``ProposalRequest.prefix_key``,
``context_start``): its context is a copy of the prefix's first positions and only the rest is
uploaded. A key the store does not hold is a miss, and the verifier uploads everything.

Entries are spilled ``PoolSeq``s (tensors of their own length, out of the batch pool), moved in
from the session at keep (no copy) and copied out at each use (``KVPool.fork``): an entry is
never written after it is kept. Bounded by bytes, least recently used evicted first. Not
thread-safe: the engine's lock guards it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from dflash.core.kv_pool import KVPool, PoolSeq


@dataclasses.dataclass
class PrefixStats:
    """Counts since start."""

    kept: int = 0                # prefixes kept
    refused: int = 0             # keeps refused: the session held another length, or too big
    evicted: int = 0             # prefixes dropped for room
    hits: int = 0                # sessions started from a prefix
    hit_tokens: int = 0          # context positions those sessions did not upload
    misses: int = 0              # items naming a key not held (or too short)


class PrefixStore:
    """Kept prefixes by key, at most ``max_bytes`` of K/V (0: none kept).

    Args:
        pool: the engine's context pool (entries are its spilled sequences).
        max_bytes: bound on the entries' K/V bytes, >= 0.
        bytes_per_token: K/V bytes one context position takes (every layer, K and V), >= 1.

    Raises:
        ValueError: naming ``max_bytes`` or ``bytes_per_token`` when out of range.
    """

    def __init__(self, pool: KVPool, max_bytes: int, bytes_per_token: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        if bytes_per_token < 1:
            raise ValueError(f"bytes_per_token: must be >= 1, got {bytes_per_token}")
        self.pool, self.max_bytes, self.bytes_per_token = pool, max_bytes, bytes_per_token
        self.stats = PrefixStats()
        self._entries: OrderedDict[bytes, PoolSeq] = OrderedDict()   # oldest first
        self._tokens = 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Context positions held by every entry."""
        return self._tokens

    @property
    def nbytes(self) -> int:
        return self._tokens * self.bytes_per_token

    def keep(self, key: bytes, seq: PoolSeq, length: int) -> bool:
        """Keep ``seq`` (handed over: its owner drops it) as ``key`` when it holds exactly
        ``length`` > 0 positions and fits the bound; a key held already is replaced. Returns
        whether it was kept."""
        if not key or length < 1 or seq.get_seq_length() != length or \
                length * self.bytes_per_token > self.max_bytes:
            self.stats.refused += 1
            return False
        self.pool.spill(seq)                       # out of the batch rows, its own length
        self._drop(key)
        self._entries[key] = seq
        self._tokens += length
        self.stats.kept += 1
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1
        return True

    def start(self, key: bytes, dst: PoolSeq, length: int) -> bool:
        """Make ``dst`` a copy of the first ``length`` positions of prefix ``key``; False (a
        miss, ``dst`` untouched) when it is not held or holds fewer positions."""
        src = self._entries.get(key)
        if src is None or src.get_seq_length() < length:
            self.stats.misses += 1
            return False
        self._entries.move_to_end(key)
        self.pool.fork(src, dst, length)
        self.stats.hits += 1
        self.stats.hit_tokens += length
        return True

    def _drop(self, key: bytes) -> None:
        seq = self._entries.pop(key, None)
        if seq is not None:
            self._tokens -= seq.get_seq_length()

    def clear(self) -> None:
        """Drop every entry (the drafter's weights changed: its context K/V with them)."""
        self._entries.clear()
        self._tokens = 0
