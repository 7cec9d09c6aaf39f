"""A DFlash2 drafter (v7) swapped in beside a DFlash one (v6) while requests run: registered,
a weighted canary, then the default, then v6 retired. No request fails, every greedy output is
the target's own (speculation off), and each version's tau is in the verifier's metrics and in
``dflash top``."""

from __future__ import annotations

import threading
import time

import grpc
from prometheus_client import generate_latest

from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from dflash_app import top
from drafter_svc.engine import DrafterEngine

from helpers import Stack, reference, wait_until

THREADS, MAX_NEW = 3, 24
V6, V7 = "tiny-drafter@6", "tiny-drafter@7"


def test_v7_dflash2_canary_default_and_v6_retired_under_traffic(
        target_model, tokenizer, hf_target, tiny_target, make_drafter):
    from drafter_svc.server import build as build_drafter

    tel = {s: Telemetry(service=s) for s in ("verifier", "gateway", "drafter")}
    stack = Stack(target_model, tokenizer, telemetry=tel.__getitem__)
    servers = [serve_metrics(tel[s].registry, 0, "127.0.0.1") for s in ("verifier", "gateway")]
    stop, threads, results, errors = threading.Event(), [], [], []
    try:
        tp = tokenizer.encode("Hi there")
        want = reference(hf_target, tp, MAX_NEW)
        stack.add_drafter(DrafterEngine.from_pretrained(
            make_drafter(block_size=8, version="6"), tiny_target), default=True)
        v7_engine = DrafterEngine.from_pretrained(
            make_drafter(block_size=8, version="7", dflash2=True), tiny_target)
        assert type(v7_engine.drafter).__name__ == "DFlash2Drafter"
        v7 = build_drafter(v7_engine, "127.0.0.1:0", telemetry=Telemetry(service="drafter"))
        v7.server.start()
        v7.set_serving(True)
        stack.drafters.append(v7)
        ch = grpc.insecure_channel(f"127.0.0.1:{stack.gateway.admin.port}")
        stack._channels.append(ch)
        admin, gw = gateway_pb2_grpc.GatewayAdminStub(ch), stack.gateway_stub()

        def load(t):
            i = 0
            while not stop.is_set():
                try:
                    req = gateway_pb2.GenerateRequest(prompt="Hi there", max_tokens=MAX_NEW,
                                                      session_id=f"w{t}-{i}")
                    started = time.monotonic()
                    resps = list(gw.Generate(req))
                    results.append((started, [x for r in resps for x in r.token_ids],
                                    resps[-1].drafter))
                except grpc.RpcError as e:
                    errors.append(e)
                i += 1

        def served_after(at, label, n=3):
            return lambda: sum(s > at and d == label for s, _, d in results) >= n or errors

        threads += [threading.Thread(target=load, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        wait_until(served_after(0.0, V6), 60, "requests on v6")
        e7 = admin.RegisterDrafter(gateway_pb2.RegisterDrafterRequest(address=f"127.0.0.1:{v7.port}"))
        assert f"{e7.name}@{e7.version}" == V7
        admin.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={V6: 0.7, V7: 0.3}))
        canary = time.monotonic()
        wait_until(served_after(canary, V7), 90, "canary requests on v7")
        wait_until(served_after(canary, V6), 90, "requests still on v6 during the canary")
        admin.SetDefaultDrafter(gateway_pb2.DrafterRef(drafter=V7))
        admin.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={V7: 1.0}))
        admin.DeregisterDrafter(gateway_pb2.DrafterRef(drafter=V6))
        retired = time.monotonic()
        listed = admin.ListDrafters(gateway_pb2.ListDraftersRequest()).drafters
        assert [(f"{d.name}@{d.version}", d.weight) for d in listed] == [(V7, 1.0)]
        wait_until(served_after(retired, V7), 90, "requests on v7 after v6 is retired")
        stack.drafters[0].server.stop(grace=2).wait()      # v6's process goes away
        wait_until(served_after(time.monotonic(), V7), 90, "requests after v6 stopped")
        stop.set()
        for th in threads:
            th.join(120)
        assert not errors, errors
        assert all(ids == want for _, ids, _ in results)       # identical to speculation off
        late = [d for s, _, d in results if s > retired]
        assert late and set(late) == {V7}
        metrics = generate_latest(tel["verifier"].registry).decode()
        for label in (V6, V7):
            assert f'drafter_version="{label}"' in metrics
        now, down = top.scrape([f"127.0.0.1:{s.server_port}" for s in servers])
        assert down == []
        rows = {r.version: r for r in top.frame(now).rows}
        assert rows[V6].tau is not None and rows[V6].tau >= 1.0
        assert rows[V7].tau is not None and rows[V7].tau >= 1.0
        out = top.render(top.frame(now))
        assert out is not None
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        for s in servers:
            s.shutdown()
        stack.close()
