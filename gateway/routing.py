"""Which verifier replica serves a request: load, prefix affinity, session stickiness.

The score follows llm-d's default endpoint picker (weights queue 2, KV use 1, prefix 3), from
the same figures its scorers read (the Model Server Protocol's waiting, running and KV use,
``verifier_svc.load``), plus the gateway's own count of streams it has open on each replica
(fresher than a polled report)::

    score = 2 * queue + 1 * kv + 3 * prefix
    queue  = 1 - q / max(q over candidates)   q = max(waiting + running, streams open here)
    kv     = 1 - kv_cache_usage
    prefix = leading blocks of the prompt routed to this replica before / its full blocks

``prefix`` is approximate, as llm-d's default prefix scorer is: :class:`PrefixHistory` remembers
which replicas the gateway sent each block of a prompt to, keyed by the prefix cache's own
block hashes (:func:`dflash.core.prefix_blocks.block_hashes`, tenant-salted 16-token blocks),
so a conversation's next turn goes where its prefix is cached. Ties go to fewer open streams,
then round-robin. A ``session_id`` sticks to its replica while that one is eligible.

``--routing round-robin`` (:func:`round_robin`) ignores all of it, sessions included: each
request goes to the next eligible replica in turn (the baseline the score is measured against,
``scripts/bench_replicas.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence

from dflash.core.prefix_blocks import BLOCK, block_hashes

WEIGHTS = {"queue": 2.0, "kv": 1.0, "prefix": 3.0}    # llm-d's defaults (queue 2, prefix 3)
ROUTINGS = ("score", "round-robin")                     # --routing


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One eligible replica as the router sees it (healthy, not draining)."""

    address: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0     # 0..1
    open_streams: int = 0           # this gateway's streams on it now


@dataclasses.dataclass(frozen=True)
class Choice:
    address: str
    score: float
    parts: dict[str, float]         # queue, kv, prefix (each 0..1, before the weights)
    why: str                        # "session", "score", "round-robin"


class PrefixHistory:
    """Which replicas each prompt block was routed to: block hash -> addresses, at most
    ``max_blocks`` blocks kept (the least recently routed dropped first), as llm-d's
    approximate prefix scorer keeps them. Thread-safe."""

    def __init__(self, max_blocks: int = 1 << 16, block: int = BLOCK):
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.max_blocks, self.block = max_blocks, block
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()
        self._lock = threading.Lock()

    def hashes(self, tenant: str, prompt: Sequence[int]) -> list[int]:
        """The prefix cache's keys of ``prompt`` under ``tenant``'s salt."""
        return block_hashes(tenant, prompt, self.block)

    def matched(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, how many leading blocks of ``hashes`` were routed to it (consecutive
        from the first: a prefix cache reuses a prefix, never a middle)."""
        out: dict[str, int] = {}
        with self._lock:
            holders = [self._blocks.get(h, set()) for h in hashes]
        alive: set[str] | None = None
        for i, held in enumerate(holders):
            alive = set(held) if alive is None else alive & held
            if not alive:
                break
            for a in alive:
                out[a] = i + 1
        return out

    def record(self, hashes: Sequence[int], address: str) -> None:
        with self._lock:
            for h in hashes:
                self._blocks.setdefault(h, set()).add(address)
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def forget(self, address: str) -> None:
        """A replica left the set or restarted (its cache is gone with it)."""
        with self._lock:
            for h in list(self._blocks):
                held = self._blocks[h]
                held.discard(address)
                if not held:
                    del self._blocks[h]

    def __len__(self) -> int:
        return len(self._blocks)


def score(cands: Sequence[Candidate], matched: dict[str, int], blocks: int
          ) -> list[tuple[float, dict[str, float]]]:
    """Each candidate's weighted score and its parts (module docstring), in order."""
    qs = [max(c.waiting + c.running, c.open_streams) for c in cands]
    qmax = max(qs, default=0)
    out = []
    for c, q in zip(cands, qs, strict=True):
        parts = {"queue": 1.0 - q / qmax if qmax else 1.0,
                 "kv": 1.0 - min(1.0, max(0.0, c.kv_cache_usage)),
                 "prefix": matched.get(c.address, 0) / blocks if blocks else 0.0}
        out.append((sum(WEIGHTS[k] * v for k, v in parts.items()), parts))
    return out


def choose(cands: Sequence[Candidate], matched: dict[str, int], blocks: int, *, turn: int = 0,
           sticky: str | None = None) -> Choice:
    """The replica for a request among ``cands`` (non-empty): ``sticky`` (its session's
    replica) when it is a candidate, else the best score; ties to fewer open streams, then
    round-robin by ``turn``. Raises ValueError when ``cands`` is empty."""
    if not cands:
        raise ValueError("cands: no eligible replica")
    scored = score(cands, matched, blocks)
    for c, (s, parts) in zip(cands, scored, strict=True):
        if c.address == sticky:
            return Choice(c.address, s, parts, "session")
    n = len(cands)
    best = max(range(n), key=lambda i: (round(scored[i][0], 9), -cands[i].open_streams,
                                        -((i - turn) % n)))
    return Choice(cands[best].address, scored[best][0], scored[best][1], "score")


def round_robin(cands: Sequence[Candidate], turn: int) -> Choice:
    """Candidate ``turn`` mod their number, whatever their load, prefix or session. Raises
    ValueError when ``cands`` is empty."""
    if not cands:
        raise ValueError("cands: no eligible replica")
    return Choice(cands[turn % len(cands)].address, 0.0, {}, "round-robin")


__all__ = ["Candidate", "Choice", "PrefixHistory", "ROUTINGS", "WEIGHTS", "choose", "round_robin",
           "score"]
