"""Client API keys at the gateway: missing or wrong keys refused, per-key limits, key = owner."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.auth import ClientAuth, load_api_keys

KEY_A = "key-alice-0123456789abcdef"    # at most one Generate stream at once
KEY_B = "key-bob-0123456789abcdef"
KEY_C = "key-carol-0123456789abcdef"   # one request per 2 s
RPC_TIMEOUT = 60


def bearer(key):
    return [("authorization", f"Bearer {key}")]


@pytest.fixture
def keyed(stack, tokenizer, target_model, tmp_path):
    """A gateway on the stack's verifier that requires API keys; yields its Gateway stub."""
    from gateway.server import build

    path = tmp_path / "keys"
    path.write_text(f"# key name max_concurrency rate_per_s\n{KEY_A} alice 1\n{KEY_B} bob\n"
                    f"{KEY_C} carol 0 0.5\n")
    rt = build(tokenizer, stack.verifier_addr, "127.0.0.1:0", max_positions=target_model.max_positions,
               api_keys=ClientAuth(load_api_keys(path)))
    rt.server.start()
    rt.set_serving(True)
    ch = grpc.insecure_channel(f"127.0.0.1:{rt.port}")
    yield rt, gateway_pb2_grpc.GatewayStub(ch)
    ch.close()
    rt.server.stop(0)


def generate(stub, key, **kw):
    kw.setdefault("prompt", "Hi there")
    kw.setdefault("max_tokens", 4)
    return list(stub.Generate(gateway_pb2.GenerateRequest(**kw), metadata=bearer(key) if key else None,
                              timeout=RPC_TIMEOUT))


@pytest.mark.parametrize("metadata", [None, bearer("not-a-key-0123456789abcdef"),
                                      [("authorization", KEY_A)], [("x-dflash-client", "alice")]])
def test_missing_or_wrong_key_is_refused(keyed, metadata):
    rt, stub = keyed
    calls = [lambda: list(stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=2),
                                        metadata=metadata, timeout=RPC_TIMEOUT)),
             lambda: stub.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="s"),
                                       metadata=metadata, timeout=RPC_TIMEOUT),
             lambda: stub.ListDrafters(gateway_pb2.ListDraftersRequest(), metadata=metadata,
                                       timeout=RPC_TIMEOUT)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ei.value.details().startswith("authorization:")
    # health needs no key; a good key is served
    with grpc.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    assert generate(stub, KEY_B)[-1].usage.completion_tokens == 4


def test_over_its_concurrency_limit_while_another_key_is_served(keyed):
    _, stub = keyed
    # alice holds her one stream open (a long generation, read one response at a time)
    held = stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi there", max_tokens=200),
                         metadata=bearer(KEY_A), timeout=RPC_TIMEOUT)
    next(held)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            generate(stub, KEY_A)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "alice" in ei.value.details()
        assert dict(ei.value.trailing_metadata() or ())["retry-after-ms"] == "200"
        # bob is served meanwhile, with two streams at once
        out, errors = [], []

        def bob():
            try:
                out.append(generate(stub, KEY_B)[-1])
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=bob) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RPC_TIMEOUT)
        assert not errors and [r.usage.completion_tokens for r in out] == [4, 4]
        # alice's unary calls are not stream-limited
        stub.ListDrafters(gateway_pb2.ListDraftersRequest(), metadata=bearer(KEY_A), timeout=RPC_TIMEOUT)
    finally:
        held.cancel()
    # the cancelled stream gave its slot back (bounded wait: the release runs on termination)
    deadline_tries = 50
    for i in range(deadline_tries):
        try:
            assert generate(stub, KEY_A)[-1].usage.completion_tokens == 4
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and i < deadline_tries - 1
            threading.Event().wait(0.1)


def test_over_its_request_rate(keyed):
    _, stub = keyed
    stub.ListDrafters(gateway_pb2.ListDraftersRequest(), metadata=bearer(KEY_C), timeout=RPC_TIMEOUT)
    with pytest.raises(grpc.RpcError) as ei:
        stub.ListDrafters(gateway_pb2.ListDraftersRequest(), metadata=bearer(KEY_C), timeout=RPC_TIMEOUT)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "carol" in ei.value.details()
    wait_ms = int(dict(ei.value.trailing_metadata())["retry-after-ms"])
    assert 0 < wait_ms <= 2000
    # another key is not slowed by carol's bucket
    stub.ListDrafters(gateway_pb2.ListDraftersRequest(), metadata=bearer(KEY_B), timeout=RPC_TIMEOUT)


def test_the_key_owns_its_sessions(keyed):
    _, stub = keyed
    generate(stub, KEY_A, session_id="s1")
    # another key cannot continue or close it, whatever x-dflash-client it claims
    for call in (lambda md: list(stub.Generate(gateway_pb2.GenerateRequest(
                     prompt="Hi", max_tokens=2, session_id="s1"), metadata=md, timeout=RPC_TIMEOUT)),
                 lambda md: stub.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="s1"),
                                              metadata=md, timeout=RPC_TIMEOUT)):
        with pytest.raises(grpc.RpcError) as ei:
            call(bearer(KEY_B) + [("x-dflash-client", "alice")])
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stub.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id="s1"),
                             metadata=bearer(KEY_A), timeout=RPC_TIMEOUT).existed


@pytest.mark.parametrize("text,field", [
    ("short\n", "line 1: key"), ("key-0123456789abcdef a x\n", "line 1: max_concurrency"),
    ("# c\nkey-0123456789abcdef a 1 -2\n", "line 2: rate_per_s"),
    ("key-0123456789abcdef a\nkey-0123456789abcdef b\n", "line 2: key"),
    ("key-0123456789abcdef a\nkey-0123456789abcdeg a\n", "line 2: name"),
    ("key-0123456789abcdef a 1 2 3\n", "line 1: expected"), ("# only comments\n", "holds no key")])
def test_keys_file_errors_name_the_line_and_field(tmp_path, text, field):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="--api-keys-file") as ei:
        load_api_keys(path)
    assert field in str(ei.value)


def test_keys_file_defaults(tmp_path):
    path = tmp_path / "keys"
    path.write_text("key-0123456789abcdef   # a comment\n")
    (k,) = load_api_keys(path).values()
    assert k.name.startswith("sha256:") and (k.max_concurrency, k.rate_per_s) == (0, 0.0)
    with pytest.raises(ValueError, match="--api-keys-file: cannot read"):
        load_api_keys(tmp_path / "absent")


def test_each_key_is_its_own_suffix_tenant(keyed, stack):
    """The gateway names the key's owner as the verifier request's tenant: each key's answers
    become suffix candidates for that key's later requests only."""
    _, stub = keyed
    out = {}
    for key, name in ((KEY_A, "alice"), (KEY_B, "bob")):
        msgs = generate(stub, key, prompt=f"Hello from {name}", max_tokens=6)
        out[name] = [t for m in msgs for t in m.token_ids]
    store = stack.engine.answers
    for name in ("alice", "bob"):
        held = store.indexes(f"key:{name}")
        assert [ix.tokens for ix in held] == [out[name]], name
    assert store.indexes("") == []            # nothing under the anonymous tenant
