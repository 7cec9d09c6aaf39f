"""Test drafters that speak the real protocol: oracle (always right) and adversarial (always wrong).

Both know the target's greedy continuation of each session (computed by the test with
``generate()``), keyed by session id, and read the anchor's absolute position from the request
(``context_start + len(context)``), exactly as a real drafter would have to.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

import torch

from dflash.core.proposer import DrafterCard, DraftError, Proposal, ProposalRequest, check_top_k
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
    from verifier_svc.policy import Shape

    return lambda jobs, waiting=0, offers=None: [Shape(k) for k in choose(jobs, waiting)]
