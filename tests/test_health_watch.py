"""Honest health: the gateway is NOT_SERVING while its verifier is down or not SERVING, and
SERVING again once the verifier returns (same port, a new server) after an outage long enough
for gRPC's default reconnect back-off to grow past a second. How soon is the channel's business
(its capped back-off, checked here as configuration); the timings are printed, never bounded:
a wall-clock bound would test the machine's speed."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
LIVENESS_S = 15.0     # a hang, not a speed: each transition normally takes a few checks


def start_verifier(engine, bind):
    from verifier_svc.server import build

    rt = build(engine, bind)
    rt.server.start()
    rt.set_serving(True)
    return rt


def status(stub) -> int:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
    except grpc.RpcError:
        return -1


def seconds_until(stub, want_serving: bool, timeout_s: float = LIVENESS_S) -> float:
    t0 = time.perf_counter()
    wait_until(lambda: (status(stub) == SERVING) == want_serving, timeout_s,
               f"the gateway to become serving={want_serving}")
    return time.perf_counter() - t0


def test_gateway_health_follows_the_verifier(target_model, tokenizer):
    from gateway.server import build as build_gateway
    from verifier_svc.engine import VerifierEngine

    engine = VerifierEngine(target_model)
    verifier = start_verifier(engine, "127.0.0.1:0")
    port = verifier.port
    gateway = build_gateway(tokenizer, f"127.0.0.1:{port}", "127.0.0.1:0",
                            max_positions=target_model.max_positions)
    gateway.server.start()
    gateway.set_serving(True)
    ch = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    health = health_pb2_grpc.HealthStub(ch)
    try:
        seconds_until(health, True)

        verifier.set_serving(False)                    # up but NOT_SERVING (draining)
        down = seconds_until(health, False)
        verifier.set_serving(True)
        up = seconds_until(health, True)

        verifier.server.stop(0)                        # gone
        killed = seconds_until(health, False)
        # an outage long enough for the gateway's channel to back off; SERVING must come back
        time.sleep(1.0)
        verifier = start_verifier(engine, f"127.0.0.1:{port}")
        back = seconds_until(health, True)
        print(f"gateway NOT_SERVING {1e3 * down:.0f} ms after the verifier drained, SERVING "
              f"{1e3 * up:.0f} ms after it undrained; NOT_SERVING {1e3 * killed:.0f} ms after it "
              f"stopped, SERVING {1e3 * back:.0f} ms after it came back")

        gateway.set_serving(False)                     # its own drain wins over a healthy verifier
        assert status(health) != SERVING
        gateway.set_serving(True)
        assert status(health) == SERVING
    finally:
        ch.close()
        gateway.server.stop(0)
        verifier.server.stop(0)
        engine.close()
    gateway.verifier_watch._thread.join(5)             # the watch ends with its server
    assert not gateway.verifier_watch._thread.is_alive(), "health watch thread outlived the gateway"


def test_the_verifier_channel_retries_a_lost_connection_quickly(monkeypatch, tokenizer):
    """gRPC's default reconnect back-off grows from 1 s to 2 minutes: a verifier restarted after
    a short outage would go unused that long. Every verifier channel the gateway dials caps it
    at a fifth of a second, two of the health watch's checks."""
    from gateway import replicas
    from gateway.server import build as build_gateway
    from gateway.upstream import VerifierHealthWatch

    dialed: list[dict] = []
    real = replicas.tls_channel

    def spy(address, tls, *, options):
        dialed.append(dict(options))
        return real(address, tls, options=options)

    monkeypatch.setattr(replicas, "tls_channel", spy)
    gateway = build_gateway(tokenizer, ["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:0",
                            max_positions=64)
    try:
        assert len(dialed) == 2
        interval_ms = 1e3 * VerifierHealthWatch.__init__.__kwdefaults__["interval_s"]
        for options in dialed:
            assert options["grpc.max_reconnect_backoff_ms"] <= 2 * interval_ms, options
            assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
    finally:
        gateway.server.stop(0)
