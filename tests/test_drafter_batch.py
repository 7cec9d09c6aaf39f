"""The drafter drafts every session of a step in one forward, exactly as it drafts them alone."""

from __future__ import annotations

import pytest
import torch

from dflash.proposer import DraftError, ProposalRequest
from dflash.sampling import Sampling
from drafter_svc.engine import DrafterEngine

# (context rows on the first step, block size): mixed lengths, a context-only item, block 2..8
ITEMS = [(5, 8), (30, 4), (1, 1), (12, 8), (7, 2), (19, 8)]


def steps(cfg, n_steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    have = [0] * len(ITEMS)
    for step in range(n_steps):
        reqs = []
        for i, (n0, bs) in enumerate(ITEMS):
            rows = n0 if step == 0 else 2 + i % 3
            sampling = Sampling(temperature=0.8, seed=3) if i == 3 else \
                Sampling(temperature=1.0, top_p=0.9, seed=11) if i == 5 else Sampling()
            reqs.append(ProposalRequest(session_id=f"s{i}", context_start=have[i],
                                        context=torch.randn(rows, cfg.context_size, generator=g),
                                        anchor_token=(7 * i + step) % 256, block_size=bs,
                                        sampling=sampling))
            have[i] += rows
        yield reqs


def test_batched_propose_equals_one_by_one(make_drafter, tiny_target):
    d = make_drafter(block_size=8)
    alone = DrafterEngine.from_pretrained(d, tiny_target)
    batched = DrafterEngine.from_pretrained(d, tiny_target)
    calls, heads = [], []
    real = batched.drafter.forward
    batched.drafter.forward = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    real_head = batched.head.logits
    batched.head.logits = lambda h, *a: heads.append(h.shape[0]) or real_head(h, *a)
    for reqs in steps(alone.cfg):
        want = [alone.propose([r])[0] for r in reqs]
        got = batched.propose(reqs)
        for r, w, g in zip(reqs, want, got):
            assert g.tokens.tolist() == w.tokens.tolist(), r.session_id
            if w.probs is None:
                assert g.probs is None
            else:
                torch.testing.assert_close(g.probs, w.probs, atol=1e-6, rtol=1e-5)
    drafting = sum(bs > 1 for _, bs in ITEMS)
    assert calls == [drafting] * 3, "one drafter forward per step, all blocks in it"
    rows = sum(bs - 1 for _, bs in ITEMS)
    assert heads == [rows] * 3, "one LM-head product per step over every block's draft rows"
    assert batched.cached_tokens == alone.cached_tokens


def test_a_bad_item_fails_alone(make_drafter, tiny_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    reqs = next(steps(engine.cfg))
    bad = ProposalRequest(session_id="gap", context_start=5, context=torch.zeros(1, engine.cfg.context_size),
                          anchor_token=1, block_size=8, sampling=Sampling())
    out = engine.propose([reqs[0], bad, reqs[1]])
    assert isinstance(out[1], DraftError) and out[1].reason == "context_gap"
    assert out[0].tokens.numel() == 7 and out[2].tokens.numel() == 3
