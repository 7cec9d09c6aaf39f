"""The prefix cache in the engine: a starting request takes the longest cached prefix of its
prompt (:func:`take_cached`), a finished one leaves its K/V and taps there (:func:`keep_finished`),
and a session's K/V waits there between its turns, pinned (:func:`checkout_pin`).

A hit is a copy: ``Target.fork`` copies the entry's first ``n`` positions into the request's own
sequence (loaded into a pool row at its first prefill chunk), and the entry's taps rows into the
session's ``TapRows``; the prompt's rest is prefilled as usual. The drafter keeps a finished
request's context too (:func:`keep_drafter_context`), and a hit tells it which one the session
starts from (``DrafterState.prefix``): only the rest of the taps is uploaded, and a drafter that
no longer holds it gets them all (``DrafterSync``). A session is one pin on the
same cache: at the end of a turn its K/V moves (no copy) into an entry it holds, readable by
its tenant's other requests while it is idle, and moves back at its next turn (no copy), as
``Target.own`` spilled it before. Why copies and not shared rows: ``docs/prefix-cache.md``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from dflash.core.kv_pool import KVPool
from dflash.core.proposer import PrefixKeeper
from verifier_svc.decode_state import DecodeState
from verifier_svc.prefix_cache import DrafterPrefix, Entry, PrefixCache, drafter_key
from verifier_svc.request import Request
from verifier_svc.sessions import Session
from verifier_svc.tap_buffer import TapRows
from verifier_svc.target_protocol import Target

log = logging.getLogger("dflash.verifier")


def kv_bytes_per_token(pool: KVPool) -> int:
    """K/V bytes one position takes in ``pool`` (every layer, K and V)."""
    itemsize = pool.dtype.itemsize
    return 2 * pool.num_layers * pool.kv_heads * pool.head_dim * itemsize


def new_prefix_cache(pool: KVPool, max_mb: float, shared: Iterable[Sequence[int]] = ()
                     ) -> PrefixCache:
    """A cache of at most ``max_mb`` MiB of unpinned entries for a target with ``pool``
    (``--prefix-cache-mb``), with the operator's ``shared`` prefixes. Raises ValueError naming
    ``max_bytes`` for a negative ``max_mb``."""
    return PrefixCache(int(max_mb * (1 << 20)), kv_bytes_per_token(pool), shared=shared)


def read_shared(path: str | Path, vocab_size: int) -> list[list[int]]:
    """The operator's shared prefixes from ``path`` (``--prefix-cache-shared``): a JSON list of
    token-id lists, each non-empty, ids in ``[0, vocab_size)``.

    Raises:
        ValueError: naming ``--prefix-cache-shared`` (unreadable, not JSON, malformed).
    """
    flag = "--prefix-cache-shared"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read {str(path)[:200]!r}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{flag}: a JSON list of token-id lists expected")
    for i, p in enumerate(data):
        if not isinstance(p, list) or not p:
            raise ValueError(f"{flag}: entry {i}: a non-empty list of token ids expected")
        bad = next((t for t in p if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{flag}: entry {i}: {bad!r} is not a token id in [0, {vocab_size})")
    return data


def checkout_pin(s: Session, cache: PrefixCache) -> None:
    """A session's next turn takes its K/V and taps back from its pinned entry (no copy)."""
    if s.pin is None:
        return
    seq, taps = cache.checkout(s.pin)
    s.pin = None
    s.cache = seq
    s.drafter.taps = taps if taps is not None else TapRows()


def take_cached(st: DecodeState, t: Target, cache: PrefixCache) -> None:
    """Copy the longest prefix of the request's prompt that ``cache`` holds for its tenant (and
    its drafter's taps), when it is longer than what the session holds already
    (``st.prefilled``); the last prompt token always runs (its logits are read). Sets
    ``st.hit`` (positions copied) and ``st.prefilled``."""
    s, req = st.session, st.req
    want = len(req.prompt) - 1
    if st.prefilled >= want:
        return
    entry, n = cache.lookup(req.tenant, req.prompt, s.drafter.tap_ids, want)
    if entry is None:
        return
    try:
        if n <= st.prefilled:
            return
        with t.lock:
            t.fork(entry.seq, s.cache, n)
        if s.drafter.tap_ids:
            assert entry.taps is not None           # lookup() matched the taps
            s.drafter.taps.truncate(st.prefilled)
            s.drafter.taps.append(entry.taps.rows(st.prefilled)[:n - st.prefilled])
        st.hit = n - st.prefilled
        st.prefilled = n
        dp = entry.drafter
        if dp is not None and dp.proposer is req.proposer and s.drafter.tap_ids:
            m = min(n, dp.length)
            if m > s.drafter.length:
                s.drafter.prefix = (dp.key, m)
    finally:
        cache.release(entry)


def keep_finished(s: Session, req: Request, t: Target, cache: PrefixCache, *, pin: bool
                  ) -> Entry | None:
    """After a finished turn (its K/V spilled by ``Target.own``; caller holds ``t.lock``): its
    cached positions join ``cache`` as the request's tenant's entry, and any declared shared
    prefix they start with is filled (a copy). ``pin``: the session keeps the entry for its next
    turn (its cache and taps are handed over and replaced by empty ones). Returns the entry
    kept for a one-shot request (None: pinned, or not kept), for
    :func:`keep_drafter_context` once the lock is released."""
    n = s.cached
    tokens = s.tokens[:n]
    tap_ids = s.drafter.tap_ids
    taps: TapRows | None = None
    if tap_ids:
        taps = s.drafter.taps
        taps.truncate(n)
    for length in cache.wants_shared(tokens, tap_ids):
        seq = t.new_cache()
        t.fork(s.cache, seq, length)
        copied = None
        if taps is not None:
            copied = TapRows()
            copied.append(taps.rows(0)[:length].clone())
        cache.put_shared(tokens[:length], seq, copied, tap_ids)
    entry = cache.put(req.tenant, tokens, s.cache, taps, tap_ids, pin=pin)
    if pin:
        s.pin = entry
        s.cache = t.new_cache()
        s.drafter.taps = TapRows()
        return None
    return entry


def keep_drafter_context(s: Session, req: Request, entry: Entry) -> None:
    """A one-shot request's cached entry: its drafter keeps the session's context (the
    positions it holds, a prefix of the entry's) under the entry's tenant-salted key instead of
    dropping it, and the entry remembers that (never raises: a drafter's failure is a later
    miss)."""
    d = s.drafter
    if not isinstance(d.proposer, PrefixKeeper) or not d.tap_ids or not 0 < d.length <= entry.length:
        return
    key = drafter_key(req.tenant, entry.tokens[:d.length], d.tap_ids)
    try:
        d.proposer.keep_prefix(s.id, key, d.length)
    except Exception:
        log.warning("drafter keep_prefix failed for session %s", s.id, exc_info=True)
        return
    entry.drafter = DrafterPrefix(d.proposer, key, d.length)
