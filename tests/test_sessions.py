"""Sessions across turns (KV reuse), closing and expiry, and server reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dflash.v1 import gateway_pb2
from drafter_svc.engine import DrafterEngine

from helpers import wait_until


def turn(gw, text, session_id, **kw):
    resps = list(gw.Generate(gateway_pb2.GenerateRequest(prompt=text, max_tokens=12,
                                                         session_id=session_id, **kw)))
    return "".join(r.text for r in resps), resps[-1]


def test_follow_up_turn_reuses_the_shared_prefix(stack, make_drafter, tiny_target):
    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target))
    gw = stack.gateway_stub()
    first, last1 = turn(gw, "Hello there", "chat-1")
    assert last1.usage.cached_prompt_tokens == 0
    follow = "Hello there" + first + " and then?"
    text2, last2 = turn(gw, follow, "chat-1")
    # Every token of turn 1 that is still a prefix of turn 2's prompt is reused.
    assert last2.usage.cached_prompt_tokens >= len("Hello there")
    assert last2.usage.cached_prompt_tokens < last2.usage.prompt_tokens
    fresh, last3 = turn(gw, follow, "")   # the same prompt without the session: same output
    assert text2 == fresh and last3.usage.cached_prompt_tokens == 0
    assert stack.engine.num_sessions == 1   # one-shot requests leave nothing behind


def test_close_session_frees_verifier_and_drafter_state(stack, make_drafter, tiny_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    stack.add_drafter(engine)
    gw = stack.gateway_stub()
    turn(gw, "Hi", "to-close")
    assert stack.engine.num_sessions == 1 and engine.num_sessions == 1
    r = gw.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="to-close"))
    assert r.existed
    assert stack.engine.num_sessions == 0
    # the release travels on the draft stream
    wait_until(lambda: engine.num_sessions == 0, 5, "the drafter to release the closed session")
    assert not gw.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="to-close")).existed


def test_idle_sessions_expire(stack):
    gw = stack.gateway_stub()
    turn(gw, "Hi", "idle", speculation=False)
    assert stack.engine.num_sessions == 1
    assert stack.engine.expire_sessions(now=10 ** 9) == 1   # far in the future: past any TTL
    assert stack.engine.num_sessions == 0


@pytest.mark.parametrize("which", ["gateway", "verifier"])
def test_reflection_lists_the_services(stack, which):
    addr = stack.gateway_addr if which == "gateway" else stack.verifier_addr
    with grpc.insecure_channel(addr) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    want = {"gateway": {"dflash.v1.Gateway"}, "verifier": {"dflash.v1.Verifier"}}[which]
    assert want <= names and "grpc.health.v1.Health" in names
    # the admin plane is never on a client's port (issue #24): it has its own server
    assert "dflash.v1.GatewayAdmin" not in names
    if which == "gateway":
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.admin.port}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert "dflash.v1.GatewayAdmin" in {s.name for s in resp.list_services_response.service}


def test_a_session_is_its_owners_on_every_gateway_in_front_of_one_verifier(stack, tokenizer,
                                                                             target_model):
    """Two gateway replicas share one verifier (the Kubernetes layout). Each knows only the
    sessions it served, so ownership rides in the verifier's session id: Bob, reaching the other
    replica with Alice's session id, gets a session of his own; he can neither continue nor
    close hers, and Alice continues hers through either replica."""
    from dflash.v1 import gateway_pb2_grpc
    from gateway.server import build as build_gateway

    other = build_gateway(tokenizer, stack.verifier_addr, "127.0.0.1:0",
                          max_positions=target_model.max_positions)
    other.server.start()
    other.set_serving(True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{other.port}") as ch:
            gw_a, gw_b = stack.gateway_stub(), gateway_pb2_grpc.GatewayStub(ch)
            alice, bob = [("x-dflash-client", "alice")], [("x-dflash-client", "bob")]

            def say(gw, text, who):
                return list(gw.Generate(gateway_pb2.GenerateRequest(
                    prompt=text, max_tokens=8, session_id="xg1"), metadata=who))[-1]

            say(gw_a, "Hello there", alice)
            assert stack.engine.num_sessions == 1
            last = say(gw_b, "Hello there, again", bob)     # not Alice's cache: a new session
            assert last.usage.cached_prompt_tokens == 0 and stack.engine.num_sessions == 2
            closed = gw_b.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="xg1"),
                                       metadata=bob)
            assert closed.existed and stack.engine.num_sessions == 1   # Bob's own, not Alice's
            last = say(gw_b, "Hello there, and more", alice)          # Alice, other replica
            assert last.usage.cached_prompt_tokens >= len("Hello there")
            # on the replica that served her, Bob is refused outright
            with pytest.raises(grpc.RpcError) as e:
                say(gw_a, "Hello", bob)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        other.server.stop(0)
