"""Per-client stream limits at the gateway, without API keys: a client (its IP address) holds at
most ``--max-streams-per-client`` Generate streams over the gRPC and HTTP ports together; one
more is refused at once with RESOURCE_EXHAUSTED / HTTP 429 and a retry hint while other clients
are served, and a slot comes back however its stream ends. Also ``--max-streams`` (the total)
and the flags."""

from __future__ import annotations

import http.client
import json
import threading
import time

import grpc
import pytest

from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.auth import AuthError, ClientAuth, load_api_keys
from gateway.client_streams import DEFAULT_STREAMS_PER_CLIENT, ClientStreams
from gateway.peers import address_identity, peer_identity

from gateway_doubles import ScriptedVerifier, request, serve_verifier, sse_events

LIMIT = 2
TIMEOUT = 30
TEXT = "one two three four five six seven eight"
LOOPBACK = "ipv4:127.0.0.1"


class GatedVerifier(ScriptedVerifier):
    """Sends each stream's first chunk at once and the rest once ``go`` is set (a cancelled
    stream stops waiting), so the test decides how long streams stay open."""

    def __init__(self, ids):
        super().__init__(ids, sizes=(1,))
        self.go = threading.Event()

    def Generate(self, request, context):
        for n, chunk in enumerate(super().Generate(request, context)):
            while n and not self.go.wait(0.01):
                if not context.is_active():
                    return
            yield chunk


def _wait_for(what, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def gated(tokenizer):
    """make(**build kw) -> (rt, verifier double): gateway.server.build on 127.0.0.1 and [::1]
    (two clients on one machine), with the HTTP front, over a GatedVerifier."""
    from gateway.server import build

    made = []

    def make(**kw):
        fake = GatedVerifier(tokenizer.encode(TEXT))
        vserver, vaddr, _ = serve_verifier(fake)
        rt = build(tokenizer, vaddr, "127.0.0.1:0", max_positions=512, http_bind="127.0.0.1:0",
                   model_name="tiny", **kw)
        rt.port6 = rt.server.add_insecure_port("[::1]:0")
        made.append((vserver, rt, fake))
        rt.server.start()
        rt.set_serving(True)
        return rt, fake

    yield make
    for vserver, rt, fake in made:
        fake.go.set()
        rt.server.stop(0)
        vserver.stop(0)


def _stub(address: str):
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))


def _generate(stub, max_tokens: int = 64):
    return stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=max_tokens),
                         timeout=TIMEOUT)


def _refused(call) -> grpc.RpcError:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert time.monotonic() - t0 < 5      # at once, not after the held streams
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(ei.value.trailing_metadata() or ())["retry-after-ms"] == "200"
    return ei.value


# ---------------------------------------------------------------------------- unit
@pytest.mark.parametrize("peer, want", [
    ("ipv4:10.0.0.7:51234", "ipv4:10.0.0.7"),
    ("ipv6:%5B::1%5D:51234", "ipv6:::1"),                     # as grpc escapes it
    ("ipv6:[::1]:51234", "ipv6:::1"),
    ("ipv6:%5B2001:DB8:0:0::1%5D:443", "ipv6:2001:db8::1"),   # one form per address
    ("ipv6:%5B::ffff:10.0.0.7%5D:51234", "ipv4:10.0.0.7"),    # dual stack: the IPv4 client
    ("ipv6:%5Bfe80::1%25eth0%5D:51234", "ipv6:fe80::1%eth0"),
    ("unix:/tmp/gw.sock", "unix:/tmp/gw.sock"),
    ("unix:", "unix:"),
    ("unix-abstract:gw", "unix-abstract:gw"),
])
def test_peer_identity(peer, want):
    assert peer_identity(peer) == want


def test_address_identity_matches_the_grpc_peers():
    assert address_identity("127.0.0.1") == peer_identity("ipv4:127.0.0.1:1") == LOOPBACK
    assert address_identity("::ffff:127.0.0.1") == LOOPBACK
    assert address_identity("::1") == peer_identity("ipv6:%5B::1%5D:1")
    assert address_identity("") == "unix:"
    assert address_identity("testclient") == "host:testclient"


def test_client_streams_count_per_client_and_release_once():
    cs = ClientStreams(2)
    a1, a2 = cs.acquire("ipv4:10.0.0.1"), cs.acquire("ipv4:10.0.0.1")
    with pytest.raises(AuthError) as ei:
        cs.acquire("ipv4:10.0.0.1")
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and ei.value.retry_after_ms == 200
    assert "ipv4:10.0.0.1" in str(ei.value) and "retry after 200 ms" in str(ei.value)
    b = cs.acquire("ipv4:10.0.0.2")           # another client is not affected
    a1()
    a1()                                      # idempotent: gives back one slot, once
    assert (cs.open("ipv4:10.0.0.1"), cs.refused) == (1, 1)
    a3 = cs.acquire("ipv4:10.0.0.1")
    for release in (a2, a3, b):
        release()
    assert cs._open == {}                     # no entry kept per client once it has none open
    with pytest.raises(ValueError, match="max_streams_per_client"):
        ClientStreams(-1)


def test_client_streams_unbounded_and_with_api_keys(tmp_path):
    free = ClientStreams(0)
    assert free.client(None, LOOPBACK) is None
    releases = [free.acquire(free.client(None, LOOPBACK)) for _ in range(1000)]
    assert free.open(LOOPBACK) == 0 and len(releases) == 1000
    alice, bob = "alice-key-0123456789", "bob-key-01234567890"
    (tmp_path / "keys").write_text(f"{alice} alice 5\n{bob} bob\n")
    cs = ClientStreams(3, ClientAuth(load_api_keys(tmp_path / "keys")))
    assert cs.client(bob, LOOPBACK) == "key:bob"       # the key is the client, not the address
    assert cs.client(alice, LOOPBACK) is None          # bounded by its own max_concurrency
    assert cs.client(None, LOOPBACK) == LOOPBACK       # refused by ClientAuth anyway


# ---------------------------------------------------------------------------- gRPC
def test_grpc_one_stream_past_the_clients_limit_is_refused_others_served(gated):
    rt, fake = gated(max_streams_per_client=LIMIT)
    stub = _stub(f"127.0.0.1:{rt.port}")
    held = [_generate(stub) for _ in range(LIMIT)]
    for call in held:
        assert next(call).text                 # admitted and streaming
    err = _refused(_generate(stub))
    assert LOOPBACK in err.details() and "per-client limit" in err.details()
    # another client (the same machine over IPv6: another address) is served meanwhile
    other = list(_generate(_stub(f"[::1]:{rt.port6}"), max_tokens=1))
    assert other[-1].usage.completion_tokens == 1
    assert rt.client_streams.open(LOOPBACK) == LIMIT
    # the held streams complete in full
    fake.go.set()
    n = len(fake.ids)
    for call in held:
        rest = list(call)
        assert rest[-1].usage.completion_tokens == n
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == 0)
    assert rt.client_streams.refused == 1


def test_grpc_a_cancelled_or_failed_stream_gives_its_slot_back(gated):
    rt, fake = gated(max_streams_per_client=LIMIT)
    stub = _stub(f"127.0.0.1:{rt.port}")
    held = [_generate(stub) for _ in range(LIMIT)]
    for call in held:
        next(call)
    _refused(_generate(stub))
    held[0].cancel()                           # the client goes away mid-stream
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == LIMIT - 1)
    again = _generate(stub)
    assert next(again).text
    _refused(_generate(stub))                  # full again
    for call in (held[1], again):
        call.cancel()
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == 0)
    # streams that fail (the verifier refuses them) hold nothing after their error
    fake.fail = (grpc.StatusCode.UNAVAILABLE, "scripted outage", None)
    for _ in range(LIMIT + 1):
        with pytest.raises(grpc.RpcError) as ei:
            list(_generate(stub))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == 0)


def test_max_streams_bounds_all_clients_together(gated):
    rt, fake = gated(max_streams=3, max_streams_per_client=0)
    assert rt.streams.limit == 3 and rt.http.front.max_streams == 3
    stubs = [_stub(f"127.0.0.1:{rt.port}"), _stub(f"[::1]:{rt.port6}")]
    held = [_generate(stubs[i % 2]) for i in range(3)]
    for call in held:
        next(call)
    for stub in stubs:
        assert "server busy" in _refused(_generate(stub)).details()
    fake.go.set()
    assert all(list(call)[-1].usage.completion_tokens == len(fake.ids) for call in held)


# ---------------------------------------------------------------------------- HTTP
def _open_stream(rt, headers=None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion whose response has begun (status line and headers read)."""
    conn = http.client.HTTPConnection(rt.http.host, rt.http.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": "Hi", "max_tokens": 64, "stream": True}),
        headers={"content-type": "application/json", **(headers or {})})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def _complete(rt, headers=None, max_tokens: int = 1):
    return request(rt.http.url + "/v1/completions", "POST",
                   {"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens}, headers,
                   timeout=TIMEOUT)


def test_http_one_past_the_clients_limit_is_a_429_shared_with_grpc(gated):
    rt, fake = gated(max_streams_per_client=LIMIT)
    held = [_open_stream(rt) for _ in range(LIMIT)]
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == LIMIT)
    t0 = time.monotonic()
    status, headers, body = _complete(rt)
    assert time.monotonic() - t0 < 5
    assert status == 429
    assert headers["retry-after-ms"] == "200" and headers["retry-after"] == "1"
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "rate_limit_exceeded", None)
    assert LOOPBACK in err["message"] and "per-client limit" in err["message"]
    # one client's count covers both ports
    _refused(_generate(_stub(f"127.0.0.1:{rt.port}")))
    # another client (a proxy on this machine forwarding for it: uvicorn trusts loopback's
    # X-Forwarded-For) is served meanwhile
    status, _, body = _complete(rt, {"x-forwarded-for": "10.1.2.3"})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    # a client that disconnects gives its slot back
    held[0][0].close()
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == LIMIT - 1)
    status, _, body = _complete(rt)
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    # the other held stream completes in full
    fake.go.set()
    conn, r = held[1]
    events = sse_events(r.read().decode())
    conn.close()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT
    _wait_for(lambda: rt.client_streams.open(LOOPBACK) == 0 and rt.http.front.open == 0)


# ---------------------------------------------------------------------------- flags
def test_flags_and_their_environment_variables(monkeypatch, capsys):
    from gateway.server import parse_args

    monkeypatch.delenv("DFLASH_MAX_STREAMS", raising=False)
    monkeypatch.delenv("DFLASH_MAX_STREAMS_PER_CLIENT", raising=False)
    a = parse_args(["--target", "t"])
    assert (a.max_streams, a.max_streams_per_client) == (512, DEFAULT_STREAMS_PER_CLIENT)
    a = parse_args(["--target", "t", "--max-streams", "100", "--max-streams-per-client", "0"])
    assert (a.max_streams, a.max_streams_per_client) == (100, 0)
    monkeypatch.setenv("DFLASH_MAX_STREAMS", "40")
    monkeypatch.setenv("DFLASH_MAX_STREAMS_PER_CLIENT", "4")
    a = parse_args(["--target", "t"])
    assert (a.max_streams, a.max_streams_per_client) == (40, 4)
    for argv, flag in ((["--max-streams", "0"], "--max-streams"),
                       (["--max-streams-per-client", "-1"], "--max-streams-per-client")):
        with pytest.raises(SystemExit) as ei:
            parse_args(["--target", "t", *argv])
        assert ei.value.code == 2 and flag in capsys.readouterr().err
