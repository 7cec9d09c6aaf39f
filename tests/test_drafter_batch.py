"""The drafter drafts every session of a step in one forward, exactly as it drafts them alone."""

from __future__ import annotations

import torch

from dflash.core.proposer import DraftError, ProposalRequest
from dflash.core.sampling import Sampling
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


def test_session_context_appends_in_place(make_drafter, tiny_target):
    """A session's context K/V is written into its pool row at its length (no copy per step), a
    crop only sets the length, and outgrowing the capacity copies once: the row always equals
    the K/V of the context sent since the last crop."""
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target, context_threads=0)
    cfg, pool = engine.cfg, engine.pool
    g = torch.Generator().manual_seed(0)
    feats = torch.empty(0, cfg.context_size)

    def add(n, start=None):
        nonlocal feats
        start = feats.shape[0] if start is None else start
        rows = torch.randn(n, cfg.context_size, generator=g)
        feats = torch.cat([feats[:start], rows])
        engine.propose([ProposalRequest(session_id="s", context_start=start, context=rows,
                                        anchor_token=1, block_size=1, sampling=Sampling())])

    def check():
        sess = engine._sessions["s"]
        assert sess.length == feats.shape[0] == engine.cached_tokens
        with torch.inference_mode():
            want = engine.drafter.context_kv(feats[None], torch.arange(feats.shape[0])[None])
        for (k, v), (wk, wv) in zip(pool.views(sess.seq.row, 1, sess.length), want):
            torch.testing.assert_close(k, wk)
            torch.testing.assert_close(v, wv)

    add(5)
    buffers, grown = [k.data_ptr() for k in pool.k], pool.grown
    for n in (1, 3, 2):
        add(n)
        check()
    assert [k.data_ptr() for k in pool.k] == buffers and pool.grown == grown   # in place
    add(4, start=7)                                                # a crop, then new rows
    check()
    assert [k.data_ptr() for k in pool.k] == buffers
    add(pool.capacity - feats.shape[0] + 1)                        # past the capacity: one copy
    check()
    assert pool.grown == grown + 1


def test_pool_rows_bounded_over_session_churn(make_drafter, tiny_target):
    """Sessions joining and leaving reuse pool rows: over 200 cycles the pool never has more
    rows than sessions were live at once, and its buffers stop growing once that peak is met."""
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target, context_threads=0)
    cfg, pool = engine.cfg, engine.pool
    g = torch.Generator().manual_seed(0)
    live: dict[str, int] = {}                      # session -> cached positions
    peak, grown_at = 0, {}
    for cycle in range(200):
        live[f"c{cycle}"] = 0
        peak = max(peak, len(live))
        reqs = []
        for sid, have in live.items():
            n = int(torch.randint(1, 20, (1,), generator=g))
            reqs.append(ProposalRequest(session_id=sid, context_start=have,
                                        context=torch.randn(n, cfg.context_size, generator=g),
                                        anchor_token=cycle % 256, block_size=1 + cycle % 8,
                                        sampling=Sampling()))
            live[sid] = have + n
        out = engine.propose(reqs)
        assert all(not isinstance(o, DraftError) for o in out)
        assert pool.rows <= peak
        while len(live) > 1 + cycle % 5:           # 1..5 stay on, so the pool is never empty
            engine.release([next(iter(live))])
            live.pop(next(iter(live)))
        assert pool.resident == len(live) == engine.num_sessions
        grown_at[cycle] = pool.grown
    assert peak == 6
    # rows grow by half (1, 2, 3, 4, 6) and capacity once: then never again
    assert grown_at[199] == grown_at[10] <= 6, "no growth per cycle"
    engine.release(list(live))
    assert pool.resident == 0 and engine.cached_tokens == 0
    assert pool.nbytes <= pool.keep_idle_bytes          # small idle buffers are kept for reuse


def test_idle_sessions_spill_out_of_the_pool_and_draft_the_same_when_back(make_drafter, tiny_target):
    """A session not drafted for SPILL_AFTER_S leaves the pool (its row freed, its context kept
    in tensors of its own length); its next call moves it back and drafts exactly as a session
    that never left."""
    d = make_drafter(block_size=8)
    spilling = DrafterEngine.from_pretrained(d, tiny_target)
    staying = DrafterEngine.from_pretrained(d, tiny_target)
    spilling.SPILL_AFTER_S = 0.0
    checked = 0
    for reqs in steps(spilling.cfg):
        for r in reqs:                       # one session per call: the others are idle
            spilling._spill_checked = 0.0     # check every call
            got, want = spilling.propose([r])[0], staying.propose([r])[0]
            assert got.tokens.tolist() == want.tokens.tolist(), r.session_id
            others = [s for sid, s in spilling._sessions.items() if sid != r.session_id]
            assert not any(s.seq.resident for s in others)
            checked += len(others)
    assert checked > 50
    assert spilling.cached_tokens == staying.cached_tokens
    assert spilling.pool.resident <= 1
