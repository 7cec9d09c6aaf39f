"""The drafter engine's gauges (read at scrape, no lock: counts only): its sessions' context
positions and its prefix store (``drafter_svc.prefixes``). A base of
:class:`drafter_svc.engine.DrafterEngine`."""

from __future__ import annotations

from drafter_svc.prefixes import PrefixStore


class DrafterGauges:
    """Figures over the engine's sessions and prefix store (fields the engine sets)."""

    _sessions: dict
    prefixes: PrefixStore

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Context positions held for all sessions (a metrics gauge)."""
        return sum(s.length for s in list(self._sessions.values()))

    @property
    def prefix_entries(self) -> int:
        return self.prefixes.entries

    @property
    def prefix_tokens(self) -> int:
        return self.prefixes.tokens

    @property
    def prefix_bytes(self) -> int:
        return self.prefixes.nbytes

    @property
    def prefix_hits(self) -> int:
        return self.prefixes.stats.hits

    @property
    def prefix_hit_tokens(self) -> int:
        return self.prefixes.stats.hit_tokens

    @property
    def prefix_misses(self) -> int:
        return self.prefixes.stats.misses

    @property
    def prefix_evictions(self) -> int:
        return self.prefixes.stats.evicted
