"""Sessions: a conversation's cached positions kept between steps and turns (LRU + TTL)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dflash.core.suffix import SuffixIndex
from verifier_svc.drafter_sync import DrafterState
from verifier_svc.suffix_drafts import SessionRates

if TYPE_CHECKING:   # the prefix cache's entries hold a session's cache handle
    from verifier_svc.prefix_cache import Entry


class CacheHandle(Protocol):
    """A session's target cache (``dflash.core.kv_pool.PoolSeq``, ``verifier_svc.ep.RankCache``)."""

    def get_seq_length(self) -> int: ...


@dataclasses.dataclass
class Session:
    """State kept between steps and turns, keyed by session id."""

    id: str
    cache: CacheHandle                 # ``Target.new_cache()``
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + emitted
    drafter: DrafterState = dataclasses.field(default_factory=DrafterState)
    # the suffix index of ``tokens`` and the session's own suffix outcomes (suffix drafts)
    suffix: SuffixIndex = dataclasses.field(default_factory=SuffixIndex)
    suffix_rates: SessionRates = dataclasses.field(default_factory=SessionRates)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # set once a prompt is fully in the cache (then tokens, cache and taps agree), cleared when
    # a turn starts changing them: only such a session lends its prompt to its group's others
    prefix_group: str = ""
    # between turns with the prefix cache on: the entry holding its K/V and taps (pinned), and
    # ``cache`` is empty until its next turn takes them back (verifier_svc.prefix_reuse)
    pin: Entry | None = None

    @property
    def cached(self) -> int:
        """Target positions in ``cache`` (0 between turns while ``pin`` holds them)."""
        return self.cache.get_seq_length()

    @property
    def held(self) -> int:
        """Target positions it holds, in ``cache`` or its pinned entry."""
        return self.pin.length if self.pin is not None else self.cached


class SessionStore:
    """Sessions by id, at most ``max_sessions`` (least recently used idle ones dropped first),
    idle ones dropped after ``ttl_s`` (:meth:`expire`). ``on_drop(session)`` runs for every
    session dropped, outside the store's lock."""

    def __init__(self, new_cache: Callable[[], CacheHandle], on_drop: Callable[[Session], None], *,
                 max_sessions: int = 256, ttl_s: float = 600.0):
        self.new_cache, self.on_drop = new_cache, on_drop
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: str) -> bool:
        return sid in self._sessions

    def values(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def get(self, sid: str) -> Session:
        """The session ``sid``, created empty when new (evicting beyond ``max_sessions``)."""
        dropped = []
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                s = self._sessions[sid] = Session(id=sid, cache=self.new_cache())
                while len(self._sessions) > self.max_sessions:
                    idle = [x for x in self._sessions.values() if not x.busy.locked()]
                    if not idle:
                        break
                    victim = min(idle, key=lambda x: x.last_used)
                    dropped.append(self._sessions.pop(victim.id))
            s.last_used = time.monotonic()
        for d in dropped:
            self.on_drop(d)
        return s

    def close(self, sid: str) -> bool:
        """Drop a session. Returns whether it existed."""
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            return False
        self.on_drop(s)
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_used > self.ttl_s and not s.busy.locked()]
        return sum(self.close(sid) for sid in old)
