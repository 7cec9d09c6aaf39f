"""What the prefix cache tells a KV-events sink (``verifier_svc.kv_events``): which of its blocks
joined it and which left it, per cache operation, net of the operation's own churn.

A block is one key of the cache's index (``dflash.core.prefix_blocks.block_hashes``: the chain
hash of a tenant's first ``(i + 1) * block`` tokens); it is *in the cache* while at least one
entry holds it. An operation (a put, a release that evicts, a checkout, a clear) may drop a
block and add it back (a conversation's next turn covers its earlier one: the earlier entry goes,
the longer one holds the same blocks): :class:`BlockJournal` cancels such pairs, so the sink
hears only the blocks whose presence changed, and a new turn costs only its new blocks on the
wire. The journal runs under the cache's lock; the sink must not block (it queues).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Protocol

# One entry of a resync: (tenant, token ids, full blocks it holds), every indexed entry.
Snapshot = list[tuple[str, tuple[int, ...], int]]


@dataclasses.dataclass(frozen=True)
class BlockChange:
    """Blocks of one entry that joined (``stored``) or left the cache in one operation."""

    stored: bool
    tenant: str
    tokens: tuple[int, ...]        # the entry's ids (immutable; block i is tokens[i*B:(i+1)*B])
    depths: tuple[int, ...]        # the blocks' indexes, ascending


class BlockSink(Protocol):
    """Where the cache sends its block changes (called under the cache's lock: never blocks)."""

    def changed(self, changes: list[BlockChange]) -> None:
        """One operation's net changes (non-empty)."""

    def snapshot(self, entries: Snapshot) -> None:
        """The cache's whole state, replacing whatever the sink's consumers held."""

    def attached(self, resync: Callable[[], None]) -> None:
        """``resync()`` makes the cache send :meth:`snapshot` again (from any thread)."""


class BlockJournal:
    """The pending block changes of the operation running under the cache's lock."""

    def __init__(self) -> None:
        # index key -> (stored, tenant, tokens, depth); a key dropped then added (or the
        # reverse) within one operation is no change at all
        self._pending: dict[int, tuple[bool, str, tuple[int, ...], int]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def note(self, key: int, stored: bool, tenant: str, tokens: tuple[int, ...], depth: int) -> None:
        """Block ``key`` (block ``depth`` of ``tenant``'s ``tokens``) joined (``stored``) or left
        the index."""
        prev = self._pending.get(key)
        if prev is not None and prev[0] != stored:
            del self._pending[key]
        else:
            self._pending[key] = (stored, tenant, tokens, depth)

    def take(self) -> list[BlockChange]:
        """The pending changes grouped per entry (removals first), and a fresh journal."""
        groups: dict[tuple[bool, int], tuple[str, tuple[int, ...], list[int]]] = {}
        for stored, tenant, tokens, depth in self._pending.values():
            groups.setdefault((stored, id(tokens)), (tenant, tokens, []))[2].append(depth)
        self._pending = {}
        out = [BlockChange(stored, tenant, tokens, tuple(sorted(depths)))
               for (stored, _), (tenant, tokens, depths) in groups.items()]
        out.sort(key=lambda c: c.stored)
        return out


class CacheEvents:
    """The prefix cache's side of KV events (a base of ``verifier_svc.prefix_cache.PrefixCache``,
    kept apart so the cache reads as its bookkeeping): the cache notes each block its index gains
    or loses in ``_journal`` and calls :meth:`_flush` at the end of each operation."""

    _lock: threading.Lock
    _journal: BlockJournal | None
    _sink: BlockSink | None

    def _snapshot(self) -> Snapshot:
        raise NotImplementedError

    def attach_events(self, sink: BlockSink) -> None:
        """Tell ``sink`` (``--kv-events-endpoint``) of every operation that adds blocks to the
        index or drops them, under the lock and net of the operation's own churn, after a
        snapshot of what is held now."""
        with self._lock:
            self._journal, self._sink = BlockJournal(), sink
        sink.attached(self.resync_events)
        self.resync_events()

    def resync_events(self) -> None:
        """Send the sink (if any) the whole state: a consumer that joined late, or that missed
        changes the sink dropped, holds the cache's blocks again."""
        with self._lock:
            if self._sink is not None:
                self._sink.snapshot(self._snapshot())

    def indexed(self) -> Snapshot:
        """(tenant, token ids, full blocks) of every entry the index holds blocks of."""
        with self._lock:
            return self._snapshot()

    def _flush(self) -> None:
        """Hand the operation's net block changes to the sink (``_lock`` held)."""
        if self._journal and self._sink is not None:
            self._sink.changed(self._journal.take())
