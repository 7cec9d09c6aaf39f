"""Honest health: the gateway is NOT_SERVING while its verifier is down or not SERVING, and
SERVING again within 0.5 s of the verifier's return (same port, a new server)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
BUDGET_S = 0.5


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


def seconds_until(stub, want_serving: bool, timeout_s: float = 5.0) -> float:
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
        assert down < BUDGET_S and up < BUDGET_S, (down, up)

        verifier.server.stop(0)                        # gone
        killed = seconds_until(health, False)
        # the behaviour: an outage long enough for the gateway's channel to back off; SERVING
        # must still come back within BUDGET_S of the verifier's return
        time.sleep(1.0)
        verifier = start_verifier(engine, f"127.0.0.1:{port}")
        back = seconds_until(health, True)
        print(f"gateway NOT_SERVING {1e3 * killed:.0f} ms after the verifier stopped, SERVING "
              f"{1e3 * back:.0f} ms after it came back")
        assert killed < BUDGET_S and back < BUDGET_S, (killed, back)

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
