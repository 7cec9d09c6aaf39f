"""The gateway's Generate core over gRPC, against a scripted verifier: ``n`` samples run
concurrently with seeds seed + i, each with its own final message and ``index``; a failing
sample cancels the others; logprobs travel with their token ids; chat-template variables and
the fill-the-window default reach the verifier request."""

from __future__ import annotations

import threading

import grpc
import pytest

from dflash.v1 import gateway_pb2, gateway_pb2_grpc

from gateway_doubles import ScriptedVerifier, fake_logprob, serve_verifier
from helpers import wait_until

TEXT = "héllo 😀 世界 and more"


class BarrierVerifier(ScriptedVerifier):
    """Each Generate sends its first chunk (the gateway starts samples 1.. once sample 0's
    prompt is in), then waits until ``parties`` of them are running: sequential samples would
    time out; ``fail_seed``: the request with that seed fails instead of going on."""

    def __init__(self, ids, parties, fail_seed=None):
        super().__init__(ids)
        self.barrier = threading.Barrier(parties, timeout=10)
        self.fail_seed = fail_seed

    def Generate(self, request, context):
        chunks = super().Generate(request, context)
        yield next(chunks)
        self.barrier.wait()
        if self.fail_seed is not None and request.sampling.seed == self.fail_seed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "seed: refused by the script")
        yield from chunks


@pytest.fixture
def gateway(tokenizer):
    """make(verifier) -> Gateway stub of a gateway (gateway.server.build) in front of it."""
    from gateway.server import build

    made = []

    def make(fake):
        vserver, vaddr, _ = serve_verifier(fake)
        rt = build(tokenizer, vaddr, "127.0.0.1:0", max_positions=512)
        rt.server.start()
        rt.set_serving(True)
        ch = grpc.insecure_channel(f"127.0.0.1:{rt.port}")
        made.append((vserver, rt, ch))
        return gateway_pb2_grpc.GatewayStub(ch), rt

    yield make
    for vserver, rt, ch in made:
        ch.close()
        rt.server.stop(0)
        vserver.stop(0)


def _request(**kw):
    kw.setdefault("sampling", {"temperature": 1.0, "seed": 5})
    kw.setdefault("max_tokens", 64)
    return gateway_pb2.GenerateRequest(prompt="Hi", **kw)


def test_n_samples_run_concurrently_with_derived_seeds(gateway, tokenizer):
    fake = BarrierVerifier(tokenizer.encode(TEXT), parties=3)
    stub, _ = gateway(fake)
    resps = list(stub.Generate(_request(n=3), timeout=30))
    assert sorted(r.sampling.seed for r in fake.requests) == [5, 6, 7]
    assert len({r.request_id for r in fake.requests}) == 3
    finals = [r for r in resps if r.HasField("usage")]
    assert sorted(f.index for f in finals) == [0, 1, 2]
    for i in range(3):
        assert "".join(r.text for r in resps if r.index == i and not r.HasField("usage")) == TEXT
    assert all(f.usage.completion_tokens == len(tokenizer.encode(TEXT)) for f in finals)


def test_a_failing_sample_fails_the_request_and_cancels_the_others(gateway, tokenizer):
    import time

    fake = BarrierVerifier(tokenizer.encode(TEXT) * 20, parties=2, fail_seed=6)
    fake.sizes, fake.delay_s = [1], 0.02       # sample 0 would stream for about 10 s
    stub, _ = gateway(fake)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(n=2, max_tokens=500), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused by the script" in e.value.details()
    # both streams end before their last chunk: sample 1's refused after its first, and
    # sample 0's, cancelled by the gateway (otherwise it would complete after ~10 s)
    wait_until(lambda: fake.cancelled + fake.completed >= 2, 5, "both verifier streams to end")
    assert (fake.cancelled, fake.completed) == (2, 0)
    assert time.monotonic() - t0 < 5


def test_n_is_bounded_and_not_with_a_session(gateway, tokenizer):
    stub, _ = gateway(ScriptedVerifier(tokenizer.encode(TEXT)))
    for kw, field in (({"n": 17}, "n"), ({"n": -1}, "n"), ({"n": 2, "session_id": "s"}, "n")):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(**kw), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field)


def test_logprobs_travel_with_their_token_ids(gateway, tokenizer):
    ids = tokenizer.encode(TEXT)
    stub, _ = gateway(ScriptedVerifier(ids, sizes=[1, 3, 2, 5, 4]))
    resps = list(stub.Generate(_request(sampling={"logprobs": True, "top_logprobs": 2}), timeout=30))
    got = []
    for r in resps:
        if r.HasField("usage"):
            continue
        # a delta's logprobs are those of its own ids (multi-byte characters group ids)
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
        got += list(r.logprobs)
    assert [lp.token_id for lp in got] == ids
    assert [lp.logprob for lp in got] == pytest.approx([fake_logprob(t).logprob for t in ids])


def test_without_logprobs_none_are_sent(gateway, tokenizer):
    stub, _ = gateway(ScriptedVerifier(tokenizer.encode(TEXT)))
    resps = list(stub.Generate(_request(), timeout=30))
    assert all(not r.logprobs for r in resps)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    import copy

    from gateway.registry import DrafterRegistry
    from gateway.servicer import GatewayServicer

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "{% if greeting is defined %}{{ greeting }}{% endif %}assistant:")
    s = GatewayServicer(tok, None, DrafterRegistry(), max_positions=512)
    req = gateway_pb2.GenerateRequest(max_tokens=4)
    req.chat.messages.add(role="user", content="hi")
    plain = s._prompt_ids(req)
    warm = s._prompt_ids(req, {"greeting": "Hello there. "})
    assert tok.decode(plain) == "user: hi\nassistant:"
    assert tok.decode(warm) == "user: hi\nHello there. assistant:"
    from dflash.core.sampling import InvalidParam

    with pytest.raises(InvalidParam) as e:
        s._prompt_ids(req, {"add_generation_prompt": False})
    assert e.value.field == "chat_template_kwargs.add_generation_prompt"
    with pytest.raises(InvalidParam) as e:
        s._prompt_ids(gateway_pb2.GenerateRequest(prompt="raw", max_tokens=4), {"greeting": "x"})
    assert e.value.field == "chat_template_kwargs"


def test_fill_context_asks_for_the_rest_of_the_window(gateway, tokenizer):
    fake = ScriptedVerifier(tokenizer.encode(TEXT))
    _, rt = gateway(fake)
    req = gateway_pb2.GenerateRequest(prompt="Hi there", sampling={"temperature": 0})
    list(rt.servicer.stream(req, "test", fill_context=True))
    assert fake.requests[-1].max_tokens == 512 - len(tokenizer.encode("Hi there"))
    with pytest.raises(Exception) as e:      # without it, max_tokens 0 stays refused
        list(rt.servicer.stream(req, "test"))
    assert getattr(e.value, "field", None) == "max_tokens"
