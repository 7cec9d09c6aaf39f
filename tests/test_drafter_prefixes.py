"""The drafter's context cache (issue 61, item 3): a finished request's drafter context is kept
under the verifier's tenant-salted prefix key; a request that hits the verifier's prefix cache
starts its drafter session from it and uploads only the rest of the taps; a drafter that does
not hold it (restarted, evicted) says so and gets the whole context in the same step. Drafts
on a hit are bit-identical to drafts on a miss with the drafter in batch-invariant mode (its
context K/V then does not depend on how the rows arrived); outputs are the target's own.
"""

from __future__ import annotations

import pytest
import torch

from dflash.core.proposer import DraftError, FallbackReason, Proposal, ProposalRequest
from dflash.core.sampling import Sampling
from dflash.core.speculation import SpecMode
from drafter_svc.engine import DrafterEngine
from verifier_svc.drafter_client import RemoteProposer
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.prefix_reuse import new_prefix_cache

from helpers import assert_same_tokens, reference

PROMPT = [(5 * i + 2) % 240 + 3 for i in range(40)]
N = 20


class Recording(DrafterEngine):
    """A DrafterEngine that records every item it serves: (session, context_start, rows,
    prefix_key, the error's reason or (drafts, the top-k log-probs' bytes))."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, int, int, bytes, object]] = []

    def propose(self, requests):
        out = super().propose(requests)
        for r, o in zip(requests, out):
            got = o.reason if isinstance(o, DraftError) else (
                tuple(o.tokens.tolist()),
                None if o.top_logprobs is None else o.top_logprobs.numpy().tobytes())
            self.calls.append((r.session_id, r.context_start, int(r.context.shape[0]),
                               r.prefix_key, got))
        return out


class Restartable:
    """One drafter address whose process restarts: the same proposer object in the verifier,
    a fresh engine (no sessions, no kept prefixes) behind it after :meth:`restart`."""

    def __init__(self, make):
        self.make, self.engine = make, make()
        self.card = self.engine.card

    def restart(self):
        self.engine.close()
        self.engine = self.make()

    def propose(self, requests):
        return self.engine.propose(requests)

    def release(self, ids):
        self.engine.release(ids)

    def keep_prefix(self, sid, key, length):
        self.engine.keep_prefix(sid, key, length)


@pytest.fixture
def make(make_drafter, tiny_target):
    def build(batch_invariant=True, cls=Recording, **kw):
        return cls.from_pretrained(make_drafter(block_size=4), tiny_target, device="cpu",
                                   context_threads=0, batch_invariant=batch_invariant, **kw)
    return build


def _req(sid, start, ctx, block=4, sampling=None, key=b"", top_k=0):
    return ProposalRequest(session_id=sid, context_start=start, context=ctx, anchor_token=7,
                           block_size=block, sampling=sampling or Sampling(), prefix_key=key,
                           top_k=top_k)


def _drafts_hit_and_miss(engine, taps, kept, start):
    """Session "a" fed as a conversation feeds a drafter (a prompt upload, then a few rows per
    step), kept as a prefix of ``kept`` positions; then the same next block drafted from
    ``start`` positions of it ("b") and from a full upload ("c")."""
    pos = 0
    for n in (kept - 9, 3, 2, 4):
        out = engine.propose([_req("a", pos, taps[pos:pos + n])])
        assert isinstance(out[0], Proposal)
        pos += n
    assert pos == kept
    engine.keep_prefix("a", b"k" * 32, kept)
    results = []
    for sampling in SAMPLINGS:
        hit, miss = engine.propose([_req("b", start, taps[start:], sampling=sampling,
                                         key=b"k" * 32, top_k=3),
                                    _req("c", 0, taps, sampling=sampling, top_k=3)])
        engine.release(["b", "c"])
        results.append((sampling, hit, miss))
    return results


# greedy, seeded (drafts race position noise) and unseeded sampled (each session draws from its
# own generator: q is compared, not the draws)
SAMPLINGS = (Sampling(), Sampling(temperature=1.0, seed=5), Sampling(temperature=1.0))


def _same(sampling: Sampling, p: Proposal, q: Proposal) -> bool:
    drawn = not sampling.greedy and sampling.seed is None
    return (drawn or torch.equal(p.tokens, q.tokens)) and (p.probs is None) == (q.probs is None) \
        and (p.probs is None or torch.equal(p.probs, q.probs)) and \
        torch.equal(p.top_logprobs, q.top_logprobs) and torch.equal(p.top_ids, q.top_ids)


def test_drafts_from_a_kept_prefix_are_bit_identical_to_a_full_upload(make):
    engine = make()
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(60, engine.cfg.context_size, generator=g)
    try:
        for sampling, hit, miss in _drafts_hit_and_miss(engine, taps, kept=45, start=40):
            assert isinstance(hit, Proposal) and isinstance(miss, Proposal)
            assert _same(sampling, hit, miss)     # drafts, q, top-k log-probs: every bit
        assert engine.prefix_hits == 3 and engine.prefix_hit_tokens == 120
        assert engine.prefix_misses == 0
        assert engine.num_sessions == 0 and engine.prefix_entries == 1   # "a" moved, not copied
    finally:
        engine.close()


def test_a_prefix_not_held_is_a_miss_and_the_store_is_bounded(make):
    engine = make()
    w = engine.cfg.context_size
    rows = torch.randn(30, w, generator=torch.Generator().manual_seed(1))
    try:
        def miss(key, start):
            out = engine.propose([_req("x", start, rows[start:], key=key)])[0]
            return isinstance(out, DraftError) and out.reason == FallbackReason.PREFIX_MISS

        assert miss(b"never-kept", 10)
        engine.propose([_req("a", 0, rows[:20])])
        engine.keep_prefix("a", b"wrong-length", 19)          # it holds 20: nothing kept
        assert miss(b"wrong-length", 10) and engine.prefix_entries == 0
        engine.propose([_req("a2", 0, rows[:20])])
        engine.keep_prefix("a2", b"k20", 20)
        assert miss(b"k20", 21)                                # fewer positions than asked
        assert not miss(b"k20", 20) and engine.prefix_hits == 1
        assert engine.prefix_misses == 3
        per = engine.prefixes.bytes_per_token
        assert engine.prefix_tokens == 20 and engine.prefix_bytes == 20 * per
    finally:
        engine.close()
    small = make(prefix_mb=50 * per / (1 << 20))               # room for 50 positions
    try:
        for i in range(4):                                     # 4 x 20 positions
            small.propose([_req(f"s{i}", 0, rows[:20])])
            small.keep_prefix(f"s{i}", f"k{i}".encode(), 20)
        assert small.prefix_entries == 2 and small.prefix_evictions == 2
        assert small.prefix_bytes <= 50 * per
        assert small.propose([_req("u", 20, rows[:1], key=b"k0")])[0].reason == \
            FallbackReason.PREFIX_MISS                         # the least recently used went
        assert isinstance(small.propose([_req("u", 20, rows[:1], key=b"k3")])[0], Proposal)
    finally:
        small.close()
    with pytest.raises(ValueError, match="prefix_mb"):
        make(prefix_mb=-1)


def _turns(engine, proposer, between=lambda: None, mode=SpecMode.FIXED):
    """Turn 1, then turn 2 resending the conversation (no session_id); turn 2's tokens."""
    def run(rid, prompt):
        evs = list(engine.generate(Request(request_id=rid, prompt=prompt, max_tokens=N,
                                           ignore_eos=True, proposer=proposer,
                                           spec_mode=mode, tenant="t")))
        return [t for ev in evs for t in ev.tokens], evs[0].cached_prompt_tokens

    first, _ = run("turn1", PROMPT)
    between()
    turn = PROMPT + first + [9, 8, 7]
    second, cached = run("turn2", turn)
    assert cached == len(PROMPT) + N - 1
    return turn, second


def _calls(engine, rid="turn2"):
    """The drafter's items for request ``rid`` (its one-shot session), in order."""
    return [c for c in engine.calls if c[0] == f"req-{rid}"]


@pytest.mark.parametrize("mode", [SpecMode.FIXED, SpecMode.TREE])
def test_a_restarted_drafter_is_sent_everything_and_drafts_the_same(target_model, hf_target,
                                                                     make, mode):
    """The same two turns twice: with the drafter holding turn 1's context (turn 2 starts
    from it and uploads only the rest) and with the drafter restarted between the turns (it
    says it does not hold it; the same step uploads the whole context). Turn 2's drafts (and,
    for a tree, the drafter's top-k log-probs) are identical call for call, and its tokens are
    the target's own."""
    held = Restartable(make)
    lost = Restartable(make)
    runs = {}
    for name, proposer in (("held", held), ("lost", lost)):
        engine = VerifierEngine(target_model, spec_mode=mode,
                                prefix_cache=new_prefix_cache(target_model.pool, 64.0))
        try:
            turn, got = _turns(engine, proposer, mode=mode,
                               between=lost.restart if proposer is lost else lambda: None)
            assert_same_tokens(hf_target, turn, got, reference(hf_target, turn, N,
                                                               ignore_eos=True))
            runs[name] = (_calls(proposer.engine), engine.drafter_prefix_hits,
                          engine.drafter_prefix_misses, engine.drafter_prefix_hit_tokens)
        finally:
            engine.close()
            proposer.engine.close()
    (hit_calls, hits, misses, hit_tokens), (miss_calls, hits2, misses2, _) = runs["held"], runs["lost"]
    kept = hit_calls[0][1]
    assert hit_calls[0][3] and kept > len(PROMPT)       # from the kept prefix: turn 1's answer too
    assert kept + hit_calls[0][2] == len(turn)          # only the rest of the taps
    assert (hits, misses, hit_tokens) == (1, 0, kept)
    # the restarted drafter: the prefix call is refused, the whole context follows at once
    assert miss_calls[0][3] and miss_calls[0][4] == FallbackReason.PREFIX_MISS
    assert miss_calls[1][1] == 0 and not miss_calls[1][3]
    assert (hits2, misses2) == (0, 1)
    drafts = [c[4] for c in hit_calls]
    assert drafts == [c[4] for c in miss_calls[1:]] and any(d[0] for d in drafts)
    assert (mode == SpecMode.TREE) == any(d[1] is not None for d in drafts)


def test_the_wire_carries_keeps_prefix_keys_and_misses(target_model, hf_target, make):
    """Through a drafter service: turn 2 starts from the context kept on the drafter (the
    item carries the key, only the rest of the rows); after the drafter lost its prefixes the
    next such request is answered PREFIX_MISS and uploaded whole; no request fails."""
    from drafter_svc.server import build as build_drafter

    drafter = make()
    rt = build_drafter(drafter, "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    proposer = RemoteProposer(f"127.0.0.1:{rt.port}", drafter.card, timeout_s=30.0)
    engine = VerifierEngine(target_model, spec_mode=SpecMode.FIXED,
                            prefix_cache=new_prefix_cache(target_model.pool, 64.0))
    try:
        turn, got = _turns(engine, proposer)
        want = reference(hf_target, turn, N, ignore_eos=True)
        assert_same_tokens(hf_target, turn, got, want)
        first = _calls(drafter)[0]
        assert first[3] and first[1] > len(PROMPT) and first[1] + first[2] == len(turn)
        assert drafter.prefix_hits == 1 and engine.drafter_prefix_hits == 1
        drafter.prefixes.clear()                       # evicted (or the process restarted)
        evs = list(engine.generate(Request(request_id="again", prompt=turn, max_tokens=N,
                                           ignore_eos=True, proposer=proposer,
                                           spec_mode=SpecMode.FIXED, tenant="t")))
        assert_same_tokens(hf_target, turn, [t for ev in evs for t in ev.tokens], want)
        assert drafter.prefix_misses == 1 and engine.drafter_prefix_misses == 1
        mine = _calls(drafter, "again")
        assert mine[0][4] == FallbackReason.PREFIX_MISS and mine[1][1] == 0
    finally:
        engine.close()
        proposer.close()
        rt.server.stop(0)
        drafter.close()


def test_another_tenant_never_starts_from_a_kept_context(target_model, make):
    drafter = make()
    engine = VerifierEngine(target_model, spec_mode=SpecMode.FIXED,
                            prefix_cache=new_prefix_cache(target_model.pool, 64.0))
    try:
        for rid, tenant in (("a", "A"), ("b", "B"), ("a2", "A")):
            list(engine.generate(Request(request_id=rid, prompt=PROMPT, max_tokens=4,
                                         ignore_eos=True, proposer=drafter,
                                         spec_mode=SpecMode.FIXED, tenant=tenant)))
        keys = {c[3] for c in drafter.calls if c[3]}
        assert engine.drafter_prefix_hits == 1 and len(keys) == 1    # A's second request only
        assert drafter.prefix_entries == 2                          # A's and B's, apart
    finally:
        engine.close()
        drafter.close()


def test_over_mtls_a_kept_prefix_is_its_verifiers_own(make):
    """Keys are scoped by the caller's identity: another verifier naming the same key misses;
    a key longer than the wire allows is refused naming the field."""
    from dflash.core import wire
    from dflash.core.sampling import InvalidParam
    from dflash.v1 import drafter_pb2
    from drafter_svc.servicer import DrafterServicer, _request

    engine = make()
    servicer = DrafterServicer(engine)
    rows = torch.randn(12, engine.cfg.context_size, generator=torch.Generator().manual_seed(2))
    try:
        engine.propose([_req("a", 0, rows[:10])])
        servicer._keep([drafter_pb2.KeepPrefix(session_id="a", key=b"k", length=10)], "spiffe://v1")

        def item(key=b"k"):
            return drafter_pb2.DraftItem(session_id="n", context_start=10, prefix_key=key,
                                         context=wire.to_proto(rows[10:]), anchor_token=3,
                                         block_size=3)

        other = engine.propose([_request(item(), "spiffe://v2")])[0]
        assert isinstance(other, DraftError) and other.reason == FallbackReason.PREFIX_MISS
        assert isinstance(engine.propose([_request(item(), "spiffe://v1")])[0], Proposal)
        with pytest.raises(InvalidParam, match="prefix_key"):
            _request(item(b"x" * 65), "spiffe://v1")
    finally:
        engine.close()
