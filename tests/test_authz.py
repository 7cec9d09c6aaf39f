"""Per-RPC authorization by service identity on the mTLS ports (dflash/serving/authz.py) and
session ownership on the internal session RPCs (dflash/serving/owners.py).

The tiny stack runs with the certificates ``dflash certs`` makes (make_dev_certs): a client's
certificate, signed by the same CA as the services', is refused on the verifier, the drafter and
the admin plane, RPC by RPC, with PERMISSION_DENIED naming the role needed; the gateway's, the
verifier's and the admin's still work where they belong. The issue's probes: X1 (CheckDrafter
dialing an address of the caller's choosing), X2 (a Draft stream releasing another session's
context), X3 (CloseSession of another's session).
"""

from __future__ import annotations

import queue
from concurrent import futures

import grpc
import pytest
import torch

from dflash.core import wire
from dflash.serving.authz import DEFAULT_TRUST_DOMAIN, AuthzConfigError, PeerIds, RoleAuthz, spiffe_id
from dflash.serving.tls import ClientTLS, Issued, ServerTLS, TLSFiles, channel, issue, make_dev_certs, new_ca
from dflash.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

HOSTS = ["localhost", "127.0.0.1"]
DENIED = grpc.StatusCode.PERMISSION_DENIED


# ------------------------------------------------------------------ the tables
@pytest.mark.parametrize("module, service, role", [
    ("verifier_svc.server", "Verifier", "gateway"),
    ("drafter_svc.server", "Drafter", "verifier"),
])
def test_every_internal_rpc_has_its_role(module, service, role):
    import importlib

    from dflash.v1 import drafter_pb2 as d, verifier_pb2 as v

    desc = (v if service == "Verifier" else d).DESCRIPTOR.services_by_name[service]
    table = importlib.import_module(module).AUTHZ
    assert table == {f"/{desc.full_name}/{m.name}": role for m in desc.methods}


def test_every_admin_rpc_needs_the_admin_role():
    from gateway.server import ADMIN_AUTHZ

    desc = gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"]
    assert ADMIN_AUTHZ == {f"/{desc.full_name}/{m.name}": "admin" for m in desc.methods}


def test_peer_ids_defaults_overrides_and_errors():
    ids = PeerIds.parse("prod.example", "gateway=spiffe://prod.example/ns/llm/sa/gw,"
                                        "gateway=spiffe://prod.example/ns/llm/sa/gw2")
    assert ids.ids["verifier"] == {"spiffe://prod.example/dflash/verifier"}
    assert ids.ids["gateway"] == {"spiffe://prod.example/ns/llm/sa/gw",
                                  "spiffe://prod.example/ns/llm/sa/gw2"}
    assert ids.roles_of(["spiffe://prod.example/ns/llm/sa/gw2"]) == {"gateway"}
    assert ids.roles_of(["spiffe://prod.example/dflash/gateway"]) == set()   # replaced
    with pytest.raises(AuthzConfigError, match="--tls-peer-ids: 'root=x:y'"):
        PeerIds.parse(overrides="root=x:y")
    with pytest.raises(AuthzConfigError, match="--tls-peer-ids: gateway: 'not a uri'"):
        PeerIds.parse(overrides="gateway=not a uri")
    with pytest.raises(AuthzConfigError, match="--tls-trust-domain"):
        spiffe_id("Has Spaces", "client")


class _Ctx:
    def __init__(self, pem: bytes | None):
        self._pem = pem
        self.aborted = None

    def auth_context(self):
        return {"x509_pem_cert": [self._pem]} if self._pem else {}

    def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.RpcError(details)


def test_a_server_only_certificate_is_no_client_identity():
    ca = new_ca()
    uri = spiffe_id(DEFAULT_TRUST_DOMAIN, "gateway")
    authz = RoleAuthz({"/x.S/M": "gateway"}, PeerIds.parse())
    for cert, ok in ((issue(ca, "g", HOSTS, uri=uri), True),
                     (issue(ca, "g", HOSTS, uri=uri, client=False), False),
                     (None, False)):
        ctx = _Ctx(cert.cert if cert else None)
        if ok:
            authz._check("/x.S/M", "gateway", ctx)
            continue
        with pytest.raises(grpc.RpcError):
            authz._check("/x.S/M", "gateway", ctx)
        assert ctx.aborted[0] == DENIED and "needs the gateway role" in ctx.aborted[1]
    with pytest.raises(grpc.RpcError):     # an RPC missing from the table: nobody
        authz._check("/x.S/Other", None, _Ctx(issue(ca, "g", HOSTS, uri=uri).cert))


def test_dev_certificates_carry_roles_and_usages(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID as EKU

    paths = make_dev_certs(tmp_path, HOSTS, trust_domain="test.example")
    want = {"gateway": {EKU.SERVER_AUTH, EKU.CLIENT_AUTH}, "verifier": {EKU.SERVER_AUTH, EKU.CLIENT_AUTH},
            "drafter": {EKU.SERVER_AUTH}, "client": {EKU.CLIENT_AUTH}, "admin": {EKU.CLIENT_AUTH}}
    for role, usages in want.items():
        cert = x509.load_pem_x509_certificate(paths[role][0].read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://test.example/dflash/{role}"]
        assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
        assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign


# ------------------------------------------------------------------ the stack under mTLS
class Certs:
    def __init__(self, d):
        self.dir = d
        self.paths = make_dev_certs(d, HOSTS)
        self.ca = self.paths["ca"][0].read_bytes()
        self.ca_issued = Issued(self.ca, self.paths["ca"][1].read_bytes())

    def files(self, role) -> TLSFiles:
        cert, key = self.paths[role]
        return TLSFiles(str(cert), str(key), str(self.paths["ca"][0]))

    def client(self, role) -> ClientTLS:
        tls = ClientTLS.from_files(self.files(role))
        assert tls is not None
        return tls

    def extra(self, name: str, uri: str) -> ClientTLS:
        """Another certificate of this CA with its own identity (an operator's own ID)."""
        mine = issue(self.ca_issued, name, HOSTS, uri=uri)
        return ClientTLS(ca=self.ca, cert=mine.cert, key=mine.key)


class TLSStack:
    """drafter <-mTLS- verifier <-mTLS- gateway, each with its own role certificate."""

    def __init__(self, certs: Certs, target_model, tokenizer, drafter_dir, tiny_target,
                 verifier_ids: PeerIds | None = None, drafter_ids: PeerIds | None = None):
        from drafter_svc.engine import DrafterEngine
        from drafter_svc.server import build as build_drafter
        from gateway.server import build as build_gateway, register_drafter
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.server import build as build_verifier

        self.certs = certs
        self.drafter_engine = DrafterEngine.from_pretrained(drafter_dir, tiny_target)
        self.drafter = build_drafter(self.drafter_engine, "127.0.0.1:0",
                                     tls=ServerTLS(certs.files("drafter"), drafter_ids))
        self.engine = VerifierEngine(target_model, spec_mode="fixed")
        self.verifier = build_verifier(self.engine, "127.0.0.1:0",
                                       tls=ServerTLS(certs.files("verifier"), verifier_ids),
                                       upstream_tls=certs.client("verifier"))
        self.gateway = build_gateway(tokenizer, f"localhost:{self.verifier.port}", "127.0.0.1:0",
                                     max_positions=target_model.max_positions,
                                     tls=ServerTLS(certs.files("gateway")),
                                     upstream_tls=certs.client("gateway"))
        self.rts = [self.drafter, self.verifier, self.gateway]
        for rt in self.rts:
            rt.server.start()
            rt.set_serving(True)
        self.drafter_addr = f"localhost:{self.drafter.port}"
        register_drafter(self.gateway.servicer.registry, self.gateway.servicer.verifier,
                         self.drafter_addr, default=True, timeout_s=10)
        self._channels: list[grpc.Channel] = []

    def _ch(self, port: int, tls: ClientTLS) -> grpc.Channel:
        ch = channel(f"127.0.0.1:{port}", tls)
        self._channels.append(ch)
        return ch

    def verifier_stub(self, tls: ClientTLS):
        return verifier_pb2_grpc.VerifierStub(self._ch(self.verifier.port, tls))

    def drafter_stub(self, tls: ClientTLS):
        return drafter_pb2_grpc.DrafterStub(self._ch(self.drafter.port, tls))

    def admin_stub(self, tls: ClientTLS):
        return gateway_pb2_grpc.GatewayAdminStub(self._ch(self.gateway.admin.port, tls))

    def gateway_stub(self, tls: ClientTLS):
        return gateway_pb2_grpc.GatewayStub(self._ch(self.gateway.port, tls))

    def close(self):
        for ch in self._channels:
            ch.close()
        for rt in self.rts:
            rt.server.stop(0)
        if self.verifier.servicer.pool:
            self.verifier.servicer.pool.close()
        self.engine.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_stack(certs, target_model, tokenizer, make_drafter, tiny_target):
    s = TLSStack(certs, target_model, tokenizer, make_drafter(block_size=4), tiny_target)
    yield s
    s.close()


def _denied(call, role: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        out = call()
        if hasattr(out, "__next__"):
            list(out)       # a stream: the refusal arrives with its first message
    assert e.value.code() == DENIED, e.value
    assert f"needs the {role} role" in e.value.details(), e.value.details()
    return e.value


def _gen(prompt=(5, 6, 7), **kw) -> verifier_pb2.VerifierGenerateRequest:
    return verifier_pb2.VerifierGenerateRequest(prompt_token_ids=list(prompt), max_tokens=4,
                                                sampling=common_pb2.SamplingParams(), **kw)


def _verifier_calls(stub):
    return {
        "Describe": lambda: stub.Describe(verifier_pb2.DescribeTargetRequest(), timeout=10),
        "Generate": lambda: stub.Generate(_gen(), timeout=30),
        "CheckDrafter": lambda: stub.CheckDrafter(
            verifier_pb2.CheckDrafterRequest(address="127.0.0.1:1"), timeout=10),
        "CloseSession": lambda: stub.CloseSession(
            verifier_pb2.CloseSessionRequest(session_id="s"), timeout=10),
    }


@pytest.mark.parametrize("rpc", ["Describe", "Generate", "CheckDrafter", "CloseSession"])
@pytest.mark.parametrize("role", ["client", "admin", "verifier"])
def test_verifier_rpcs_refuse_every_role_but_the_gateway(tls_stack, certs, rpc, role):
    stub = tls_stack.verifier_stub(certs.client(role))
    e = _denied(_verifier_calls(stub)[rpc], "gateway")
    assert "spiffe://dflash.local/dflash/gateway" in e.details()
    assert f"spiffe://dflash.local/dflash/{role}" in e.details()


def test_a_server_only_certificate_cannot_call_at_all(tls_stack, certs):
    """The drafter's certificate is for server authentication only: the TLS handshake itself
    refuses it as a client's (its extended key usage)."""
    for stub in (tls_stack.verifier_stub(certs.client("drafter")),
                 tls_stack.drafter_stub(certs.client("drafter"))):
        with pytest.raises(grpc.RpcError) as e:
            stub.Describe(verifier_pb2.DescribeTargetRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_verifier_rpcs_work_with_the_gateway_certificate(tls_stack, certs):
    calls = _verifier_calls(tls_stack.verifier_stub(certs.client("gateway")))
    assert calls["Describe"]().vocab_size > 0
    assert len([t for c in calls["Generate"]() for t in c.token_ids]) == 4
    assert not calls["CloseSession"]().existed
    with pytest.raises(grpc.RpcError) as e:        # authorized: the drafter check itself fails
        calls["CheckDrafter"]()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_x1_check_drafter_never_dials_for_a_client(tls_stack, certs):
    """A client certificate cannot make the verifier dial (and register) an address."""
    dialed = []

    class Rogue(drafter_pb2_grpc.DrafterServicer):
        def Describe(self, request, context):
            dialed.append(1)
            context.abort(grpc.StatusCode.UNAVAILABLE, "rogue")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    drafter_pb2_grpc.add_DrafterServicer_to_server(Rogue(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = tls_stack.verifier_stub(certs.client("client"))
        _denied(lambda: stub.CheckDrafter(verifier_pb2.CheckDrafterRequest(
            address=f"127.0.0.1:{port}"), timeout=10), "gateway")
        assert dialed == []
        assert f"127.0.0.1:{port}" not in tls_stack.verifier.servicer.registered_drafters()
    finally:
        server.stop(0)


def _draft_calls(stub):
    def draft(release=(), items=()):
        return list(stub.Draft(iter([drafter_pb2.DraftBatch(
            batch_id=1, release_sessions=list(release), items=list(items))]), timeout=10))
    return {"Describe": lambda: stub.Describe(drafter_pb2.DescribeDrafterRequest(), timeout=10),
            "Draft": lambda: draft(release=["s"])}


@pytest.mark.parametrize("rpc", ["Describe", "Draft"])
@pytest.mark.parametrize("role", ["client", "gateway", "admin"])
def test_drafter_rpcs_refuse_every_role_but_the_verifier(tls_stack, certs, rpc, role):
    _denied(_draft_calls(tls_stack.drafter_stub(certs.client(role)))[rpc], "verifier")


def test_drafter_rpcs_work_with_the_verifier_certificate(tls_stack, certs):
    calls = _draft_calls(tls_stack.drafter_stub(certs.client("verifier")))
    assert calls["Describe"]().block_size == 4
    assert [r.batch_id for r in calls["Draft"]()] == [1]


def _admin_calls(stub):
    ref = gateway_pb2.DrafterRef(drafter="nobody@1")
    return {
        "RegisterDrafter": lambda: stub.RegisterDrafter(
            gateway_pb2.RegisterDrafterRequest(address="127.0.0.1:1"), timeout=10),
        "DeregisterDrafter": lambda: stub.DeregisterDrafter(ref, timeout=10),
        "SetDefaultDrafter": lambda: stub.SetDefaultDrafter(ref, timeout=10),
        "SetDrafterWeights": lambda: stub.SetDrafterWeights(
            gateway_pb2.SetDrafterWeightsRequest(weights={"nobody@1": 1.0}), timeout=10),
        "ListDrafters": lambda: stub.ListDrafters(gateway_pb2.ListDraftersRequest(), timeout=10),
    }


@pytest.mark.parametrize("rpc", ["RegisterDrafter", "DeregisterDrafter", "SetDefaultDrafter",
                                 "SetDrafterWeights", "ListDrafters"])
@pytest.mark.parametrize("role", ["client", "gateway", "verifier"])
def test_admin_rpcs_refuse_every_role_but_the_admin(tls_stack, certs, rpc, role):
    _denied(_admin_calls(tls_stack.admin_stub(certs.client(role)))[rpc], "admin")


def test_admin_rpcs_work_with_the_admin_certificate(tls_stack, certs):
    calls = _admin_calls(tls_stack.admin_stub(certs.client("admin")))
    assert [d.address for d in calls["ListDrafters"]().drafters] == [tls_stack.drafter_addr]
    with pytest.raises(grpc.RpcError) as e:        # authorized: the drafter itself is unknown
        calls["SetDefaultDrafter"]()
    assert e.value.code() != DENIED


def test_the_client_port_takes_any_certificate_of_the_ca(tls_stack, certs):
    for role in ("client", "admin", "gateway"):
        stub = tls_stack.gateway_stub(certs.client(role))
        assert stub.ListDrafters(gateway_pb2.ListDraftersRequest(), timeout=10).drafters


def _session_turn(tls_stack, certs, sid: str, prompt: str = "Hello there"):
    stub = tls_stack.gateway_stub(certs.client("client"))
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=6, session_id=sid)
    return [r for r in stub.Generate(req, timeout=60)][-1]


def test_x2_x3_a_client_certificate_leaves_other_sessions_intact(tls_stack, certs):
    """X2: a Draft stream releasing the victim's drafter context; X3: the verifier's
    CloseSession of the victim's session. Both refused; the victim's next turn is cached and
    speculative."""
    first = _session_turn(tls_stack, certs, "victim")
    assert first.acceptance.drafts > 0
    held = tls_stack.drafter_engine.num_sessions
    assert held >= 1
    sid = next(s.id for s in tls_stack.engine._sessions.values() if s.id.endswith(":victim"))
    draft = _draft_calls(tls_stack.drafter_stub(certs.client("client")))
    _denied(lambda: list(tls_stack.drafter_stub(certs.client("client")).Draft(iter([
        drafter_pb2.DraftBatch(batch_id=7, release_sessions=[sid])]), timeout=10)), "verifier")
    _denied(draft["Describe"], "verifier")
    v = tls_stack.verifier_stub(certs.client("client"))
    _denied(lambda: v.CloseSession(verifier_pb2.CloseSessionRequest(session_id=sid), timeout=10),
            "gateway")
    assert tls_stack.drafter_engine.num_sessions == held
    again = _session_turn(tls_stack, certs, "victim", "Hello there, again")
    assert again.usage.cached_prompt_tokens > 0 and again.acceptance.drafts > 0


# ------------------------------------------------------------------ ownership, operator IDs
GW_A, GW_B = "spiffe://ops.example/ns/llm/sa/gateway-a", "spiffe://ops.example/ns/llm/sa/gateway-b"
VER_A, VER_B = "spiffe://ops.example/ns/llm/sa/verifier-a", "spiffe://ops.example/ns/llm/sa/verifier-b"


@pytest.fixture(scope="module")
def ops_stack(certs, target_model, tokenizer, make_drafter, tiny_target):
    """The operator's own SPIFFE IDs (--tls-peer-ids): two gateway and two verifier identities;
    the stack's own gateway and verifier keep theirs too."""
    own = lambda r: spiffe_id(DEFAULT_TRUST_DOMAIN, r)   # noqa: E731
    s = TLSStack(certs, target_model, tokenizer, make_drafter(block_size=4), tiny_target,
                 verifier_ids=PeerIds.parse(overrides=f"gateway={GW_A},gateway={GW_B},"
                                                      f"gateway={own('gateway')}"),
                 drafter_ids=PeerIds.parse(overrides=f"verifier={VER_A},verifier={VER_B},"
                                                     f"verifier={own('verifier')}"))
    yield s
    s.close()


def test_operator_ids_replace_the_default(ops_stack, certs):
    stub = ops_stack.verifier_stub(certs.extra("gw-a", GW_A))
    assert stub.Describe(verifier_pb2.DescribeTargetRequest(), timeout=10).vocab_size > 0
    other = ops_stack.verifier_stub(certs.extra("gw-x", "spiffe://ops.example/ns/llm/sa/other"))
    e = _denied(lambda: other.Describe(verifier_pb2.DescribeTargetRequest(), timeout=10), "gateway")
    assert GW_A in e.details() and GW_B in e.details()


def test_operator_ca_and_id(target_model, tmp_path):
    """A CA of the operator's (not dflash certs'), with its own trust domain and IDs."""
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import build

    ca = new_ca("operator CA")
    srv = issue(ca, "verifier", HOSTS, uri="spiffe://corp.example/verifier")
    for name, data in (("srv.pem", srv.cert), ("srv-key.pem", srv.key), ("ca.pem", ca.cert)):
        (tmp_path / name).write_bytes(data)
    files = TLSFiles(str(tmp_path / "srv.pem"), str(tmp_path / "srv-key.pem"), str(tmp_path / "ca.pem"))
    engine = VerifierEngine(target_model)
    rt = build(engine, "127.0.0.1:0", tls=ServerTLS(files, PeerIds.parse("corp.example")))
    rt.server.start()
    rt.set_serving(True)
    try:
        def describe(uri):
            me = issue(ca, "caller", HOSTS, uri=uri)
            with channel(f"127.0.0.1:{rt.port}", ClientTLS(ca=ca.cert, cert=me.cert, key=me.key)) as ch:
                return verifier_pb2_grpc.VerifierStub(ch).Describe(
                    verifier_pb2.DescribeTargetRequest(), timeout=10)
        assert describe("spiffe://corp.example/dflash/gateway").vocab_size > 0
        _denied(lambda: describe("spiffe://corp.example/dflash/client"), "gateway")
        _denied(lambda: describe("spiffe://dflash.local/dflash/gateway"), "gateway")  # other domain
    finally:
        rt.server.stop(0)
        engine.close()


def test_verifier_session_belongs_to_the_gateway_identity_that_opened_it(ops_stack, certs):
    a = ops_stack.verifier_stub(certs.extra("gw-a", GW_A))
    b = ops_stack.verifier_stub(certs.extra("gw-b", GW_B))
    list(a.Generate(_gen(session_id="own-1"), timeout=30))
    for call in (lambda: list(b.Generate(_gen(session_id="own-1"), timeout=30)),
                 lambda: b.CloseSession(verifier_pb2.CloseSessionRequest(session_id="own-1"),
                                        timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == DENIED and e.value.details().startswith("session_id:")
    last = list(a.Generate(_gen(prompt=(5, 6, 7, 8), session_id="own-1"), timeout=30))[-1]
    assert last.cached_prompt_tokens > 0                  # intact
    assert a.CloseSession(verifier_pb2.CloseSessionRequest(session_id="own-1"), timeout=10).existed


def _item(sid: str, n: int, start: int = 0, hidden: int = 0) -> drafter_pb2.DraftItem:
    ctx = torch.zeros(n, hidden)
    return drafter_pb2.DraftItem(session_id=sid, context_start=start, context=wire.to_proto(ctx),
                                 anchor_token=5, block_size=4,
                                 sampling=common_pb2.SamplingParams())


def test_drafter_session_belongs_to_the_verifier_identity_that_sent_it(ops_stack, certs):
    eng = ops_stack.drafter_engine
    width = len(eng.card.target_layer_ids) * eng.card.hidden_size
    a = ops_stack.drafter_stub(certs.extra("ver-a", VER_A))
    b = ops_stack.drafter_stub(certs.extra("ver-b", VER_B))
    before = eng.num_sessions
    # A keeps its stream open (its sessions are released when it ends) while B tries.
    q: queue.Queue = queue.Queue()
    a_results = a.Draft(iter(q.get, None), timeout=30)
    q.put(drafter_pb2.DraftBatch(batch_id=1, items=[_item("mine", 3, hidden=width)]))
    first = next(a_results)
    assert first.results[0].tokens and eng.num_sessions == before + 1
    out = list(b.Draft(iter([drafter_pb2.DraftBatch(batch_id=2, release_sessions=["mine"]),
                             drafter_pb2.DraftBatch(batch_id=3, items=[
                                 _item("mine", 1, start=3, hidden=width)])]), timeout=10))
    assert eng.num_sessions == before + 1                # B's release was ignored
    assert "session_id: belongs to another caller" in out[1].results[0].error, out[1]
    q.put(drafter_pb2.DraftBatch(batch_id=4, items=[_item("mine", 1, start=3, hidden=width)]))
    assert next(a_results).results[0].tokens             # A's context is intact: no gap
    q.put(None)
    assert list(a_results) == []
    assert eng.num_sessions == before                    # A's stream ended: released


def test_plaintext_ports_are_not_checked(stack):
    """Without mTLS there is no identity: every RPC is served as before (local development)."""
    stub = stack.verifier_stub()
    assert stub.Describe(verifier_pb2.DescribeTargetRequest(), timeout=10).vocab_size > 0
    assert not stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id="x"), timeout=10).existed


def test_identity_flags_and_their_errors(tmp_path, capsys):
    from dflash.serving.server import server_tls_from_args
    from dflash.serving.tls import TLSConfigError
    from dflash_app.cli import main
    from verifier_svc.server import parse_args

    paths = make_dev_certs(tmp_path / "c", HOSTS, trust_domain="prod.example")
    cert, key = map(str, paths["verifier"])
    base = ["--target", "t", "--tls-cert", cert, "--tls-key", key, "--tls-ca", str(paths["ca"][0])]
    tls = server_tls_from_args(parse_args(base + ["--tls-trust-domain", "prod.example",
                                                  "--tls-peer-ids", "admin=urn:ops:me"]))
    assert tls.peer_ids.ids["gateway"] == {"spiffe://prod.example/dflash/gateway"}
    assert tls.peer_ids.ids["admin"] == {"urn:ops:me"}
    with pytest.raises(TLSConfigError, match="--tls-trust-domain"):
        server_tls_from_args(parse_args(base + ["--tls-trust-domain", "Prod Example"]))
    with pytest.raises(TLSConfigError, match="--tls-peer-ids: 'boss=urn:x'"):
        server_tls_from_args(parse_args(base + ["--tls-peer-ids", "boss=urn:x"]))
    assert main(["certs", "--out", str(tmp_path / "d"), "--trust-domain", "ops.example"]) == 0
    assert "spiffe://ops.example/dflash/admin" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="error: --trust-domain: 'NO WAY' is not a SPIFFE"):
        main(["certs", "--out", str(tmp_path / "e"), "--trust-domain", "NO WAY"])
