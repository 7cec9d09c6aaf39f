"""The hostile-drafter scenario: a client cannot register a drafter or point the verifier at one.

The admin plane is a server of its own (never the client port), needs its token when one is
set, refuses addresses outside ``--drafter-allow``, and the verifier speculates only with
addresses that passed its CheckDrafter: a drafter nobody registered receives no context
features, even from a client that reaches the verifier directly. /metrics binds loopback.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from dflash.serving.telemetry import serve_metrics
from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from gateway.registry import DrafterAllowlist

from doubles import ReferenceDrafter
from helpers import generate_ids

TOKEN = "s3cret-admin-token-0123456789"
RPC_TIMEOUT = 30


class CountingDrafter(ReferenceDrafter):
    """An oracle that counts the context feature rows it is sent (the hostile listener)."""

    def __init__(self, target, refs, **kw):
        super().__init__(target, refs, block_size=4, **kw)
        self.feature_rows = 0
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        self.feature_rows += sum(int(r.context.shape[0]) for r in requests)
        return super().propose(requests)


def serve(engine):
    from drafter_svc.server import build as build_drafter

    rt = build_drafter(engine, "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    return rt, f"127.0.0.1:{rt.port}"


def gateway(stack, tokenizer, target_model, **kw):
    from gateway.server import build

    rt = build(tokenizer, stack.verifier_addr, "127.0.0.1:0",
               max_positions=target_model.max_positions, **kw)
    rt.server.start()
    rt.set_serving(True)
    return rt


def admin_stub(stack, port):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stack._channels.append(ch)
    return gateway_pb2_grpc.GatewayAdminStub(ch)


def code_of(call, *args, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        call(*args, timeout=RPC_TIMEOUT, **kw)
    return ei.value


@pytest.fixture
def hostile(stack, target_model):
    """A counting drafter nobody registered, and the verifier refusing unregistered drafters."""
    rt, addr = serve(CountingDrafter(target_model, {}))
    stack.drafters.append(rt)
    stack.verifier.servicer.require_registered = True
    return rt, addr


def test_admin_is_not_on_the_client_port(stack, hostile):
    _, addr = hostile
    on_client = admin_stub(stack, stack.gateway.port)
    for call, req in [(on_client.RegisterDrafter, gateway_pb2.RegisterDrafterRequest(address=addr)),
                      (on_client.SetDrafterWeights, gateway_pb2.SetDrafterWeightsRequest()),
                      (on_client.ListDrafters, gateway_pb2.ListDraftersRequest())]:
        assert code_of(call, req).code() == grpc.StatusCode.UNIMPLEMENTED
    assert stack.gateway.servicer.registry.entries() == []
    # the admin server is another port, on loopback, and does work there
    assert stack.gateway.admin.port != stack.gateway.port
    listed = admin_stub(stack, stack.gateway.admin.port).ListDrafters(
        gateway_pb2.ListDraftersRequest(), timeout=RPC_TIMEOUT)
    assert list(listed.drafters) == []


def test_admin_requires_its_token(stack, tokenizer, target_model, hostile):
    drafter_rt, addr = hostile
    gw = gateway(stack, tokenizer, target_model, admin_token=TOKEN)
    try:
        admin = admin_stub(stack, gw.admin.port)
        req = gateway_pb2.RegisterDrafterRequest(address=addr)
        for md in [None, [("authorization", "Bearer wrong-token-0123456789")],
                   [("authorization", TOKEN)], [("authorization", "Basic " + TOKEN)]]:
            err = code_of(admin.RegisterDrafter, req, metadata=md)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (md, err.details())
            assert "authorization:" in err.details()
        err = code_of(admin.SetDrafterWeights,
                      gateway_pb2.SetDrafterWeightsRequest(weights={"oracle@1": 1.0}))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert gw.servicer.registry.entries() == []
        assert drafter_rt.servicer.engine.calls == 0
        assert addr not in stack.verifier.servicer.registered_drafters()
        # health needs no token (probes); the right token works
        with grpc.insecure_channel(f"127.0.0.1:{gw.admin.port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        e = admin.RegisterDrafter(req, metadata=[("authorization", f"Bearer {TOKEN}")],
                                  timeout=RPC_TIMEOUT)
        assert e.address == addr and addr in stack.verifier.servicer.registered_drafters()
    finally:
        gw.server.stop(0)


def test_admin_without_token_binds_loopback_only(stack, tokenizer, target_model):
    with pytest.raises(ValueError, match="--admin-bind"):
        gateway(stack, tokenizer, target_model, admin_bind="0.0.0.0:0")
    from gateway.server import main, parse_args

    with pytest.raises(SystemExit, match="--admin-bind"):
        main(["--target", "t", "--admin-bind", "0.0.0.0:50060"])
    assert parse_args(["--target", "t"]).admin_bind == "127.0.0.1:50060"


def test_drafter_allowlist_refuses_naming_the_field(stack, tokenizer, target_model, hostile):
    drafter_rt, addr = hostile
    good_rt, good = serve(ReferenceDrafter(target_model, {}, block_size=4, name="good"))
    stack.drafters.append(good_rt)
    gw = gateway(stack, tokenizer, target_model, drafter_allow=DrafterAllowlist.parse(good))
    try:
        admin = admin_stub(stack, gw.admin.port)
        err = code_of(admin.RegisterDrafter, gateway_pb2.RegisterDrafterRequest(address=addr))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.details().startswith("address:") and "--drafter-allow" in err.details()
        # refused before anything contacted it: not even the verifier's Describe call
        assert addr not in stack.verifier.servicer.registered_drafters()
        assert drafter_rt.servicer.engine.calls == 0
        e = admin.RegisterDrafter(gateway_pb2.RegisterDrafterRequest(address=good), timeout=RPC_TIMEOUT)
        assert (e.name, e.address) == ("good", good)
    finally:
        gw.server.stop(0)


@pytest.mark.parametrize("text,address,allowed", [
    ("10.0.0.0/8", "10.1.2.3:50061", True), ("10.0.0.0/8", "11.1.2.3:50061", False),
    ("10.0.0.0/8", "ten.example:50061", False),          # a name never matches a CIDR entry
    ("drafter-v1", "drafter-v1:50061", True), ("drafter-v1:50061", "drafter-v1:50062", False),
    ("drafter-v1:50061", "Drafter-V1:50061", True), ("fd00::/8", "[fd00::1]:5", True),
    ("127.0.0.1:1", "127.0.0.1:1:2", False)])
def test_allowlist_entries(text, address, allowed):
    assert DrafterAllowlist.parse(text).allows(address) is allowed


@pytest.mark.parametrize("text", ["", "10.0.0.0/33", "host:0", "host:x"])
def test_allowlist_refuses_malformed_entries(text):
    with pytest.raises(ValueError, match="--drafter-allow"):
        DrafterAllowlist.parse(text)


def test_unregistered_drafter_receives_no_features(stack, target_model, hostile):
    drafter_rt, addr = hostile
    counting = drafter_rt.servicer.engine
    v = stack.verifier_stub()
    spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr)
    with pytest.raises(grpc.RpcError) as ei:
        generate_ids(v, [1, 2, 3, 4], max_tokens=6, speculation=spec)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ei.value.details().startswith("speculation.drafter_address:")
    assert counting.calls == 0 and counting.feature_rows == 0
    # Control: once registered through the admin plane, the same drafter is sent features.
    admin_stub(stack, stack.gateway.admin.port).RegisterDrafter(
        gateway_pb2.RegisterDrafterRequest(address=addr), timeout=RPC_TIMEOUT)
    ids, last = generate_ids(v, [1, 2, 3, 4], max_tokens=6, speculation=spec)
    assert len(ids) == 6 and counting.feature_rows > 0


def test_restarted_verifier_learns_the_drafters_again(stack, target_model, hostile):
    from gateway.server import reregister_drafters

    _, addr = hostile
    admin_stub(stack, stack.gateway.admin.port).RegisterDrafter(
        gateway_pb2.RegisterDrafterRequest(address=addr), timeout=RPC_TIMEOUT)
    stack.verifier.servicer._registered.clear()       # what a verifier restart forgets
    assert reregister_drafters(stack.gateway.servicer.registry, stack.gateway.servicer.verifier) == 1
    assert stack.verifier.servicer.registered_drafters() == {addr}


def test_metrics_bind_loopback_unless_asked(monkeypatch):
    monkeypatch.delenv("DFLASH_METRICS_HOST", raising=False)
    monkeypatch.delenv("DFLASH_METRICS_ADDR", raising=False)
    server = serve_metrics(CollectorRegistry(), 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        server.shutdown()
    monkeypatch.setenv("DFLASH_METRICS_HOST", "0.0.0.0")
    server = serve_metrics(CollectorRegistry(), 0)
    try:
        assert server.server_address[0] == "0.0.0.0"
    finally:
        server.shutdown()
