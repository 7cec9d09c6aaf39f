"""The verifier engine's gauges (read by ``verifier_svc.observe`` each scrape): the sessions'
suffix indexes, their KV, the prefix cache, the drafters' kept contexts and the grammars' time. A base of
:class:`verifier_svc.engine.VerifierEngine`, kept apart so the engine reads as its step."""

from __future__ import annotations

from verifier_svc.drafter_sync import DrafterSync
from verifier_svc.grammar_rows import GrammarTime
from verifier_svc.prefix_cache import PrefixCache
from verifier_svc.sessions import SessionStore
from verifier_svc.suffix_drafts import AnswerStore


class EngineGauges:
    """Read-only figures over the engine's sessions, answers, prefix cache and drafter sync
    (the fields below, which the engine sets)."""

    _sessions: SessionStore
    answers: AnswerStore
    prefix_cache: PrefixCache | None
    sync: DrafterSync
    grammar_time: GrammarTime

    @property
    def suffix_index_tokens(self) -> int:
        """Tokens held by the sessions' suffix indexes (a metrics gauge)."""
        return sum(len(s.suffix) for s in self._sessions.values())

    @property
    def suffix_answer_tokens(self) -> int:
        return self.answers.tokens

    @property
    def suffix_corpus_tokens(self) -> int:
        return self.answers.corpus_tokens

    @property
    def suffix_index_bytes(self) -> int:
        """Approximate bytes of the sessions' suffix indexes, the tenants' answers and the
        corpus."""
        return sum(s.suffix.nbytes for s in self._sessions.values()) + self.answers.nbytes

    @property
    def cached_tokens(self) -> int:
        """Target KV positions held by all sessions (a metrics gauge)."""
        return sum(s.held for s in self._sessions.values())

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of the prefix cache's entries (gauges read 0 with the cache off)."""
        return self.prefix_cache.nbytes if self.prefix_cache is not None else 0

    @property
    def prefix_cache_pinned_bytes(self) -> int:
        return self.prefix_cache.pinned_bytes if self.prefix_cache is not None else 0

    @property
    def prefix_cache_entries(self) -> int:
        return self.prefix_cache.entries if self.prefix_cache is not None else 0

    @property
    def prefix_cache_tokens(self) -> int:
        return self.prefix_cache.tokens if self.prefix_cache is not None else 0

    @property
    def prefix_cache_evictions(self) -> int:
        return self.prefix_cache.stats.evicted if self.prefix_cache is not None else 0

    # sessions started from a drafter's kept context (``DrafterSync.prefixes``)
    @property
    def drafter_prefix_hits(self) -> int:
        return self.sync.prefixes.hits

    @property
    def drafter_prefix_hit_tokens(self) -> int:
        return self.sync.prefixes.hit_tokens

    @property
    def drafter_prefix_misses(self) -> int:
        return self.sync.prefixes.misses

    # decode steps' time on grammars (``verifier_svc.grammar_rows.GrammarTime``)
    @property
    def grammar_seconds(self) -> float:
        return self.grammar_time.seconds

    @property
    def grammar_rows(self) -> int:
        return self.grammar_time.rows
