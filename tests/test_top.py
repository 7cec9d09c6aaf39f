"""``dflash top``: the figures it shows are the services' own metrics, scraped over HTTP from
real registries (dflash.serving.metrics) and rendered with rich's console capture."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from rich.console import Console

from dflash.serving.metrics import GatewayMetrics, VerifierMetrics
from dflash.serving.telemetry import serve_metrics
from dflash_app import top

B = 4   # block size: 3 draft positions


@pytest.fixture
def services():
    """A verifier and a gateway registry, each served on its own loopback /metrics."""
    regs = {"verifier": CollectorRegistry(), "gateway": CollectorRegistry()}
    m = {"verifier": VerifierMetrics(regs["verifier"]), "gateway": GatewayMetrics(regs["gateway"])}
    servers = {k: serve_metrics(r, 0, "127.0.0.1") for k, r in regs.items()}
    yield m, [f"127.0.0.1:{s.server_port}" for s in servers.values()]
    for s in servers.values():
        s.shutdown()


def steps(vm: VerifierMetrics, label: str, accepted: list[int], fallback: str | None = None):
    for a in accepted:
        vm.step(label, drafted=B - 1, accepted=a, fallback=fallback, verify_s=0.01, draft_s=0.002,
                wire_s=0.001, context_bytes=100)


def text(renderable) -> str:
    c = Console(record=True, width=220, color_system=None)
    c.print(renderable)
    return c.export_text()


def test_frame_shows_tau_per_position_and_latency_by_drafter_version(services):
    m, endpoints = services
    vm, gm = m["verifier"], m["gateway"]
    steps(vm, "v@1", [3, 3, 1, 0])          # tau = 1 + 7/4
    steps(vm, "v@2", [0, 0])
    vm.fallback("timeout", "v@2")
    for ttft in (0.01, 0.02, 0.03):
        gm.ttft.labels("v@1").observe(ttft)
    gm.requests.labels("v@1", "length").inc(3)
    now, down = top.scrape(endpoints)
    assert down == []
    f = top.frame(now)
    rows = {r.version: r for r in f.rows}
    assert rows["v@1"].tau == pytest.approx(1 + 7 / 4)
    # position i is accepted in the steps that accepted more than i tokens
    assert rows["v@1"].per_position == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert rows["v@2"].tau == pytest.approx(1.0) and rows["v@2"].fallbacks == 1
    assert f.fallback_reasons == {"timeout": 1}
    p50 = rows["v@1"].ttft[0]
    assert p50 is not None and 0.01 <= p50 <= 0.025
    out = text(top.render(f))
    assert "v@1" in out and "2.75" in out and "0.75 0.50 0.50" in out and "timeout 1" in out


def test_accepted_tokens_split_by_source_per_drafter_version(services):
    """The verifier's by-source counter, per drafter version: what the suffix index alone
    proposed is told apart from the drafter's, and the two add up to the accepted tokens."""
    m, endpoints = services
    vm = m["verifier"]
    for accepted, suffix in ((3, 0), (3, 2), (2, 1), (0, 0)):   # v@1: 8 accepted, 3 by suffix
        vm.step("v@1", drafted=B - 1, accepted=accepted, fallback=None, verify_s=0.01,
                draft_s=0.002, wire_s=0.001, context_bytes=100, suffix_accepted=suffix)
    steps(vm, "v@2", [1, 2])                                      # drafter only
    now, _ = top.scrape(endpoints)
    rows = {r.version: r for r in top.frame(now).rows}
    assert rows["v@1"].accepted_by_source == {"drafter": 5, "suffix": 3}
    assert rows["v@2"].accepted_by_source == {"drafter": 3, "suffix": 0}
    assert rows["v@1"].tau == pytest.approx(1 + 8 / 4)
    out = text(top.render(top.frame(now)))
    assert "accepted drafter / suffix" in out
    v1, v2 = (next(ln for ln in out.splitlines() if v in ln) for v in ("v@1", "v@2"))
    assert "5 / 3 (38%)" in v1 and "3 / 0 (0%)" in v2
    # a verifier without the counter (an older release): the column says so, nothing breaks
    old = {k: x for k, x in now.items() if "by_source" not in k[0]}
    (row,) = [r for r in top.frame(old).rows if r.version == "v@1"]
    assert row.accepted_by_source == {} and top._sources(row.accepted_by_source) == "-"


def test_interval_figures_are_differences_between_scrapes(services):
    m, endpoints = services
    vm, gm = m["verifier"], m["gateway"]
    steps(vm, "v@1", [0, 0])                 # before: tau 1
    gm.completion_tokens.labels("v@1").inc(10)
    before, _ = top.scrape(endpoints)
    steps(vm, "v@1", [3, 3])                 # this interval: tau 4
    gm.completion_tokens.labels("v@1").inc(50)
    now, _ = top.scrape(endpoints)
    (row,) = top.frame(now, before, interval_s=2.0).rows
    assert row.tau_now == pytest.approx(4.0) and row.tau == pytest.approx(1 + 6 / 4)
    assert row.tokens_per_s == pytest.approx(25.0)
    assert top.frame(now).rows[0].tau_now is None    # one scrape: no interval yet


def test_quantile_matches_the_observations_within_a_bucket():
    reg = CollectorRegistry()
    edges = [i / 100 for i in range(1, 101)]
    h = Histogram("x_seconds", "x", buckets=edges, registry=reg)
    rng = random.Random(0)
    xs = [rng.betavariate(2, 5) for _ in range(5000)]
    for x in xs:
        h.observe(x)
    buckets = {float(s.labels["le"]): s.value for fam in reg.collect() for s in fam.samples
               if s.name == "x_seconds_bucket"}
    for q in (0.5, 0.9, 0.99):
        assert top.quantile(buckets, q) == pytest.approx(np.quantile(xs, q), abs=0.01)
    assert top.quantile({1.0: 0, float("inf"): 0}, 0.5) is None


def test_live_view_refreshes_and_says_which_endpoint_is_down(services):
    m, endpoints = services
    steps(m["verifier"], "v@1", [3])
    buf = io.StringIO()
    dead = "127.0.0.1:1"
    drawn: list[top.Frame] = []
    assert top.run(endpoints + [dead], interval_s=0.0, frames=2, on_frame=drawn.append,
                   console=Console(file=buf, width=220, color_system=None)) == 0
    out = buf.getvalue()
    assert "v@1" in out and f"not answering: {dead}" in out
    # one call per refresh, in order: the first has no interval yet, the second has one
    assert len(drawn) == 2 and drawn[0].interval_s is None and drawn[1].interval_s is not None
    assert top.run([dead], once=True, console=Console(file=io.StringIO())) == 1


def test_cli_top_once_prints_one_frame(services, capsys):
    from dflash_app.cli import main

    m, endpoints = services
    steps(m["verifier"], "v@9", [2])
    assert main(["top", "--once", *[a for ep in endpoints for a in ("--metrics", ep)]]) == 0
    out = capsys.readouterr().out
    assert "dflash top" in out and "v@9" in out and "3.00" in out


def test_the_command_line_reads_every_replica():
    """`dflash up --metrics --verifiers 2` prints a `dflash top` that reads both replicas and
    their drafters, not the one-verifier default."""
    from dflash_app.launcher import DrafterSpec, StackConfig
    from dflash_app.local_prometheus import metrics_ports
    from dflash_app.top import DEFAULT_ENDPOINTS, command_for

    one = metrics_ports(StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)], verifiers=1))
    assert command_for("127.0.0.1", one.values()) == "dflash top"
    assert set(DEFAULT_ENDPOINTS) == {f"127.0.0.1:{p}" for p in one.values()}
    two = metrics_ports(StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)], verifiers=2))
    line = command_for("127.0.0.1", two.values())
    assert all(f"--metrics 127.0.0.1:{p}" in line for p in two.values()), line
    assert len(two) == 5 and "9452" in line and "9462" in line
