"""Swap drafter versions under load with the admin API: no failed request, no verifier restart."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from dflash.v1 import gateway_pb2, gateway_pb2_grpc

from doubles import ReferenceDrafter
from helpers import reference, wait_until

THREADS, PER_THREAD, MAX_NEW = 4, 12, 17


def admin_stub(stack):
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.gateway.admin.port}")   # the admin plane
    stack._channels.append(ch)
    return gateway_pb2_grpc.GatewayAdminStub(ch)


def oracle(target_model, refs, version):
    d = ReferenceDrafter(target_model, refs, block_size=8)
    d.card = dataclasses.replace(d.card, version=version)
    return d


def test_hot_swap_v1_to_v2_under_load(stack, target_model, hf_target, tokenizer):
    from drafter_svc.server import build as build_drafter

    tp = tokenizer.encode("Hi there")
    ref = tp + reference(hf_target, tp, MAX_NEW)
    refs = {f"w{t}-{i}": ref for t in range(THREADS) for i in range(PER_THREAD)}
    stack.add_drafter(oracle(target_model, refs, "1"), default=True)
    v2 = build_drafter(oracle(target_model, refs, "2"), "127.0.0.1:0")
    v2.server.start()
    v2.set_serving(True)
    stack.drafters.append(v2)
    admin = admin_stub(stack)
    gw = stack.gateway_stub()
    results, errors = [], []
    progress = threading.Semaphore(0)

    def load(t):
        for i in range(PER_THREAD):
            try:
                req = gateway_pb2.GenerateRequest(prompt="Hi there", max_tokens=MAX_NEW, session_id=f"w{t}-{i}")
                started = time.monotonic()
                resps = list(gw.Generate(req))
                results.append((started, [x for r in resps for x in r.token_ids], resps[-1]))
            except grpc.RpcError as e:
                errors.append(e)
            progress.release()

    threads = [threading.Thread(target=load, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for _ in range(THREADS * 3):
        progress.acquire()
    # Operator: register v2, move all traffic to it, retire v1, stop v1's process.
    e2 = admin.RegisterDrafter(gateway_pb2.RegisterDrafterRequest(address=f"127.0.0.1:{v2.port}"))
    assert (e2.name, e2.version) == ("oracle", "2")
    admin.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={"oracle@2": 1.0}))
    admin.DeregisterDrafter(gateway_pb2.DrafterRef(drafter="oracle@1"))
    swapped_at = time.monotonic()
    listed = admin.ListDrafters(gateway_pb2.ListDraftersRequest()).drafters
    assert [(d.version, d.weight) for d in listed] == [("2", 1.0)]
    # v1 goes away once a request started after the swap has finished (on v2); nothing
    # restarts the verifier
    wait_until(lambda: any(started > swapped_at for started, _, _ in results) or errors, 60,
               "a request started after the swap to finish")
    stack.drafters[0].server.stop(grace=2).wait()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert len(results) == THREADS * PER_THREAD
    for _, ids, _last in results:
        assert ids == ref[len(tp):]
    used = [last.drafter for _, _, last in results]
    assert "oracle@1" in used and "oracle@2" in used
    late = [last for started, _, last in results if started > swapped_at]   # started after the swap
    assert late and {last.drafter for last in late} == {"oracle@2"}
    assert all(last.acceptance.mean_acceptance_length == pytest.approx(8.0) for last in late)


def test_admin_register_refuses_mismatch_and_unknown(stack, target_model):
    bad = ReferenceDrafter(target_model, {}, block_size=8)
    bad.card = dataclasses.replace(bad.card, vocab_size=target_model.vocab_size + 5)
    from drafter_svc.server import build as build_drafter

    rt = build_drafter(bad, "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    stack.drafters.append(rt)
    admin = admin_stub(stack)
    with pytest.raises(grpc.RpcError) as e:
        admin.RegisterDrafter(gateway_pb2.RegisterDrafterRequest(address=f"127.0.0.1:{rt.port}"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "vocab_size" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        admin.SetDefaultDrafter(gateway_pb2.DrafterRef(drafter="nope@1"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    for call in (admin.SetDefaultDrafter, admin.DeregisterDrafter):
        with pytest.raises(grpc.RpcError) as e:
            call(gateway_pb2.DrafterRef(drafter=""))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "drafter" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        admin.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={"nope@1": 1}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope@1" in e.value.details()


def test_weighted_split_and_sticky_sessions(stack, target_model, hf_target, tokenizer):
    tp = tokenizer.encode("Hi")
    ref = tp + reference(hf_target, tp, 9)
    refs = {f"s{i}": ref for i in range(40)}
    stack.add_drafter(oracle(target_model, refs, "1"), default=True)
    stack.add_drafter(oracle(target_model, refs, "2"))
    admin = admin_stub(stack)
    admin.SetDrafterWeights(gateway_pb2.SetDrafterWeightsRequest(weights={"oracle@1": 1, "oracle@2": 1}))
    gw = stack.gateway_stub()
    first = {}
    for i in range(40):
        last = list(gw.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=9, session_id=f"s{i}")))[-1]
        first[i] = last.drafter
    assert set(first.values()) == {"oracle@1", "oracle@2"}   # 40 draws at 50/50: both appear
    for i in range(10):  # a follow-up turn sticks to the session's drafter
        last = list(gw.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=9, session_id=f"s{i}")))[-1]
        assert last.drafter == first[i]
    last = list(gw.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=9, session_id="s0",
                                                        drafter="oracle@2")))[-1]
    assert last.drafter == "oracle@2"   # an explicit choice wins
