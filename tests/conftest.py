"""Shared fixtures: tiny random-weight target + drafters, and in-process services on loopback.

Every service runs its real gRPC server (port 0) in this process; clients use real stubs.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: the tiny test models gain nothing from more, and oversubscribed OpenMP threads
# (tests beside other jobs on a 2-core machine) spin and slow everything down several-fold.
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from dflash.tools.testing import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def target_model(tiny_target):
    from verifier_svc.target import TargetModel

    return TargetModel(tiny_target)


@pytest.fixture(scope="session")
def hf_target(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="session")
def make_drafter(tiny_target, tmp_path_factory):
    """make_drafter(block_size=8, **kw) -> drafter directory (cached per arguments)."""
    from dflash.tools.testing import make_tiny_drafter

    cache = {}

    def make(**kw):
        key = repr(sorted(kw.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("drafter")
            cache[key] = make_tiny_drafter(d, tiny_target, **kw)
        return cache[key]

    return make


class Stack:
    """In-process verifier + drafters + gateway on loopback with real gRPC.

    ``telemetry``: optional ``service name -> dflash.serving.telemetry.Telemetry`` (tracer, registry).
    """

    def __init__(self, target_model, tokenizer, telemetry=None, **engine_kw):
        from gateway.server import build as build_gateway
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.server import build as build_verifier

        self.telemetry = telemetry or (lambda service: None)
        self.engine = VerifierEngine(target_model, **engine_kw)
        self.verifier = build_verifier(self.engine, "127.0.0.1:0", telemetry=self.telemetry("verifier"))
        self.verifier.server.start()
        self.verifier.set_serving(True)
        self.verifier_addr = f"127.0.0.1:{self.verifier.port}"
        self.gateway = build_gateway(tokenizer, self.verifier_addr, "127.0.0.1:0",
                                     max_positions=target_model.max_positions,
                                     telemetry=self.telemetry("gateway"))
        self.gateway.server.start()
        self.gateway.set_serving(True)
        self.gateway_addr = f"127.0.0.1:{self.gateway.port}"
        self.drafters = []
        self._channels = []

    def add_drafter(self, engine, label: str | None = None, default: bool = False) -> str:
        """Serve ``engine`` (Proposer) as a Drafter service; register it; returns its address."""
        from drafter_svc.server import build as build_drafter
        from gateway.server import register_drafter

        rt = build_drafter(engine, "127.0.0.1:0", telemetry=self.telemetry("drafter"))
        rt.server.start()
        rt.set_serving(True)
        self.drafters.append(rt)
        addr = f"127.0.0.1:{rt.port}"
        spec = f"{label}={addr}" if label else addr
        register_drafter(self.gateway.servicer.registry, self.gateway.servicer.verifier, spec,
                         default=default)
        return addr

    def gateway_stub(self):
        from dflash.v1 import gateway_pb2_grpc

        ch = grpc.insecure_channel(self.gateway_addr)
        self._channels.append(ch)
        return gateway_pb2_grpc.GatewayStub(ch)

    def verifier_stub(self):
        from dflash.v1 import verifier_pb2_grpc

        ch = grpc.insecure_channel(self.verifier_addr)
        self._channels.append(ch)
        return verifier_pb2_grpc.VerifierStub(ch)

    def close(self):
        for ch in self._channels:
            ch.close()
        for rt in [self.gateway, self.verifier] + self.drafters:
            rt.server.stop(0)
        if self.verifier.servicer.pool:
            self.verifier.servicer.pool.close()
        self.engine.close()


@pytest.fixture
def stack(target_model, tokenizer):
    s = Stack(target_model, tokenizer)
    yield s
    s.close()


def generate_ids(stub, prompt_ids=None, **kw):
    """Call Verifier.Generate; returns (token ids, last chunk)."""
    from dflash.v1 import common_pb2, verifier_pb2

    sampling = kw.pop("sampling", common_pb2.SamplingParams())
    req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=prompt_ids, sampling=sampling, **kw)
    ids, last = [], None
    for chunk in stub.Generate(req):
        ids += list(chunk.token_ids)
        last = chunk
    return ids, last
