"""A fake target whose next-token logits are a known table, and a drafter that samples from a
known q: doubles for statistical tests of the verifier (not a test module).

The target's logits after position i are ``table[i % 2, token_i]``, with i read from the
cache length (so a wrong crop after a rejection shifts every later position's parity) and, for a
tree block, from each node's depth. The drafter draws draft j from ``q[parity of its
predecessor's position, predecessor]``, returns those rows of q as its probabilities, and, when
asked for top-k, the support of each row (ids by descending q, log q), from which the verifier
builds trees.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from dflash.core.proposer import DrafterCard, Proposal
from dflash.core.sampling import coupled_choice, position_noise

from doubles import TargetDouble

HIDDEN = 8


@dataclasses.dataclass(eq=False)
class TableTarget(TargetDouble):
    """Stands in for ``TargetModel`` (the engine's ``Target`` protocol).

    Args:
        table: float ``[2, V, V]`` next-token logits by (position parity, token).
    """

    table: torch.Tensor

    def __post_init__(self):
        self.table = self.table.float()
        self.vocab_size = self.table.shape[-1]
        self.hidden_size = HIDDEN

    def forward(self, tokens, cache, layer_ids, logits_to_keep=0, parents=None):
        start = len(cache.tokens)
        cache.tokens.extend(tokens)
        depth = list(range(len(tokens)))
        tree = parents[0] if parents else None
        if tree is not None:
            for j in range(1, len(tokens)):
                depth[j] = depth[tree[j]] + 1
        parity = (start + torch.tensor(depth)) % 2
        logits = self.table[parity, torch.tensor(tokens)]
        taps = torch.zeros(len(tokens), len(layer_ids) * HIDDEN) if layer_ids else None
        return logits[-logits_to_keep:], taps


class TableDrafter:
    """A Proposer over the target's states, drafting from ``q`` ``[2, V, V]`` (rows sum to 1).

    Like a real drafter it learns the anchor's position from the context it is sent
    (``context_start + len(context)``), so it asks for one tapped layer. A seeded request's draft
    at sequence index t races q against ``position_noise(seed, t)`` (coupled sampling, as the
    DFlash drafter); unseeded ones sample q from a stream per session."""

    def __init__(self, q: torch.Tensor, block_size: int):
        self.q = q.float()
        v = q.shape[-1]
        self.card = DrafterCard(name="table-q", version="1", block_size=block_size,
                                mask_token_id=0, target_layer_ids=(0,), hidden_size=HIDDEN,
                                vocab_size=v, dtype="float32")
        self._cum = self.q.double().cumsum(-1).tolist()
        self._rngs: dict[str, random.Random] = {}

    def propose(self, requests):
        out = []
        for r in requests:
            rng = self._rngs.setdefault(r.session_id,
                                        random.Random(f"{r.session_id}/{r.sampling.seed}"))
            anchor_pos = r.context_start + r.context.shape[0]
            prev, toks = r.anchor_token, []
            for j in range(r.block_size - 1):
                if r.sampling.seed is not None:   # as the DFlash drafter: coupled with the target
                    e = position_noise(r.sampling.seed, [anchor_pos + 1 + j], self.q.shape[-1])
                    prev = int(coupled_choice(self.q[(anchor_pos + j) % 2, prev], e[0]))
                else:
                    cum = self._cum[(anchor_pos + j) % 2][prev]
                    u = rng.random() * cum[-1]
                    prev = next(t for t in range(len(cum)) if u < cum[t])
                toks.append(prev)
            k = len(toks)
            q = self.q[(anchor_pos + torch.arange(k)) % 2,
                       torch.tensor([r.anchor_token] + toks[:-1])].reshape(k, -1)
            p = Proposal(tokens=torch.tensor(toks, dtype=torch.int64), probs=q)
            if r.top_k and k:
                cols = min(r.top_k, int((q > 0).sum(-1).min()))
                vals, ids = q.sort(dim=-1, descending=True, stable=True)
                p.top_ids = ids[:, :cols].contiguous()
                p.top_logprobs = vals[:, :cols].log().float().contiguous()
            out.append(p)
        return out

    def release(self, session_ids):
        for s in session_ids:
            self._rngs.pop(s, None)
