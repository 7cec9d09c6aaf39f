"""A stream whose verifier dies mid-way resumes on another replica from the tokens already
sent: greedy output identical to an uninterrupted run; seeded sampling too (its noise is keyed
by sequence position, dflash.core.sampling.position_noise), penalties included (the resumed
tokens count as output, ``resumed_tokens``); usage and statistics say it moved.

Two real verifiers (engines over the tiny target) behind one gateway. The kill is made
deterministic by a step listener: the first replica to reach decode step ``KILL_AT`` holds its
scheduler thread there while the test stops that replica's server (every open stream dies at
once, as in a crash), then lets it go."""

from __future__ import annotations

import threading

import grpc
import pytest

from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from helpers import wait_until

KILL_AT = 8          # decode steps the first replica runs before it dies
MAX_TOKENS = 24


class Replicas:
    def __init__(self, target_model, tokenizer, n: int = 2):
        from gateway.server import build as build_gateway
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.server import build as build_verifier

        self.engines, self.rts = [], []
        for _ in range(n):
            e = VerifierEngine(target_model)
            rt = build_verifier(e, "127.0.0.1:0")
            rt.server.start()
            rt.set_serving(True)
            self.engines.append(e)
            self.rts.append(rt)
        self.addresses = [f"127.0.0.1:{rt.port}" for rt in self.rts]
        self.gw = build_gateway(tokenizer, self.addresses, "127.0.0.1:0",
                                max_positions=target_model.max_positions)
        self.gw.server.start()
        self.gw.set_serving(True)
        self.ch = grpc.insecure_channel(f"127.0.0.1:{self.gw.port}")
        self.stub = gateway_pb2_grpc.GatewayStub(self.ch)
        wait_until(lambda: len(self.gw.verifier_watch.healthy()) == n, 10, "replicas healthy")
        self.victim: int | None = None
        self._armed = False
        self._reached, self._release = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        for i, e in enumerate(self.engines):
            e.step_listeners.append(lambda req, ev, i=i: self._on_step(i, ev))

    def _on_step(self, i: int, ev) -> None:
        with self._lock:
            hold = self._armed and ev.step == KILL_AT - 1 and self.victim is None
            if hold:
                self.victim = i
        if hold:
            self._reached.set()
            self._release.wait(30)

    def generate(self, kill: bool = False, **kw):
        req = gateway_pb2.GenerateRequest(prompt="The replica that", max_tokens=MAX_TOKENS, **kw)
        if not kill:
            out = list(self.stub.Generate(req, timeout=60))
            return [t for r in out for t in r.token_ids], out[-1]
        self._armed = True
        result: dict = {}

        def read():
            try:
                out = list(self.stub.Generate(req, timeout=60))
            except grpc.RpcError as e:
                result["error"] = e
                return
            result["ids"] = [t for r in out for t in r.token_ids]
            result["last"] = out[-1]

        t = threading.Thread(target=read)
        t.start()
        assert self._reached.wait(30), "no replica reached the kill step"
        assert self.victim is not None
        self.rts[self.victim].server.stop(0)      # a crash: its streams end now
        self._release.set()
        t.join(60)
        assert not t.is_alive(), "the resumed stream hung"
        if "error" in result:
            raise result["error"]
        return result["ids"], result["last"]

    def close(self):
        self.ch.close()
        self.gw.server.stop(0)
        for rt, e in zip(self.rts, self.engines, strict=True):
            rt.server.stop(0)
            e.close()


@pytest.fixture
def replicas(target_model, tokenizer):
    r = Replicas(target_model, tokenizer)
    yield r
    r.close()


SAMPLINGS = {
    "greedy": common_pb2.SamplingParams(),
    "seeded": common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
    "seeded-penalised": common_pb2.SamplingParams(temperature=0.9, seed=77, frequency_penalty=2.0,
                                                  presence_penalty=2.0),
}


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_a_killed_replicas_stream_resumes_identically(replicas, tokenizer, kind):
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(SAMPLINGS[kind])
    sampling.logit_bias[tokenizer.eos_token_id] = -100.0    # runs to max_tokens: past the kill
    want, plain = replicas.generate(sampling=sampling)
    assert len(want) == MAX_TOKENS
    assert plain.usage.resumes == 0
    got, last = replicas.generate(kill=True, sampling=sampling)
    assert got == want, f"{kind}: resumed output differs from the uninterrupted run"
    assert last.usage.resumes == 1 and last.acceptance.resumes == 1
    assert last.usage.completion_tokens == len(want)
    assert last.finish_reason == plain.finish_reason
    survivor = replicas.addresses[1 - replicas.victim]
    assert replicas.gw.verifier_watch.routed[survivor] >= 1


def test_with_every_replica_dead_the_stream_ends_unavailable_naming_them(target_model, tokenizer):
    r = Replicas(target_model, tokenizer, n=1)
    try:
        with pytest.raises(grpc.RpcError) as e:
            r.generate(kill=True)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert r.addresses[0] in e.value.details()
    finally:
        r.close()
