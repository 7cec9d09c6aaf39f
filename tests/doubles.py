"""Test drafters that speak the real protocol: oracle (always right) and adversarial (always wrong).

Both know the target's greedy continuation of each session (computed by the test with
``generate()``), keyed by session id, and read the anchor's absolute position from the request
(``context_start + len(context)``), exactly as a real drafter would have to.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from dflash.core.proposer import DrafterCard, DraftError, Proposal, ProposalRequest, check_top_k
from dflash.core.stats import AcceptanceCounter
from gateway.inputs import OWNER_PREFIX_CHARS


class ReferenceDrafter:
    """Proposes ``reference[pos+1 : pos+B]`` (oracle) or those tokens + 1 (adversarial).

    Its distribution at each draft position is a ranking: with ``top_k`` > 0 a proposal carries
    ``top_ids`` [B-1, min(top_k, V - 1)] and ``top_logprobs`` log(1/2), log(1/4), ... (a valid
    log-distribution prefix, strictly descending). The reference token sits at rank
    ``ranks(session_id, position)`` (0 by default); the other ranks hold ``t + 1, t + 2, ...``
    (mod V) for reference token ``t``, so rank 0 is ``t + 1`` wherever the reference is not.
    The chain ``tokens`` are rank 0: the reference where its rank is 0, else the wrong ``t + 1``.
    A rank >= top_k leaves the reference out of the top ids. ``adversarial``: the reference is
    never ranked (tokens ``t + 1``, top ids never ``t``).

    Args:
        ranks: the reference token's rank (0-based) at an absolute position (the position of
            the drafted token, i.e. its index in the reference list): a mapping position ->
            rank (for every session; missing = 0) or a callable ``(session_id, position) ->
            rank``. None = rank 0 everywhere.
    """

    def __init__(self, target, references: dict[str, list[int]], *, block_size: int,
                 adversarial: bool = False, layer_ids=(0,), name: str = "oracle",
                 ranks: Mapping[int, int] | Callable[[str, int], int] | None = None):
        self.refs = references
        self.adversarial = adversarial
        self.vocab = target.vocab_size
        if ranks is None:
            self._rank = lambda sid, pos: 0
        elif callable(ranks):
            self._rank = ranks
        else:
            self._rank = lambda sid, pos: ranks.get(pos, 0)
        self.card = DrafterCard(name=name, version="1", block_size=block_size, mask_token_id=0,
                                target_layer_ids=tuple(layer_ids), hidden_size=target.hidden_size,
                                vocab_size=target.vocab_size, dtype="float32")
        self.released: list[str] = []
        self.lengths: dict[str, int] = {}

    def propose(self, requests: list[ProposalRequest]):
        out = []
        for r in requests:
            try:
                check_top_k(r.top_k)
            except DraftError as e:
                out.append(e)
                continue
            have = self.lengths.get(r.session_id, 0)
            if r.context_start > have:
                out.append(DraftError("context_gap"))
                continue
            pos = r.context_start + r.context.shape[0]
            self.lengths[r.session_id] = pos
            sid = client_session_id(r.session_id)
            ref = self.refs.get(sid)
            if ref is None:
                out.append(DraftError("no_context"))
                continue
            k = max(r.block_size - 1, 0)
            toks = (ref[pos + 1:pos + 1 + k] + [0] * k)[:k]
            cols = min(r.top_k, self.vocab - 1)   # V - 1: a ranking may leave the reference out
            rows = [self._ranking(t, self._rank(sid, pos + 1 + j), max(cols, 1))
                    for j, t in enumerate(toks)]
            p = Proposal(tokens=torch.tensor([row[0] for row in rows], dtype=torch.int64))
            if cols and k:
                p.top_ids = torch.tensor([row[:cols] for row in rows], dtype=torch.int64)
                p.top_logprobs = torch.tensor([[-(c + 1) * math.log(2) for c in range(cols)]] * k,
                                              dtype=torch.float32)
            out.append(p)
        return out

    def _ranking(self, t: int, rank: int, n: int) -> list[int]:
        """The first ``n`` ranked tokens at a position whose reference token is ``t``."""
        others = [(t + 1 + m) % self.vocab for m in range(n)]
        if self.adversarial or rank >= n:
            return others
        return others[:rank] + [t] + others[rank:n - 1]

    def release(self, session_ids):
        self.released += list(session_ids)
        for s in session_ids:
            self.lengths.pop(s, None)


def client_session_id(session_id: str) -> str:
    """The client's session_id from the verifier's (a gateway prefixes 16 hex digits of the
    owner and ``:``; ``gateway.inputs.verifier_session_id``), so a reference keyed by the client's
    id is found behind a gateway too; a verifier's own id is returned as it is."""
    n = OWNER_PREFIX_CHARS
    return session_id[n:] if re.fullmatch(rf"[0-9a-f]{{{n - 1}}}:.+", session_id) else session_id


def chains(choose):
    """A policy ``choose_shapes`` stand-in from a ``choose``-style function (jobs, waiting) ->
    drafts per job: chains of those lengths, no trees."""
    from dflash.core.speculation import SpecMode
    from verifier_svc.policy import Decision, Shape, StepChoice

    return lambda jobs, waiting=0, offers=None: StepChoice(
        [Shape(k) for k in choose(jobs, waiting)], Decision(mode=SpecMode.FIXED, k=-1, batch=len(jobs)))


@dataclasses.dataclass(eq=False)
class TableCache:
    """A table target's cache: the tokens it holds (``CacheHandle``)."""

    tokens: list[int] = dataclasses.field(default_factory=list)

    def get_seq_length(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(eq=False, kw_only=True)
class TargetDouble:
    """The engine's ``Target`` protocol (``verifier_svc.target_protocol.Target``) for targets whose
    logits come from a table: one CPU process that never fails, a cache that is its token
    list, no shared prefill. Subclasses give ``forward``."""

    vocab_size: int = 0
    hidden_size: int = 8
    num_layers: int = 2
    max_positions: int = 1 << 20
    eos_token_ids: frozenset[int] = frozenset()
    fingerprint: str = ""
    rope_theta: float = 0.0
    failure: str | None = None
    path: Path = Path("table-target")
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    supports_trees: bool = True
    supports_fork: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def new_cache(self) -> TableCache:
        return TableCache()

    def forward(self, tokens: list[int], cache: TableCache, layer_ids: tuple[int, ...] | None,
                logits_to_keep: int = 0, parents: list[list[int] | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def forward_batch(self, blocks: list[list[int]], caches: list[TableCache],
                      layer_ids: list[tuple[int, ...]], parents: list[list[int] | None] | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        rows = parents or [None] * len(blocks)
        return [self.forward(b, c, ids, parents=[pa])
                for b, c, ids, pa in zip(blocks, caches, layer_ids, rows, strict=True)]

    def keep(self, cache: TableCache, start: int, offsets: list[int]) -> None:
        cache.tokens[start:] = [cache.tokens[start + o] for o in offsets]

    def crop(self, cache: TableCache, length: int) -> None:
        del cache.tokens[length:]

    def own(self, cache: TableCache) -> None:
        pass

    def fork(self, src: TableCache, dst: TableCache, length: int) -> None:
        raise NotImplementedError("a table target does not fork (supports_fork is False)")



@dataclasses.dataclass(frozen=True)
class CardDouble:
    label: str                          # a drafter's ``name@version``


@dataclasses.dataclass(frozen=True)
class ProposerDouble:
    card: CardDouble


@dataclasses.dataclass(frozen=True)
class RequestDouble:
    max_tokens: int = 1000
    proposer: ProposerDouble | None = None


@dataclasses.dataclass
class PolicyJobDouble:
    """What the policy reads of a job (``verifier_svc.policy.PolicyJob``)."""

    req: RequestDouble
    mode: str = "adaptive"
    block_limit: int = 16
    emitted: int = 1
    tree_budget: int = 0
    suffix_limit: int = 0
    stats: AcceptanceCounter | None = None


def policy_job(label: str = "d@1", *, mode: str = "adaptive", block: int = 16,
               max_tokens: int = 1000, emitted: int = 1, tree_budget: int = 0,
               stats: AcceptanceCounter | None = None, proposer: bool = True) -> PolicyJobDouble:
    """A job of drafter ``label`` (no drafter: ``proposer=False``) as the policy sees it."""
    drafter = ProposerDouble(CardDouble(label)) if proposer else None
    return PolicyJobDouble(RequestDouble(max_tokens, drafter), mode=mode, block_limit=block,
                           emitted=emitted, tree_budget=tree_budget, stats=stats)
