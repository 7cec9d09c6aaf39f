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


def test_session_context_appends_in_place():
    """A session's context K/V grows in its buffers (no copy per step), a crop only shortens
    the views, and outgrowing the room copies once: the views always equal the concatenation
    of what was appended after the last crop."""
    from drafter_svc.engine import _SessionCtx

    torch.manual_seed(0)
    sess = _SessionCtx(kv=[], length=0)
    ref = [[torch.empty(1, 2, 0, 4), torch.empty(1, 2, 0, 4)] for _ in range(2)]

    def add(n):
        rows = [(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for _ in range(2)]
        sess.append(rows)
        for r, (k, v) in zip(ref, rows):
            r[0], r[1] = torch.cat([r[0], k], 2), torch.cat([r[1], v], 2)

    def check():
        assert sess.length == ref[0][0].shape[2]
        for (k, v), (rk, rv) in zip(sess.kv, ref):
            assert torch.equal(k, rk) and torch.equal(v, rv)

    add(5)
    buffers = [kb.data_ptr() for kb, _ in sess.buffers]
    for n in (1, 3, 2):
        add(n)
        check()
    assert [kb.data_ptr() for kb, _ in sess.buffers] == buffers      # appended in place
    sess.kv = [(k[:, :, :7], v[:, :, :7]) for k, v in sess.kv]          # the engine's crop
    sess.length = 7
    for r in ref:
        r[0], r[1] = r[0][:, :, :7], r[1][:, :, :7]
    add(4)
    check()
    assert [kb.data_ptr() for kb, _ in sess.buffers] == buffers
    add(_SessionCtx.ROOM)                                              # past the room: one copy
    check()
    assert [kb.data_ptr() for kb, _ in sess.buffers] != buffers
    assert sess.buffers[0][0].shape[2] == sess.length + _SessionCtx.ROOM
