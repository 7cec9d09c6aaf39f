"""Shared prompt prefill: the samples of one request (one prefix group) prefill the prompt once.

The first sample prefills; a sample that starts while it runs copies its KV entries (and, when
speculating, its taps) and runs only the last prompt token. The output of every sample must be
what it is alone, token for token, greedy and sampled, with and without a drafter; sessions of
another group (another request, another client) never share.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dflash.core.kv_pool import KVPool
from dflash.core.sampling import Sampling
from dflash.v1 import common_pb2, gateway_pb2, verifier_pb2
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine

PROMPT = list(range(20, 61))          # 41 tokens


def _req(rid, group="", proposer=None, sampling=None, mode="fixed", prompt=PROMPT, n=20):
    return Request(request_id=rid, prompt=prompt, max_tokens=n, ignore_eos=True,
                   proposer=proposer, sampling=sampling or Sampling(), spec_mode=mode,
                   prefix_group=group)


def _drain(gen, first=None):
    events = [first] if first is not None else []
    events += list(gen)
    return [t for ev in events for t in ev.tokens], events


def _alone(engine, **kw):
    return _drain(engine.generate(_req("alone", **kw)))[0]


@pytest.fixture
def drafter(make_drafter, tiny_target):
    return DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target,
                                         device="cpu", context_threads=0)


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=11)])
def test_a_second_sample_copies_the_prompt_and_decodes_as_alone(target_model, drafter,
                                                                 speculate, sampling):
    engine = VerifierEngine(target_model, spec_mode="fixed")
    proposer = drafter if speculate else None
    try:
        want = _alone(engine, proposer=proposer, sampling=sampling)
        first = engine.generate(_req("a", "g1", proposer, sampling))
        ev_a = next(first)                              # sample a's prompt is in its cache
        assert ev_a.cached_prompt_tokens == 0
        second = engine.generate(_req("b", "g1", proposer, sampling))
        ev_b = next(second)
        assert ev_b.cached_prompt_tokens == len(PROMPT) - 1   # copied, only the last token ran
        got_b, evs_b = _drain(second, ev_b)
        got_a, _ = _drain(first, ev_a)
        assert got_a == want and got_b == want
        if speculate:   # the copied taps fed the drafter: it drafted and was accepted as alone
            assert sum(e.drafted for e in evs_b) > 0
    finally:
        engine.close()


def test_other_groups_and_ungrouped_requests_never_share(target_model):
    engine = VerifierEngine(target_model, spec_mode="off")
    try:
        running = engine.generate(_req("a", "g1", mode="off"))
        next(running)
        for rid, group in (("b", "g2"), ("c", "")):
            gen = engine.generate(_req(rid, group, mode="off", n=2))
            assert next(gen).cached_prompt_tokens == 0
            list(gen)
        list(running)
    finally:
        engine.close()


def test_only_the_common_prefix_is_copied(target_model):
    engine = VerifierEngine(target_model, spec_mode="off")
    other = PROMPT[:30] + [7, 8, 9]
    try:
        want = _alone(engine, prompt=other, mode="off")
        running = engine.generate(_req("a", "g", mode="off"))
        next(running)
        gen = engine.generate(_req("b", "g", mode="off", prompt=other))
        ev = next(gen)
        assert ev.cached_prompt_tokens == 30
        assert _drain(gen, ev)[0] == want
        list(running)
    finally:
        engine.close()


def test_kv_pool_fork_copies_resident_and_spilled_sequences():
    pool = KVPool(2, 2, 4)
    src, dst = pool.new_seq(), pool.new_seq()
    row = pool.ensure_resident(src)
    pool.reserve(10)
    for layer in range(2):
        pool.k[layer][row, :, :10] = torch.randn(2, 10, 4)
        pool.v[layer][row, :, :10] = torch.randn(2, 10, 4)
    src.state.length = 10
    want = [(pool.k[i][row, :, :6].clone(), pool.v[i][row, :, :6].clone()) for i in range(2)]
    pool.fork(src, dst, 6)
    assert dst.get_seq_length() == 6 and not dst.resident
    r = pool.ensure_resident(dst)
    for i in range(2):
        assert torch.equal(pool.k[i][r, :, :6], want[i][0])
        assert torch.equal(pool.v[i][r, :, :6], want[i][1])
    pool.spill(src)                                   # from a spilled source as well
    third = pool.new_seq()
    pool.fork(src, third, 3)
    pool.ensure_resident(third)
    assert torch.equal(pool.k[1][third.row, :, :3], want[1][0][:, :3])
    with pytest.raises(ValueError, match="length"):
        pool.fork(src, third, 11)
    with pytest.raises(ValueError, match="dst"):
        pool.fork(src, src, 1)


def test_gateway_n_samples_share_the_prefill_and_match_alone(stack, make_drafter, tiny_target):
    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target))
    gw = stack.gateway_stub()
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    sampling = gateway_pb2.GenerateRequest(prompt=prompt).sampling
    sampling.temperature, sampling.seed = 1.0, 21
    resps = list(gw.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=12, n=3,
                                                         sampling=sampling), timeout=60))
    finals = sorted((r for r in resps if r.HasField("usage")), key=lambda r: r.index)
    texts = ["".join(r.text for r in resps if r.index == i and not r.HasField("usage"))
             for i in range(3)]
    n_prompt = finals[0].usage.prompt_tokens
    # every sample but the first to prefill copied the whole prompt but its last token
    assert sorted(f.usage.cached_prompt_tokens for f in finals) == [0, n_prompt - 1, n_prompt - 1]
    for i in range(3):     # sample i alone: the request's seed + i
        one = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=12, sampling=sampling)
        one.sampling.seed = 21 + i
        alone = list(gw.Generate(one, timeout=60))
        assert "".join(r.text for r in alone if not r.HasField("usage")) == texts[i]
        assert alone[-1].usage.cached_prompt_tokens == 0


def test_a_too_long_prefix_group_is_refused_naming_it(stack):
    stub = stack.verifier_stub()
    req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2,
                                               prefix_group="x" * 5000,
                                               sampling=common_pb2.SamplingParams())
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix_group" in e.value.details()
