"""TLS and mTLS on the gRPC links (dflash/serving/tls.py): round trips, refusals with clear errors,
certificate reload without a restart, the ``dflash certs`` command and the TLS flags."""

from __future__ import annotations

import os
import stat
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dflash.serving.authz import DEFAULT_TRUST_DOMAIN, spiffe_id
from dflash.serving.server import create_server
from dflash.serving.tls import (
    ClientTLS,
    Issued,
    ServerTLS,
    TLSConfigError,
    TLSFiles,
    channel,
    issue,
    new_ca,
    write_pair,
)

HOSTS = ["localhost", "127.0.0.1"]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def ca():
    return new_ca()


def files(tmp_path, stem: str, issued: Issued, ca: Issued | None = None) -> TLSFiles:
    cert, key = write_pair(tmp_path, stem, issued)
    ca_path = None
    if ca is not None:
        ca_path = tmp_path / f"{stem}-ca.pem"
        ca_path.write_bytes(ca.cert)
    return TLSFiles(str(cert), str(key), str(ca_path) if ca_path else None)


def serve(tls: ServerTLS):
    rt = create_server("127.0.0.1:0", lambda s: None, (), tls=tls)
    rt.server.start()
    rt.set_serving(True)
    return rt


def check(port: int, tls: ClientTLS | None, timeout: float = 5.0):
    """Health Check over a fresh channel: the status, or raises grpc.RpcError."""
    with channel(f"127.0.0.1:{port}", tls) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=timeout).status


def client(ca: Issued, mine: Issued | None = None, server_name: str = "") -> ClientTLS:
    return ClientTLS(ca=ca.cert, cert=mine.cert if mine else None,
                     key=mine.key if mine else None, server_name=server_name)


@pytest.fixture
def tls_server(tmp_path, ca):
    """A TLS server (no client certificates required) with a certificate for HOSTS."""
    tls = ServerTLS(files(tmp_path, "server", issue(ca, "server", HOSTS)))
    rt = serve(tls)
    yield rt
    rt.server.stop(0)


@pytest.fixture
def mtls_server(tmp_path, ca):
    """A server requiring client certificates signed by ``ca``."""
    tls = ServerTLS(files(tmp_path, "server", issue(ca, "server", HOSTS), ca=ca))
    assert tls.require_client_cert
    rt = serve(tls)
    yield rt
    rt.server.stop(0)


def refused(port: int, tls: ClientTLS | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        check(port, tls, timeout=3.0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    return e.value


# ------------------------------------------------------------------ handshakes
def test_tls_round_trip_and_plaintext_refused(tls_server, ca):
    assert check(tls_server.port, client(ca)) == SERVING
    refused(tls_server.port, None)   # a plaintext client gets no answer from a TLS port


def test_wrong_ca_refused_saying_why(tls_server):
    e = refused(tls_server.port, client(new_ca("another CA")))
    assert "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate" in e.details()


def test_wrong_host_refused_and_server_name_override(tmp_path, ca):
    rt = serve(ServerTLS(files(tmp_path, "other", issue(ca, "other", ["other.example"]))))
    try:
        e = refused(rt.port, client(ca))   # 127.0.0.1 is not in the certificate's SANs
        assert "Hostname Verification Check failed" in e.details(), e.details()
        assert check(rt.port, client(ca, server_name="other.example")) == SERVING
    finally:
        rt.server.stop(0)


def test_expired_server_certificate_refused_at_start(tmp_path, ca):
    f = files(tmp_path, "old", issue(ca, "old", HOSTS, days=-1))
    with pytest.raises(TLSConfigError, match=r"--tls-cert: certificate expired at"):
        ServerTLS(f)


def test_expired_server_certificate_refused_by_clients(ca):
    # Served without ServerTLS's check (e.g. another server): the client still refuses it.
    old = issue(ca, "old", HOSTS, days=-1)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(old.key, old.cert)]))
    server.start()
    try:
        e = refused(port, client(ca))
        assert "CERTIFICATE_VERIFY_FAILED: certificate has expired" in e.details(), e.details()
    finally:
        server.stop(0)


def test_mtls_requires_a_client_certificate(mtls_server, ca):
    refused(mtls_server.port, client(ca))                                      # none
    refused(mtls_server.port, client(ca, issue(new_ca("rogue"), "rogue", HOSTS)))  # other CA
    refused(mtls_server.port, client(ca, issue(ca, "late", HOSTS, days=-1)))   # expired
    assert check(mtls_server.port, client(ca, issue(ca, "client", HOSTS))) == SERVING


# ------------------------------------------------------------------ reload
def test_certificate_reload_on_file_change_without_restart(tmp_path, ca):
    f = files(tmp_path, "srv", issue(ca, "srv", HOSTS))
    tls = ServerTLS(f)
    rt = serve(tls)
    try:
        assert check(rt.port, client(ca)) == SERVING
        ca2 = new_ca("renewed CA")
        write_pair(tmp_path, "srv", issue(ca2, "srv", HOSTS))   # replaced, server running
        assert check(rt.port, client(ca2)) == SERVING            # the next connection sees it
        refused(rt.port, client(ca))
        assert tls.reloads == 1
    finally:
        rt.server.stop(0)


def _write_in_place(path, data: bytes, size: int, times) -> None:
    # Same inode, size and mtime: only a forced reload (SIGHUP) can notice the change.
    with open(path, "r+b") as fh:
        fh.write(data.ljust(size, b"\n"))
        fh.truncate()
    os.utime(path, ns=times)


def test_sighup_reload_rereads_unchanged_looking_files(tmp_path, ca):
    size = 2048
    first = issue(ca, "srv", HOSTS)
    f = files(tmp_path, "srv", Issued(first.cert.ljust(size, b"\n"), first.key.ljust(size, b"\n")))
    tls = ServerTLS(f)
    rt = serve(tls)
    try:
        assert check(rt.port, client(ca)) == SERVING
        ca2 = new_ca("renewed CA")
        second = issue(ca2, "srv", HOSTS)
        for path, data in ((f.key, second.key), (f.cert, second.cert)):
            st = os.stat(path)
            _write_in_place(path, data, size, (st.st_atime_ns, st.st_mtime_ns))
        refused(rt.port, client(ca2))            # looks unchanged: still the old certificate
        tls.request_reload()                     # what SIGHUP does (run_until_signal)
        assert check(rt.port, client(ca2)) == SERVING
    finally:
        rt.server.stop(0)


def test_invalid_replacement_keeps_the_current_certificate(tmp_path, ca):
    f = files(tmp_path, "srv", issue(ca, "srv", HOSTS))
    tls = ServerTLS(f)
    rt = serve(tls)
    try:
        with open(f.cert, "wb") as fh:    # a half-written certificate
            fh.write(b"-----BEGIN CERTIFICATE-----\nMIIB")
        assert check(rt.port, client(ca)) == SERVING
        assert tls.reloads == 0
    finally:
        rt.server.stop(0)


# ------------------------------------------------------------------ configuration errors
def test_bad_tls_files_refused_naming_the_flag(tmp_path, ca):
    good = files(tmp_path, "g", issue(ca, "g", HOSTS))
    other = files(tmp_path, "o", issue(ca, "o", HOSTS))
    with pytest.raises(TLSConfigError, match="--tls-key: needed with --tls-cert"):
        ServerTLS(TLSFiles(cert=good.cert))
    with pytest.raises(TLSConfigError, match="--tls-cert: needed with --tls-ca"):
        ServerTLS(TLSFiles(ca=good.cert))
    with pytest.raises(TLSConfigError, match="--tls-cert: cannot read"):
        ServerTLS(TLSFiles(cert=str(tmp_path / "missing.pem"), key=good.key))
    with pytest.raises(TLSConfigError, match="--tls-key: the key does not match"):
        ServerTLS(TLSFiles(cert=good.cert, key=other.key))
    with pytest.raises(TLSConfigError, match="--tls-ca: not a PEM"):
        ServerTLS(TLSFiles(cert=good.cert, key=good.key, ca=good.key))
    with pytest.raises(TLSConfigError, match="--upstream-tls-ca: needed"):
        ClientTLS.from_files(TLSFiles(cert=good.cert, key=good.key, prefix="--upstream-tls"))
    with pytest.raises(TLSConfigError, match="--upstream-tls-key: needed with --upstream-tls-cert"):
        ClientTLS.from_files(TLSFiles(cert=good.cert, ca=good.cert, prefix="--upstream-tls"))
    assert ClientTLS.from_files(TLSFiles()) is None


def test_service_flags_and_env(tmp_path, ca, monkeypatch):
    from dflash.serving.server import server_tls_from_args, upstream_tls_from_args
    from gateway.server import parse_args

    g = files(tmp_path, "gw", issue(ca, "gw", HOSTS), ca=ca)
    a = parse_args(["--target", "t", "--tls-cert", g.cert, "--tls-key", g.key, "--tls-ca", g.ca])
    assert server_tls_from_args(a).require_client_cert
    assert upstream_tls_from_args(a) is None          # plaintext to the verifier unless asked
    monkeypatch.setenv("DFLASH_UPSTREAM_TLS_CA", g.ca)
    monkeypatch.setenv("DFLASH_TLS_CERT", g.cert)
    a = parse_args(["--target", "t"])
    assert upstream_tls_from_args(a).ca == ca.cert
    with pytest.raises(TLSConfigError, match="--tls-key: needed with --tls-cert"):
        server_tls_from_args(a)
    assert server_tls_from_args(parse_args(["--target", "t", "--tls-cert", ""])) is None


# ------------------------------------------------------------------ tools
def test_healthcheck_over_mtls(mtls_server, ca, tmp_path, capsys):
    from dflash.serving.healthcheck import main

    me = files(tmp_path, "probe", issue(ca, "probe", HOSTS), ca=ca)
    addr = f"0.0.0.0:{mtls_server.port}"
    assert main([addr, "--tls-ca", me.ca, "--tls-cert", me.cert, "--tls-key", me.key]) == 0
    assert main([addr, "--tls-ca", me.ca, "--timeout", "2"]) == 1    # no client certificate
    assert "UNAVAILABLE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([addr, "--tls-cert", me.cert, "--tls-key", me.key])     # no CA: refused, named
    assert "--tls-ca: needed" in capsys.readouterr().err


def test_dflash_certs_command(tmp_path, capsys):
    from cryptography import x509

    from dflash_app.cli import main

    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--hosts", "gw.example,10.1.2.3", "--days", "30"]) == 0
    names = {p.name for p in out.iterdir()}
    assert names == {f"{s}{x}.pem" for s in ("ca", "gateway", "verifier", "drafter", "client",
                                             "admin") for x in ("", "-key")}
    for p in out.glob("*-key.pem"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    cert = x509.load_pem_x509_certificate((out / "verifier.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw.example", "verifier"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    # The files work as they are: an mTLS server and a client from the same run.
    tls = ServerTLS(TLSFiles(str(out / "verifier.pem"), str(out / "verifier-key.pem"),
                             str(out / "ca.pem")))
    rt = serve(tls)
    try:
        me = ClientTLS.from_files(TLSFiles(str(out / "client.pem"), str(out / "client-key.pem"),
                                           str(out / "ca.pem")), server_name="gw.example")
        assert check(rt.port, me) == SERVING
    finally:
        rt.server.stop(0)
    with pytest.raises(SystemExit, match="--hosts"):
        main(["certs", "--out", str(out), "--hosts", " , "])


# ------------------------------------------------------------------ every link
def test_tls_on_every_link_gateway_verifier_drafter(tmp_path, ca, target_model, tokenizer,
                                                     tiny_target, make_drafter):
    """client -mTLS-> gateway -mTLS-> verifier -mTLS-> drafter, tiny models: the generation is
    speculative (the drafter answered over TLS) and plaintext is refused on every port."""
    from dflash.client import GatewayClient, build_request
    from drafter_svc.engine import DrafterEngine
    from drafter_svc.server import build as build_drafter
    from gateway.server import build as build_gateway, register_drafter
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import build as build_verifier

    def side(name):      # each service's certificate carries its role (dflash.serving.authz)
        f = files(tmp_path, name, issue(ca, name, HOSTS, uri=spiffe_id(DEFAULT_TRUST_DOMAIN, name)),
                  ca=ca)
        return ServerTLS(f), ClientTLS.from_files(f)

    d_srv, _ = side("drafter")
    v_srv, v_cli = side("verifier")
    g_srv, g_cli = side("gateway")
    _, me = side("client")
    drafter = build_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target),
                            "127.0.0.1:0", tls=d_srv)
    engine = VerifierEngine(target_model, spec_mode="fixed")
    verifier = build_verifier(engine, "127.0.0.1:0", tls=v_srv, upstream_tls=v_cli)
    gateway = build_gateway(tokenizer, f"localhost:{verifier.port}", "127.0.0.1:0",
                            max_positions=target_model.max_positions, tls=g_srv,
                            upstream_tls=g_cli)
    rts = [drafter, verifier, gateway]
    gc = None
    try:
        for rt in rts:
            rt.server.start()
            rt.set_serving(True)
        register_drafter(gateway.servicer.registry, gateway.servicer.verifier,
                         f"localhost:{drafter.port}", default=True, timeout_s=10)
        gc = GatewayClient(f"localhost:{gateway.port}", tls=me)
        c = gc.complete(build_request("Hello TLS", max_tokens=12), timeout=60)
        assert c.usage.completion_tokens == 12
        assert c.acceptance.drafts > 0 and c.drafter      # the drafter link carried drafts
        for rt in rts:
            refused(rt.port, None)
            refused(rt.port, client(ca))                   # TLS but no client certificate
    finally:
        if gc:
            gc.close()
        for rt in rts:
            rt.server.stop(0)
        if verifier.servicer.pool:
            verifier.servicer.pool.close()
        engine.close()


@pytest.mark.slow
def test_dflash_up_tls_local_stack(tmp_path, tiny_target, make_drafter):
    """``dflash up --tls``'s stack (LocalStack, cfg.tls): certificates in <run_dir>/tls, every
    service behind mTLS, a generation through it with the client certificate."""
    import socket

    from dflash.client import GatewayClient, build_request
    from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig

    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    gw, ver, dr = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    cfg = StackConfig(target=str(tiny_target),
                      drafters=[DrafterSpec(path=str(make_drafter(block_size=8)), port=dr)],
                      gateway_port=gw, verifier_port=ver, run_dir=str(tmp_path / "up"),
                      health_timeout_s=120, tls=True)
    with LocalStack(cfg) as stack:
        assert (stack.tls_dir / "ca.pem").exists() and stack.client_tls.cert
        c = GatewayClient(stack.gateway_addr, tls=stack.client_tls)
        try:
            out = c.complete(build_request("Hello", max_tokens=8), timeout=60)
        finally:
            c.close()
        assert out.usage.completion_tokens == 8 and out.acceptance.drafts > 0
        for port in (gw, ver, dr):
            refused(port, None)
            refused(port, ClientTLS(ca=stack.client_tls.ca))   # no client certificate
