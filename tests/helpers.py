"""Helpers shared by test modules (no test module imports another): reference decoding and
token comparison for the lossless tests, ports and health for the process tests, address and
environment helpers for the deployment tests, :func:`wait_until` for tests that wait for
something to happen, :func:`fixed_os_randomness` for the statistical tests, and the in-process
stack (:class:`Stack`, :func:`generate_ids`). Not a test module."""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from unittest import mock

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.v1 import verifier_pb2

PROMPTS = [[72, 101, 108, 108, 111], [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12],
           [200, 201, 7, 7, 7, 31, 90, 114, 115, 116, 117, 118, 5, 6, 240, 241, 30, 33]]
MAX_NEW = 40
T = TypeVar("T")


def reference(hf_target, prompt, n=MAX_NEW, ignore_eos=False):
    """The target's own greedy ``generate()`` continuation (the ground truth)."""
    kw = {"eos_token_id": hf_target.config.vocab_size + 1} if ignore_eos else {}  # an id never produced
    out = hf_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def assert_same_tokens(hf_target, prompt, got, want):
    """Token equality; on a mismatch, report the target's top-2 logit gap at that position."""
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top = logits.topk(2)
    pytest.fail(f"diverged at generated token {i}: got {got[i:i + 3]}, want {want[i:i + 3]}; "
                f"target top-2 {top.indices.tolist()} logit gap {float(top.values[0] - top.values[1]):.3e}")


def spec(addr, block_size=0):
    """Speculation parameters for a verifier request through the drafter at ``addr``."""
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, block_size=block_size)


def free_ports(n):
    """``n`` TCP ports free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def health(addr, service=""):
    """The ``grpc.health.v1`` status of ``service`` at ``addr`` (2 s deadline)."""
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status


def host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


class RecordingEnviron(dict):
    """os.environ stand-in that records every name the code looks up."""

    def __init__(self, values):
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def wait_until(pred: Callable[[], T], timeout: float = 10.0, what: str | Callable[[], str] = "the condition",
               interval: float = 0.01) -> T:
    """Poll ``pred()`` until it returns something truthy, and return that; after ``timeout``
    seconds raise AssertionError naming ``what`` (a string, or a callable for a message worth
    computing only on failure, such as a process's log). ``interval`` is the poll period only:
    the test goes on as soon as the condition holds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(interval)   # the poll period, not a pace: the loop ends when pred() holds


@contextlib.contextmanager
def fixed_os_randomness(start: int) -> Iterator[None]:
    """Within the block, ``secrets.randbits`` (where an unseeded request's generator takes its
    seed, dflash.core.sampling) returns ``start``, ``start + 1``, ... in place of the OS's bits,
    so a statistical test over unseeded requests is deterministic: its alpha then says how
    unlikely a correct implementation is to fail with this choice of seeds, not how often CI
    fails by chance (a suite of tens of chi-square tests at 1e-3 fails every few dozen runs)."""
    bits = itertools.count(start)
    with mock.patch("secrets.randbits", lambda _bits: next(bits)):
        yield


class Stack:
    """In-process verifier + drafters + gateway on loopback with real gRPC.

    ``telemetry``: optional ``service name -> dflash.serving.telemetry.Telemetry`` (tracer, registry);
    ``gateway_kw``: more keywords for ``gateway.server.build``; the rest go to the engine.
    """

    def __init__(self, target_model, tokenizer, telemetry=None, gateway_kw=None, **engine_kw):
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
                                     telemetry=self.telemetry("gateway"), **(gateway_kw or {}))
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
