"""The new sampling parameters: validation naming the field (in-process and through the
verifier's gRPC service), the proto round trip, and the processors and min-p against
transformers' own logits processors and warpers."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash.core.convert import sampling_from_proto, sampling_to_proto
from dflash.core.logits_processors import LogitsProcessor, chain_parents
from dflash.core.sampling import InvalidParam, Sampling, probs_from_logits
from dflash.v1 import common_pb2
from verifier_svc.request import Request, validate

from helpers import generate_ids

NAN = float("nan")

BAD = [
    ("presence-high", dict(presence_penalty=2.5), "presence_penalty"),
    ("presence-low", dict(presence_penalty=-2.01), "presence_penalty"),
    ("presence-nan", dict(presence_penalty=NAN), "presence_penalty"),
    ("frequency-high", dict(frequency_penalty=3.0), "frequency_penalty"),
    ("frequency-inf", dict(frequency_penalty=-math.inf), "frequency_penalty"),
    ("repetition-neg", dict(repetition_penalty=-1.0), "repetition_penalty"),
    ("repetition-huge", dict(repetition_penalty=11.0), "repetition_penalty"),
    ("repetition-nan", dict(repetition_penalty=NAN), "repetition_penalty"),
    ("min-p-neg", dict(min_p=-0.1), "min_p"),
    ("min-p-above-1", dict(min_p=1.5), "min_p"),
    ("min-p-nan", dict(min_p=NAN), "min_p"),
    ("bias-too-many", dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    ("bias-value-high", dict(logit_bias={5: 101.0}), "logit_bias"),
    ("bias-value-nan", dict(logit_bias={5: NAN}), "logit_bias"),
    ("bias-negative-id", dict(logit_bias={-1: 1.0}), "logit_bias"),
    ("bias-float-id", dict(logit_bias={1.5: 1.0}), "logit_bias"),
    ("bias-twice", dict(logit_bias=[(4, 1.0), (4, 2.0)]), "logit_bias"),
    ("top-logprobs-high", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-neg", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("top-logprobs-alone", dict(top_logprobs=3), "top_logprobs"),
    ("logprobs-not-bool", dict(logprobs=1), "logprobs"),
]


@pytest.mark.parametrize("kw,field", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(InvalidParam) as ei:
        Sampling(**kw)
    assert ei.value.field == field and str(ei.value).startswith(f"{field}:")


def test_bounds_are_inclusive_and_defaults_are_off():
    s = Sampling(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=10.0, min_p=1.0,
                 logit_bias={i: (-100.0 if i % 2 else 100.0) for i in range(300)},
                 logprobs=True, top_logprobs=20)
    assert len(s.logit_bias) == 300 and s.logit_bias[0] == (0, 100.0)
    assert Sampling(repetition_penalty=0.0).repetition_penalty == 1.0     # 0 = off
    assert not Sampling().penalised and not Sampling(min_p=0.5, logprobs=True).penalised
    assert Sampling(logit_bias={3: 0.0}).penalised
    # the drafter is sent neither the processors nor the logprobs request; min-p it keeps
    d = Sampling(temperature=0.7, seed=4, min_p=0.1, frequency_penalty=1.0, logit_bias={3: 1.0},
                 logprobs=True).for_drafter()
    assert d == Sampling(temperature=0.7, seed=4, min_p=0.1)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    req = Request(request_id="x", prompt=[1, 2], sampling=Sampling(logit_bias={271: 1.0}))
    validate(req, vocab_size=272, window=64)
    req.sampling = Sampling(logit_bias={5: 1.0, 272: 1.0})
    with pytest.raises(InvalidParam) as ei:
        validate(req, vocab_size=272, window=64)
    assert ei.value.field == "logit_bias" and "272" in str(ei.value)


def test_proto_round_trip():
    s = Sampling(temperature=0.5, top_k=7, top_p=0.75, seed=9, presence_penalty=0.5,
                 frequency_penalty=-1.25, repetition_penalty=1.5, min_p=0.125,
                 logit_bias={3: -100.0, 17: 2.5}, logprobs=True, top_logprobs=4)
    assert sampling_from_proto(sampling_to_proto(s)) == s
    assert sampling_from_proto(sampling_to_proto(Sampling())) == Sampling()
    assert sampling_to_proto(Sampling()).repetition_penalty == 0.0     # off on the wire


WIRE_BAD = [
    ("presence", dict(presence_penalty=2.5), "presence_penalty"),
    ("repetition", dict(repetition_penalty=-1.0), "repetition_penalty"),
    ("min-p", dict(min_p=1.5), "min_p"),
    ("bias-id-eq-vocab", dict(logit_bias={272: 1.0}), "logit_bias"),
    ("bias-negative-id", dict(logit_bias={-3: 1.0}), "logit_bias"),
    ("bias-value", dict(logit_bias={3: -250.0}), "logit_bias"),
    ("top-logprobs", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-alone", dict(top_logprobs=2), "top_logprobs"),
]


def test_verifier_refuses_bad_sampling_and_stays_up(stack):
    v = stack.verifier_stub()
    for name, kw, field in WIRE_BAD:
        with pytest.raises(grpc.RpcError) as ei:
            generate_ids(v, [1, 2, 3], max_tokens=4, sampling=common_pb2.SamplingParams(**kw))
        err = ei.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
        assert f"{field}:" in err.details(), (name, err.details())
    ids, _ = generate_ids(v, [1, 2, 3], max_tokens=3, ignore_eos=True,
                          sampling=common_pb2.SamplingParams(frequency_penalty=1.0,
                                                             logit_bias={7: 100.0}))
    assert ids == [7, 7, 7]


# ---------------------------------------------------------------------------- against transformers
WARPER_CASES = [dict(temperature=0.7, min_p=0.1), dict(temperature=1.3, top_k=9, min_p=0.05),
                dict(temperature=1.0, top_p=0.8, min_p=0.2), dict(temperature=0.5, min_p=1.0),
                dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.3)]


@pytest.mark.parametrize("kw", WARPER_CASES, ids=[str(i) for i in range(len(WARPER_CASES))])
def test_probs_match_transformers_warpers(kw):
    """Temperature -> top-k -> top-p -> min-p, as transformers' generate() applies them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g) * 3
    s = Sampling(**kw)
    x = TemperatureLogitsWarper(s.temperature)(None, logits.clone())
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(None, x)
    if s.top_p < 1:
        x = TopPLogitsWarper(s.top_p)(None, x)
    x = MinPLogitsWarper(s.min_p)(None, x)
    want = x.softmax(-1)
    got = probs_from_logits(logits, s)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)
    if kw["min_p"] > 0.15:      # min-p removed tokens top-k/top-p kept
        assert (got > 0).sum() < (probs_from_logits(logits, Sampling(
            **{**kw, "min_p": 0.0})) > 0).sum()


def test_greedy_ignores_min_p():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(1))
    assert torch.equal(probs_from_logits(logits, Sampling(min_p=0.9)),
                       probs_from_logits(logits, Sampling()))


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 40, generator=g) * 2
    prompt, out = [1, 5, 5, 9], [3, 9, 12]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), logits.clone())
    p = LogitsProcessor(Sampling(repetition_penalty=1.7), prompt, 40)
    p.commit(out)
    assert torch.allclose(p.apply(logits), want, atol=1e-6)


def test_each_block_row_is_processed_with_its_own_path():
    """A chain and a tree: row j of the block equals one row processed after committing the
    tokens on j's path (the state advanced token by token), and the raw logits are unchanged."""
    V = 20
    s = Sampling(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.4,
                 logit_bias={2: 1.5, 7: -3.0})
    prompt, done = [4, 4, 11], [2, 6]
    tokens = [6, 2, 6, 9, 13]
    g = torch.Generator().manual_seed(3)
    for parents in (chain_parents(len(tokens)), [-1, 0, 1, 1, 0, 4]):
        logits = torch.randn(len(tokens) + 1, V, generator=g)
        raw = logits.clone()
        p = LogitsProcessor(s, prompt, V)
        p.commit(done)
        got = p.apply(logits, tokens, parents)
        assert torch.equal(logits, raw)
        for j in range(len(tokens) + 1):
            path, i = [], j
            while i > 0:
                path.insert(0, tokens[i - 1])
                i = parents[i]
            one = LogitsProcessor(s, prompt, V)
            one.commit(done + path)
            assert torch.allclose(got[j], one.apply(logits[j:j + 1])[0], atol=1e-6), (parents, j)
