"""The drafter's top-k alternatives per block position (what DDTree builds its tree from).

In-process engine, over gRPC, the verifier's check of a result (``DrafterSync.malformed``) and
the ranked reference drafter of ``tests/doubles.py``.
"""

from __future__ import annotations

import math
import shutil

import grpc
import pytest
import torch

from dflash.core import wire
from dflash.core.convert import sampling_to_proto
from dflash.core.draft_vocab import save_draft_vocab
from dflash.core.proposer import MAX_TOP_K, DraftError, Proposal, ProposalRequest
from dflash.core.sampling import Sampling
from dflash.v1 import drafter_pb2, drafter_pb2_grpc
from drafter_svc.engine import DrafterEngine
from verifier_svc.drafter_client import RemoteProposer
from verifier_svc.drafter_sync import NONE, DrafterState, DrafterSync, DraftItem

from doubles import ReferenceDrafter

EPS32 = torch.finfo(torch.float32).eps


def _req(sid: str, ctx: torch.Tensor, *, top_k: int = 0, block_size: int = 8, anchor: int = 7,
         sampling: Sampling | None = None, start: int = 0) -> ProposalRequest:
    return ProposalRequest(session_id=sid, context_start=start, context=ctx, anchor_token=anchor,
                           block_size=block_size, sampling=sampling or Sampling(), top_k=top_k)


def _ctx(engine: DrafterEngine, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, engine.cfg.context_size, generator=torch.Generator().manual_seed(seed))


def _logits(engine: DrafterEngine, r: ProposalRequest) -> torch.Tensor:
    """The engine's draft logits [block_size - 1, N] for ``r`` (a session it has drafted)."""
    with torch.inference_mode():
        return engine._draft_blocks([(r, engine._sessions[r.session_id])])[0]


@pytest.fixture
def engines(make_drafter, tiny_target):
    """Two engines on the same drafter: one under test, one for independent recomputation."""
    d = make_drafter(block_size=8)
    made = [DrafterEngine.from_pretrained(d, tiny_target, context_threads=0) for _ in range(2)]
    yield made
    for e in made:
        e.close()


# ---------------------------------------------------------------------------- in-process engine
def test_greedy_top_ids_lead_with_the_drafts_and_are_the_log_softmax(engines):
    engine, other = engines
    for trial in range(4):
        ctx = _ctx(engine, 5 + 7 * trial, trial)
        r = _req(f"s{trial}", ctx, top_k=16, anchor=11 * trial)
        p = engine.propose([r])[0]
        assert p.top_ids.shape == (7, 16) and p.top_ids.dtype == torch.int64
        assert p.top_logprobs.shape == (7, 16) and p.top_logprobs.dtype == torch.float32
        assert torch.equal(p.top_ids[:, 0], p.tokens)
        assert (p.top_logprobs <= 0).all()
        assert (p.top_logprobs[:, 1:] <= p.top_logprobs[:, :-1]).all()
        # Independent recomputation: the other engine drafts the same context as a chain, its
        # logits are recomputed by a second forward and their log-softmax taken in float64.
        other.propose([_req(r.session_id, ctx, anchor=r.anchor_token)])
        lg = _logits(other, r)
        ref = torch.log_softmax(lg.double(), -1)
        want_lp, want_ids = ref.topk(16, dim=-1)
        assert torch.equal(p.top_ids, want_ids)
        # float32 log-softmax = x - max - log(sum exp(x - max)): a few roundings of values no
        # larger than M = max |log-prob| of the row, so its error is a small multiple of
        # eps * M (measured at most 0.68 eps * M on these rows); 2 eps * M is the bound.
        bound = 2 * EPS32 * ref.abs().amax(-1, keepdim=True)
        assert ((p.top_logprobs.double() - want_lp).abs() <= bound).all()
        # and exactly what float32 log-softmax of those logits gives
        assert torch.equal(p.top_logprobs, torch.log_softmax(lg, -1).topk(16, dim=-1).values)


def test_top_k_zero_gives_none_and_top_k_leaves_the_chain_bit_identical(engines):
    """The chain (tokens) does not depend on top_k; the top-k is the drafter's temperature-1
    distribution whatever the request's sampling."""
    with_k, without = engines
    samplings = [Sampling(), Sampling(temperature=0.8, seed=3),
                 Sampling(temperature=1.0, top_p=0.9, seed=11), Sampling(temperature=0.5, top_k=5, seed=2)]
    tops = []
    for i, s in enumerate(samplings):
        ctx = _ctx(with_k, 9, 100)          # one context for every sampling
        a = with_k.propose([_req(f"s{i}", ctx, top_k=16, sampling=s)])[0]
        b = without.propose([_req(f"s{i}", ctx, top_k=0, sampling=s)])[0]
        assert b.top_ids is None and b.top_logprobs is None
        assert torch.equal(a.tokens, b.tokens)
        # greedy and seeded drafts carry no q (seeded ones are verified by coupling)
        assert a.probs is None and b.probs is None
        tops.append((a.top_ids, a.top_logprobs))
    for ids, lp in tops[1:]:
        assert torch.equal(ids, tops[0][0]) and torch.equal(lp, tops[0][1])


def test_bad_top_k_fails_its_session_alone(engines):
    engine, alone = engines
    ctx = _ctx(engine, 6, 1)
    good = [_req("g0", ctx, top_k=4), _req("g1", ctx, top_k=0, anchor=9)]
    out = engine.propose([good[0], _req("big", ctx, top_k=MAX_TOP_K + 1),
                          _req("neg", ctx, top_k=-1), good[1]])
    for bad in out[1:3]:
        assert isinstance(bad, DraftError) and bad.reason == "bad_request"
        assert "top_k" in str(bad)
    assert "big" not in engine._sessions and "neg" not in engine._sessions
    for r, got in zip(good, (out[0], out[3])):
        want = alone.propose([r])[0]
        assert torch.equal(got.tokens, want.tokens)
        if want.top_ids is None:
            assert got.top_ids is None
        else:
            assert torch.equal(got.top_ids, want.top_ids)
    ok = engine.propose([_req("max", ctx, top_k=MAX_TOP_K)])[0]
    assert ok.top_ids.shape == (7, MAX_TOP_K)


def test_mixed_top_k_in_one_batch_equal_each_alone(engines):
    batched, alone = engines
    # (context rows, block size, top_k, sampling): context-only items carry no top-k
    items = [(5, 8, 16, Sampling()), (30, 4, 1, Sampling()), (12, 8, 64, Sampling(temperature=0.8, seed=3)),
             (7, 2, 5, Sampling()), (19, 8, 0, Sampling()), (3, 1, 8, Sampling())]
    reqs = [_req(f"m{i}", _ctx(batched, n, 10 + i), block_size=bs, top_k=k, sampling=s, anchor=9 * i)
            for i, (n, bs, k, s) in enumerate(items)]
    got = batched.propose(reqs)
    for r, g in zip(reqs, got):
        w = alone.propose([r])[0]
        assert torch.equal(g.tokens, w.tokens), r.session_id
        if r.top_k == 0 or r.block_size <= 1:
            assert g.top_ids is None and g.top_logprobs is None and w.top_ids is None
            continue
        assert g.top_ids.shape == (r.block_size - 1, r.top_k)
        assert torch.equal(g.top_ids, w.top_ids), r.session_id
        # The batched forward (masked, padded blocks) and the one-session forward reduce in a
        # different order: their logits, hence log-probs, differ by float32 rounding (measured
        # at most 1.5e-6 on these items).
        torch.testing.assert_close(g.top_logprobs, w.top_logprobs, atol=4e-6, rtol=0)


def test_draft_vocabulary_ids_are_target_ids_and_cap_the_columns(make_drafter, tiny_target, tmp_path):
    d = make_drafter(block_size=8)
    ids = torch.randperm(272, generator=torch.Generator().manual_seed(0))[:40]
    sub_dir = shutil.copytree(d, tmp_path / "with_vocab")
    save_draft_vocab(sub_dir, ids)
    sub = DrafterEngine.from_pretrained(sub_dir, tiny_target, context_threads=0)
    try:
        assert sub.draft_vocab is not None and sub.draft_vocab.numel() == 40
        r = _req("v", _ctx(sub, 6, 3), top_k=MAX_TOP_K)
        p = sub.propose([r])[0]
        assert p.top_ids.shape == (7, 40)                      # as many as the vocabulary has
        assert torch.equal(p.top_ids[:, 0], p.tokens)
        lg = _logits(sub, r)                                   # [7, 40] over draft ids
        want_lp, want = torch.log_softmax(lg, -1).topk(40, dim=-1)
        assert torch.equal(p.top_ids, ids[want])
        assert torch.equal(p.top_logprobs, want_lp)
        assert set(p.top_ids.flatten().tolist()) == set(ids.tolist())
    finally:
        sub.close()


def test_a_tie_at_the_top_keeps_the_greedy_draft_at_rank_zero(engines):
    engine = engines[0]
    lg = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0], [5.0, 1.0, 5.0, 0.0]])
    ids, lp = engine._top_k(lg, 2)
    assert ids[:, 0].tolist() == lg.argmax(-1).tolist() == [1, 0, 0]
    assert (lp[:, 1:] <= lp[:, :-1]).all()
    for row in range(3):
        assert len(set(ids[row].tolist())) == 2
        assert torch.equal(lp[row], torch.log_softmax(lg[row], -1)[ids[row]])
    one, lp1 = engine._top_k(lg, 1)                     # one column: the tie still resolves
    assert one.shape == (3, 1) and one[:, 0].tolist() == [1, 0, 0]
    assert torch.equal(lp1[:, 0], torch.log_softmax(lg, -1).amax(-1))


# ---------------------------------------------------------------------------- over gRPC
@pytest.fixture
def served(engines):
    from drafter_svc.server import build as build_drafter

    engine = engines[0]
    rt = build_drafter(engine, "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    proposer = RemoteProposer(f"127.0.0.1:{rt.port}", engine.card, timeout_s=5.0)
    yield proposer, rt.port, engines[1]
    proposer.close()
    rt.server.stop(0)


def test_top_k_arrives_over_grpc_as_computed(served):
    remote, _, local = served
    reqs = [_req("a", _ctx(local, 8, 5), top_k=16),
            _req("b", _ctx(local, 4, 6), top_k=3, sampling=Sampling(temperature=1.0, seed=1)),
            _req("c", _ctx(local, 5, 7), top_k=0),
            _req("d", _ctx(local, 5, 8), top_k=MAX_TOP_K + 1)]
    got = remote.propose(reqs)
    want = local.propose(reqs)
    for r, g, w in zip(reqs, got, want):
        if isinstance(w, DraftError):
            assert isinstance(g, DraftError) and g.reason == "bad_request" and "top_k" in str(g)
            continue
        assert torch.equal(g.tokens, w.tokens)
        assert (g.probs is None) == (w.probs is None)
        if r.top_k == 0:
            assert g.top_ids is None and g.top_logprobs is None
            continue
        assert g.top_ids.dtype == torch.int64 and g.top_logprobs.dtype == torch.float32
        assert torch.equal(g.top_ids, w.top_ids) and torch.equal(g.top_logprobs, w.top_logprobs)
        assert DrafterSync(vocab_size=local.cfg.vocab_size).malformed(g, r.block_size - 1, r.top_k) is None


def test_an_item_without_top_k_gets_no_top_tensors(served):
    """A verifier that predates top-k sends DraftItems without the field: chain results."""
    _, port, local = served
    ctx = _ctx(local, 6, 9)
    item = drafter_pb2.DraftItem(session_id="old", context_start=0, context=wire.to_proto(ctx),
                                 anchor_token=7, block_size=8, sampling=sampling_to_proto(Sampling()))
    assert not item.top_k
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        replies = drafter_pb2_grpc.DrafterStub(ch).Draft(
            iter([drafter_pb2.DraftBatch(batch_id=1, items=[item])]), timeout=10)
        res = next(iter(replies)).results[0]
    assert not res.error and len(res.tokens) == 7
    assert not res.HasField("top_ids") and not res.HasField("top_logprobs")
    assert list(res.tokens) == local.propose([_req("old", ctx)])[0].tokens.tolist()


# ---------------------------------------------------------------------------- the verifier's check
V = 272


def _good(k: int = 3, c: int = 4) -> Proposal:
    ids = torch.stack([torch.arange(c) * 5 + j for j in range(k)])                 # distinct rows
    lp = torch.log(torch.tensor([0.5 ** (i + 1) for i in range(c)])).expand(k, c).clone()
    return Proposal(tokens=ids[:, 0].clone(), top_ids=ids, top_logprobs=lp)


def _with(p: Proposal, **kw) -> Proposal:
    return Proposal(**{"tokens": p.tokens, "probs": p.probs, "top_ids": p.top_ids,
                       "top_logprobs": p.top_logprobs, **kw})


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def test_malformed_top_k_results_are_refused():
    sync = DrafterSync(vocab_size=V)
    g = _good()
    ids, lp = g.top_ids, g.top_logprobs
    assert sync.malformed(g, 3, 4) is None
    assert sync.malformed(_with(g, top_ids=ids[:, :2], top_logprobs=lp[:, :2]), 3, 4) is None  # fewer
    assert sync.malformed(_with(g, top_ids=None, top_logprobs=None), 3, 4) is None  # chain drafter
    bad = {
        "ids missing": _with(g, top_ids=None),
        "log-probs missing": _with(g, top_logprobs=None),
        "more columns than asked": _with(g, top_ids=torch.cat([ids, ids[:, :1] + 1], 1),
                                         top_logprobs=torch.cat([lp, lp[:, -1:] - 1], 1)),
        "no columns": _with(g, top_ids=ids[:, :0], top_logprobs=lp[:, :0]),
        "rows != k": _with(g, top_ids=ids[:2], top_logprobs=lp[:2]),
        "shapes differ": _with(g, top_logprobs=lp[:, :3]),
        "1-d": _with(g, top_ids=ids[0], top_logprobs=lp[0]),
        "ids int32": _with(g, top_ids=ids.int()),
        "log-probs float64": _with(g, top_logprobs=lp.double()),
        "id negative": _with(g, top_ids=_set(ids, (1, 2), -1)),
        "id = vocab": _with(g, top_ids=_set(ids, (0, 3), V)),
        "id repeated in a row": _with(g, top_ids=_set(ids, (2, 3), int(ids[2, 1]))),
        "NaN": _with(g, top_logprobs=_set(lp, (0, 1), float("nan"))),
        "-inf": _with(g, top_logprobs=_set(lp, (1, 3), -math.inf)),
        "positive": _with(g, top_logprobs=lp + 1.0),
        "not descending": _with(g, top_logprobs=_set(lp, (2, 2), float(lp[2, 0]))),
    }
    for what, p in bad.items():
        assert sync.malformed(p, 3, 4) == "malformed_topk", what
    assert sync.malformed(g, 3, 0) == "malformed_topk"             # not asked for
    assert sync.malformed(g, 3, 2) == "malformed_topk"             # 4 columns > top_k 2


def _item(sid: str, drafter, ctx_rows: int, *, k: int, top_k: int) -> DraftItem:
    state = DrafterState(proposer=drafter, tap_ids=tuple(drafter.card.target_layer_ids))
    state.taps.append(torch.zeros(ctx_rows, drafter.card.hidden_size))
    return DraftItem(session_id=sid, state=state, proposer=drafter, cached=ctx_rows, anchor=1,
                     k=k, room=True, sampling=Sampling(), trace_context={}, top_k=top_k)


class _Target:
    vocab_size = V
    hidden_size = 8


class _ChainOnly(ReferenceDrafter):
    """A drafter that predates top-k: it never returns top tensors."""

    def propose(self, requests):
        out = super().propose(requests)
        for p in out:
            if isinstance(p, Proposal):
                p.top_ids = p.top_logprobs = None
        return out


class _Unsorted(ReferenceDrafter):
    def propose(self, requests):
        out = super().propose(requests)
        for p in out:
            if isinstance(p, Proposal) and p.top_logprobs is not None:
                p.top_logprobs = p.top_logprobs.flip(-1)
        return out


def test_draft_outcomes_carry_the_top_k_or_fall_back():
    ref = list(range(10, 60))
    sync = DrafterSync(vocab_size=V)
    oracle = ReferenceDrafter(_Target(), {"t": ref, "c": ref}, block_size=8, ranks={6: 2})
    out = sync.draft([_item("t", oracle, 4, k=5, top_k=3), _item("c", oracle, 4, k=5, top_k=0)]).outcomes
    tree, chain = out
    assert tree.fallback is None and tree.top_ids.shape == (5, 3)
    assert tree.top_ids[:, 0].tolist() == tree.tokens.tolist()
    assert tree.top_ids[1].tolist() == [ref[6] + 1, ref[6] + 2, ref[6]]     # position 6: rank 2
    assert chain.fallback is None and chain.top_ids is None and chain.top_logprobs is None
    assert chain.tokens.tolist() == tree.tokens.tolist()
    old = sync.draft([_item("t", _ChainOnly(_Target(), {"t": ref}, block_size=8), 4, k=5, top_k=3)]).outcomes[0]
    assert old.fallback is None and old.top_ids is None and len(old.tokens) == 5
    bad = sync.draft([_item("t", _Unsorted(_Target(), {"t": ref}, block_size=8), 4, k=5, top_k=3)]).outcomes[0]
    assert bad.fallback == "malformed_topk" and bad.tokens.tolist() == [] and bad.top_ids is None
    assert NONE.top_ids is None and NONE.top_logprobs is None


# ---------------------------------------------------------------------------- the ranked double
def test_reference_drafter_puts_the_reference_at_the_chosen_rank():
    ref = list(range(100, 140))
    pos = 9                                             # the anchor's position: drafts 10..16
    req = _req("s", torch.zeros(pos, 8), top_k=4)
    d = ReferenceDrafter(_Target(), {"s": ref}, block_size=8, ranks={11: 1, 12: 3, 14: 4})
    p = d.propose([req])[0]
    assert p.top_ids.shape == (7, 4) and p.top_logprobs.shape == (7, 4)
    want_lp = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    assert torch.equal(p.top_logprobs, want_lp.expand(7, 4))
    assert torch.logsumexp(p.top_logprobs, -1).lt(0).all()           # a distribution's prefix
    for j, at in enumerate(range(pos + 1, pos + 8)):
        row = p.top_ids[j].tolist()
        assert len(set(row)) == 4
        rank = {11: 1, 12: 3, 14: 4}.get(at, 0)
        if rank < 4:
            assert row.index(ref[at]) == rank
        else:
            assert ref[at] not in row                            # rank >= top_k: absent
        assert p.tokens[j] == row[0]
        assert (p.tokens[j] == ref[at]) == (rank == 0)           # the chain is wrong where ranked
    chain = d.propose([_req("s", torch.zeros(pos, 8))])[0]        # top_k 0: the same chain
    assert chain.top_ids is None and torch.equal(chain.tokens, p.tokens)

    per_session = ReferenceDrafter(_Target(), {"s": ref, "u": ref}, block_size=8,
                                   ranks=lambda sid, at: 2 if sid == "u" and at == 10 else 0)
    s, u = per_session.propose([req, _req("u", torch.zeros(pos, 8), top_k=4)])
    assert s.top_ids[0, 0] == ref[10] and u.top_ids[0].tolist().index(ref[10]) == 2

    adv = ReferenceDrafter(_Target(), {"s": ref}, block_size=8, adversarial=True)
    a = adv.propose([_req("s", torch.zeros(pos, 8), top_k=MAX_TOP_K)])[0]
    assert a.top_ids.shape == (7, MAX_TOP_K)
    for j, at in enumerate(range(pos + 1, pos + 8)):
        assert ref[at] not in a.top_ids[j].tolist() and a.tokens[j] == (ref[at] + 1) % V
    err = adv.propose([_req("s", torch.zeros(pos, 8), top_k=MAX_TOP_K + 1)])[0]
    assert isinstance(err, DraftError) and err.reason == "bad_request" and "top_k" in str(err)
