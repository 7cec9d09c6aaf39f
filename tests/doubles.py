"""Test drafters that speak the real protocol: oracle (always right) and adversarial (always wrong).

Both know the target's greedy continuation of each session (computed by the test with
``generate()``), keyed by session id, and read the anchor's absolute position from the request
(``context_start + len(context)``), exactly as a real drafter would have to.
"""

from __future__ import annotations

import torch

from dflash.proposer import DraftError, DrafterCard, Proposal, ProposalRequest


class ReferenceDrafter:
    """Proposes ``reference[pos+1 : pos+B]`` (oracle) or those tokens + 1 (adversarial)."""

    def __init__(self, target, references: dict[str, list[int]], *, block_size: int,
                 adversarial: bool = False, layer_ids=(0,), name: str = "oracle"):
        self.refs = references
        self.adversarial = adversarial
        self.vocab = target.vocab_size
        self.card = DrafterCard(name=name, version="1", block_size=block_size, mask_token_id=0,
                                target_layer_ids=tuple(layer_ids), hidden_size=target.hidden_size,
                                vocab_size=target.vocab_size, dtype="float32")
        self.released: list[str] = []
        self.lengths: dict[str, int] = {}

    def propose(self, requests: list[ProposalRequest]):
        out = []
        for r in requests:
            have = self.lengths.get(r.session_id, 0)
            if r.context_start > have:
                out.append(DraftError("context_gap"))
                continue
            pos = r.context_start + r.context.shape[0]
            self.lengths[r.session_id] = pos
            ref = self.refs.get(r.session_id)
            if ref is None:
                out.append(DraftError("unknown_session"))
                continue
            k = max(r.block_size - 1, 0)
            toks = (ref[pos + 1:pos + 1 + k] + [0] * k)[:k]
            if self.adversarial:
                toks = [(t + 1) % self.vocab for t in toks]
            out.append(Proposal(tokens=torch.tensor(toks, dtype=torch.int64)))
        return out

    def release(self, session_ids):
        self.released += list(session_ids)
        for s in session_ids:
            self.lengths.pop(s, None)
