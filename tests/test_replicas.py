"""Verifier replicas behind one gateway (gateway.replicas), over real gRPC with scripted
verifiers: routing by load and prefix, sessions sticky (or round-robin, ``--routing``, and the
routed counts), a draining or unhealthy replica never chosen, a failure before the first token retried elsewhere, a failure mid-stream resumed from
the tokens sent, every replica down answered UNAVAILABLE naming each."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from gateway.replicas import ReplicaSet, parse_sources, read_file, resolve

from gateway_doubles import ScriptedVerifier, serve_verifier
from helpers import wait_until

IDS = list(range(40, 80))
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class Pool:
    """n scripted verifiers behind one gateway."""

    def __init__(self, tokenizer, n: int = 2, file: str | None = None, routing: str = "score", **kw):
        from gateway.server import build

        self.fakes, self.servers, self.addresses, self.health = [], [], [], []
        for _ in range(n):
            f = ScriptedVerifier(IDS, **kw)
            server, address, hs = serve_verifier(f)
            self.fakes.append(f)
            self.servers.append(server)
            self.addresses.append(address)
            self.health.append(hs)
        if file is not None:
            with open(file, "w") as fh:
                fh.write("\n".join(self.addresses) + "\n")
        self.replicas = ReplicaSet(parse_sources([] if file else self.addresses, file),
                                   resolve_s=0.1, routing=routing)
        self.gw = build(tokenizer, self.replicas, "127.0.0.1:0", max_positions=1024)
        self.gw.server.start()
        self.gw.set_serving(True)
        self.ch = grpc.insecure_channel(f"127.0.0.1:{self.gw.port}")
        self.stub = gateway_pb2_grpc.GatewayStub(self.ch)
        wait_until(lambda: all(r.watch and r.watch.healthy for r in self.replicas.replicas.values()),
                   5, "every replica healthy")

    def generate(self, **kw):
        kw.setdefault("prompt", "hello")
        kw.setdefault("max_tokens", 12)
        out = list(self.stub.Generate(gateway_pb2.GenerateRequest(**kw), timeout=20))
        return [t for r in out for t in r.token_ids], out[-1]

    def served(self) -> list[int]:
        return [len(f.requests) for f in self.fakes]

    def wait_state(self, i: int, pred, what: str) -> None:
        r = self.replicas.replicas[self.addresses[i]]
        wait_until(lambda: pred(r), 5, what)

    def close(self):
        self.ch.close()
        self.gw.server.stop(0)
        for s in self.servers:
            s.stop(0)


@pytest.fixture
def pool(tokenizer):
    p = Pool(tokenizer)
    yield p
    p.close()


def test_the_less_loaded_replica_gets_the_request(pool):
    pool.fakes[0].report = verifier_pb2.LoadReport(waiting=5, running=8, max_batch=8)
    pool.wait_state(0, lambda r: r.watch.load.waiting == 5, "replica 0's load read")
    for _ in range(4):
        ids, last = pool.generate()
        assert ids == IDS[:12] and last.usage.resumes == 0
    assert pool.served() == [0, 4]


def test_a_conversation_returns_to_the_replica_that_holds_its_prefix(pool):
    long = "the system prompt that every turn repeats, long enough for several blocks. " * 3
    pool.generate(prompt=long)
    first = pool.served().index(1)
    # the other one is now less loaded on paper, but the prefix weighs more
    pool.fakes[first].report = verifier_pb2.LoadReport(running=1, kv_cache_usage=0.1, max_batch=8)
    pool.wait_state(first, lambda r: r.watch.load.running == 1, "the load read")
    pool.generate(prompt=long + " and a second turn")
    assert pool.served()[first] == 2


def test_a_session_sticks_to_its_replica(pool):
    for i in range(4):
        pool.generate(prompt=f"turn {i}", session_id="conv-1")
    assert sorted(pool.served()) == [0, 4]
    sids = {r.session_id for f in pool.fakes for r in f.requests}
    assert len(sids) == 1


def test_an_unhealthy_replica_is_never_chosen_and_comes_back(pool):
    pool.health[0].set("", NOT_SERVING)
    pool.wait_state(0, lambda r: not r.healthy, "replica 0 seen NOT_SERVING")
    for _ in range(5):
        assert pool.generate()[0] == IDS[:12]
    assert pool.served() == [0, 5]
    pool.health[0].set("", SERVING)
    pool.wait_state(0, lambda r: r.eligible, "replica 0 back")
    for _ in range(4):
        pool.generate()
    assert pool.served()[0] > 0


def test_a_draining_replica_gets_nothing_new_and_finishes_its_own(pool):
    slow = pool.fakes[0]
    slow.delay_s = 0.05
    pool.fakes[1].report = verifier_pb2.LoadReport(waiting=50, max_batch=8)   # 0 looks better
    pool.wait_state(1, lambda r: r.watch.load.waiting == 50, "replica 1's load read")
    stream = pool.stub.Generate(gateway_pb2.GenerateRequest(prompt="long", max_tokens=30), timeout=20)
    first = next(stream)
    assert pool.served() == [1, 0]
    slow.report = verifier_pb2.LoadReport(draining=True)        # it says so while it stops
    pool.wait_state(0, lambda r: r.draining, "replica 0 draining")
    for _ in range(3):
        pool.generate()
    assert pool.served() == [1, 3]
    rest = list(stream)                                        # its own stream finishes there
    ids = list(first.token_ids) + [t for r in rest for t in r.token_ids]
    assert ids == IDS[:30] and rest[-1].usage.resumes == 0


def test_the_file_drains_and_adds_replicas(tokenizer, tmp_path):
    path = tmp_path / "verifiers"
    p = Pool(tokenizer, file=str(path))
    try:
        path.write_text(f"{p.addresses[0]} drain\n{p.addresses[1]}\n")
        p.wait_state(0, lambda r: r.draining, "replica 0 drained by the file")
        for _ in range(3):
            p.generate()
        assert p.served() == [0, 3]
        path.write_text(f"# replica 1 only\n{p.addresses[1]}\n")
        wait_until(lambda: len(p.replicas) == 1, 5, "replica 0 left")
    finally:
        p.close()


def test_round_robin_takes_turns_whatever_the_load_prefix_or_session(tokenizer):
    from prometheus_client import CollectorRegistry

    from dflash.serving.metrics import RoutedRequests

    p = Pool(tokenizer, routing="round-robin")
    try:
        p.fakes[0].report = verifier_pb2.LoadReport(waiting=50, running=8, max_batch=8)
        p.wait_state(0, lambda r: r.watch.load.waiting == 50, "replica 0's load read")
        long = "the system prompt that every turn repeats, long enough for several blocks. " * 3
        for i in range(6):             # one conversation, one session: the score would stick
            assert p.generate(prompt=long + "turn " * i, session_id="conv-1")[0] == IDS[:12]
        assert p.served() == [3, 3]
        assert len(p.replicas.history) == 0          # nothing looked up, nothing kept
        reg = CollectorRegistry()
        RoutedRequests(reg, p.replicas.routed_counts)
        for a in p.addresses:
            assert reg.get_sample_value("dflash_gateway_routed_requests_total", {"verifier": a}) == 3
    finally:
        p.close()
    with pytest.raises(ValueError, match="routing: one of score, round-robin"):
        ReplicaSet(parse_sources(["127.0.0.1:1"]), routing="random")


def test_the_routing_flag_and_the_routed_counts_on_the_score_path(pool, monkeypatch, capsys):
    from gateway.flags import parse_args

    assert parse_args(["--target", "t"]).routing == "score"
    assert parse_args(["--target", "t", "--routing", "round-robin"]).routing == "round-robin"
    monkeypatch.setenv("DFLASH_ROUTING", "random")
    with pytest.raises(SystemExit):
        parse_args(["--target", "t"])
    assert "--routing" in capsys.readouterr().err
    for _ in range(3):
        pool.generate()
    counts = pool.replicas.routed_counts()
    assert counts == dict(zip(pool.addresses, pool.served())) and sum(counts.values()) == 3


def test_a_replica_that_joins_later_learns_the_registered_drafters(tokenizer, tmp_path):
    """A replica that appears after the drafters were registered (a new pod behind dns:///,
    a line added to the file) is asked to CheckDrafter them before it is routed to: a verifier
    refuses a drafter address nobody registered there."""
    from gateway.upstream import register_drafter

    path = tmp_path / "verifiers"
    p = Pool(tokenizer, file=str(path))
    try:
        path.write_text(f"{p.addresses[0]}\n")
        wait_until(lambda: len(p.replicas) == 1, 5, "replica 1 left")
        register_drafter(p.gw.servicer.registry, p.replicas, "127.0.0.1:59999")
        assert p.fakes[0].checked[-1] == "127.0.0.1:59999"
        path.write_text(f"{p.addresses[0]}\n{p.addresses[1]}\n")
        wait_until(lambda: len(p.replicas) == 2, 5, "replica 1 back")
        # on_serving runs before the watch records its first SERVING answer
        p.wait_state(1, lambda r: r.watch is not None and r.watch.healthy, "replica 1 checked")
        assert "127.0.0.1:59999" in p.fakes[1].checked
    finally:
        p.close()


def test_a_failure_before_the_first_token_is_retried_elsewhere(pool):
    pool.fakes[1].report = verifier_pb2.LoadReport(waiting=50)        # 0 is chosen first
    pool.wait_state(1, lambda r: r.watch.load.waiting == 50, "replica 1's load read")
    pool.fakes[0].fail = (grpc.StatusCode.UNAVAILABLE, "connection reset", None)
    ids, last = pool.generate()
    assert ids == IDS[:12]
    assert last.usage.resumes == 0 and last.acceptance.resumes == 0     # invisible
    assert pool.served() == [1, 1]


def test_a_stream_that_fails_midway_resumes_from_the_tokens_sent(pool):
    pool.fakes[1].report = verifier_pb2.LoadReport(waiting=50)
    pool.wait_state(1, lambda r: r.watch.load.waiting == 50, "replica 1's load read")
    pool.fakes[0].abort_after = 5
    ids, last = pool.generate(max_tokens=20, session_id="s1")
    assert ids == IDS[:20]
    assert last.usage.resumes == 1 and last.acceptance.resumes == 1
    assert last.usage.completion_tokens == 20
    assert last.usage.prompt_tokens == len(pool.fakes[0].requests[0].prompt_token_ids)
    first, again = pool.fakes[0].requests[0], pool.fakes[1].requests[0]
    assert list(again.prompt_token_ids) == list(first.prompt_token_ids) + IDS[:5]
    assert again.max_tokens == 15 and again.resumed_tokens == 5
    assert again.session_id == first.session_id and again.sampling == first.sampling


def test_every_replica_down_is_unavailable_naming_each(pool):
    for f in pool.fakes:
        f.fail = (grpc.StatusCode.UNAVAILABLE, "gone", None)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        pool.generate()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for a in pool.addresses:
        assert a in e.value.details()
    assert time.monotonic() - t0 < 10            # nothing hangs: answered, not timed out
    for s in pool.servers:
        s.stop(0)
    wait_until(lambda: not pool.replicas.healthy(), 5, "both seen down")
    with pytest.raises(grpc.RpcError) as e:
        pool.generate()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert all(a in e.value.details() for a in pool.addresses)


def test_every_replica_full_passes_the_admission_hint_on(pool):
    for f in pool.fakes:
        f.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 250)
    with pytest.raises(grpc.RpcError) as e:
        pool.generate()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "250") in e.value.trailing_metadata()
    assert pool.served() == [1, 1]
    assert all(r.healthy for r in pool.replicas.replicas.values())   # full is not down


def test_a_refused_request_is_not_retried(pool):
    for f in pool.fakes:
        f.fail = (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many", None)
    with pytest.raises(grpc.RpcError) as e:
        pool.generate()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(pool.served()) == 1


def test_sources_parse_and_refuse_with_the_flag_named(tmp_path):
    s = parse_sources(["10.0.0.1:1,10.0.0.2:2", "dns:///verifier.ns.svc:50051", "10.0.0.1:1"])
    assert s.addresses == ("10.0.0.1:1", "10.0.0.2:2") and s.dns == ("verifier.ns.svc:50051",)
    for bad in (["nohost"], ["host:port"], []):
        with pytest.raises(ValueError, match="--verifier"):
            parse_sources(bad)
    f = tmp_path / "v"
    f.write_text("a:1\nb:2 drain  # going away\n\n")
    assert read_file(str(f)) == {"a:1": False, "b:2": True}
    f.write_text("a:1 maybe\n")
    with pytest.raises(ValueError, match=r"--verifiers-file: .*:1"):
        read_file(str(f))


def test_a_dns_name_resolves_to_its_addresses():
    assert "127.0.0.1:5" in resolve("localhost:5")
    assert resolve("no-such-host.invalid:5") == []


def test_a_replica_not_checked_yet_is_only_a_last_resort():
    """A replica that joins (a new pod behind ``dns:///``, a line added to the file) is not
    routed to before its first health check answers SERVING, unless no checked one is left."""
    from types import SimpleNamespace

    rs = ReplicaSet(parse_sources(["127.0.0.1:1", "127.0.0.1:2"]))
    checked, joined = rs.replicas["127.0.0.1:1"], rs.replicas["127.0.0.1:2"]
    try:
        assert rs.pick("t", IDS)[0] in (checked, joined)      # none checked: either will do
        checked.watch = SimpleNamespace(healthy=True, checks=1, load=None)
        joined.watch = SimpleNamespace(healthy=None, checks=0, load=None)
        assert not joined.eligible and checked.eligible
        # but a drafter registered now is checked on it too (CheckDrafter fans out to it)
        assert rs.maybe_up() == [checked, joined]
        picked = {rs.pick("t", [i])[0].address for i in range(8)}
        assert picked == {checked.address}
        checked.watch.healthy = False                          # the checked one goes down
        assert rs.pick("t", IDS)[0] is joined
        assert rs.maybe_up() == [joined]
    finally:
        for r in rs.replicas.values():
            r.raw.close()


@pytest.mark.parametrize("served", [True, False])
def test_the_next_turn_follows_the_answer_the_replica_cached(served):
    """The verifier's prefix cache keeps a finished request's output too, and a conversation's
    next turn resends it: the routing history learns the output's blocks from the replica that
    served it, so a busier replica holding the whole history still wins the next turn."""
    from types import SimpleNamespace

    rs = ReplicaSet(parse_sources(["127.0.0.1:1", "127.0.0.1:2"]))
    for r in rs.replicas.values():
        r.watch = SimpleNamespace(healthy=True, checks=1, load=verifier_pb2.LoadReport())
    prompt, answer, next_user = list(range(1, 17)), list(range(100, 164)), list(range(200, 216))
    try:
        first, _ = rs.pick("t", prompt)
        rs.release(first)
        if served:
            rs.served(first, "t", prompt + answer)
        first.watch.load = verifier_pb2.LoadReport(running=1)      # busier now
        again, choice = rs.pick("t", prompt + answer + next_user)
        assert (again is first) == served, choice
    finally:
        for r in rs.replicas.values():
            r.raw.close()
