"""``dflash up --verifiers N`` (dflash_app.launcher.LocalStack, StackConfig.verifiers): N
verifier replicas, each with its own drafters and a share of the cores, behind one gateway
given every verifier's address (and more gateways on the same verifiers: add_gateway); the verifier's ``--drafter-alias`` that lets replica r reach
its own drafter under the address the gateway names (replica 0's)."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash.v1 import verifier_pb2
from dflash_app import launcher
from dflash_app.launcher import DrafterSpec, LaunchError, LocalStack, StackConfig, free_run

from helpers import free_ports, generate_ids


def _planned(monkeypatch, cfg: StackConfig, stack: LocalStack | None = None) -> dict[str, list[str]]:
    """process name -> argv after ``python -m``, of a start (of ``stack``, default a new one of
    ``cfg``) that spawns nothing; later spawns of the stack are added as they come."""
    argv: dict[str, list[str]] = {}

    def spawn(self, name, module, args):
        argv[name] = [module, *args]
        self.procs[name] = None

    monkeypatch.setattr(LocalStack, "_spawn", spawn)
    monkeypatch.setattr(LocalStack, "_wait", lambda self, name, addr: None)
    monkeypatch.setattr(LocalStack, "stop", lambda self, grace_s=15.0: None)
    monkeypatch.setattr(launcher, "cores", lambda: 8)
    (stack or LocalStack(cfg)).start()
    return argv


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_two_replicas_each_run_their_own_drafters_behind_one_gateway(monkeypatch, tmp_path):
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d1", port=50061),
                                            DrafterSpec(path="d2", port=50062)],
                      run_dir=str(tmp_path), verifiers=2)
    argv = _planned(monkeypatch, cfg)
    assert list(argv) == ["drafter0", "drafter1", "verifier0", "drafter2", "drafter3", "verifier1",
                          "gateway"]
    binds = {name: flag_values(a, "--bind")[0] for name, a in argv.items()}
    assert binds == {"drafter0": "127.0.0.1:50061", "drafter1": "127.0.0.1:50062",
                     "verifier0": "127.0.0.1:50051", "drafter2": "127.0.0.1:50063",
                     "drafter3": "127.0.0.1:50064", "verifier1": "127.0.0.1:50052",
                     "gateway": "127.0.0.1:50050"}
    gw = argv["gateway"]
    assert flag_values(gw, "--verifier") == ["127.0.0.1:50051", "127.0.0.1:50052"]
    assert flag_values(gw, "--drafter") == ["127.0.0.1:50061", "127.0.0.1:50062"]
    # replica 1 reaches its own drafters under the names the gateway registers (replica 0's)
    assert flag_values(argv["verifier0"], "--drafter-alias") == []
    assert flag_values(argv["verifier1"], "--drafter-alias") == [
        "127.0.0.1:50061=127.0.0.1:50063", "127.0.0.1:50062=127.0.0.1:50064"]
    assert [flag_values(argv[n], "--drafter")[0] for n in ("drafter2", "drafter3")] == ["d1", "d2"]
    # 8 cores, 2 replicas: 4 threads for each replica's verifier and for each of its drafters
    for name, a in argv.items():
        assert flag_values(a, "--threads") == ([] if name == "gateway" else ["4"]), name


def test_one_replica_keeps_the_single_verifier_layout(monkeypatch, tmp_path):
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)], run_dir=str(tmp_path))
    argv = _planned(monkeypatch, cfg)
    assert list(argv) == ["drafter0", "verifier", "gateway"]
    assert flag_values(argv["gateway"], "--verifier") == ["127.0.0.1:50051"]
    assert not any("--threads" in a or "--drafter-alias" in a for a in argv.values())


def test_another_gateway_joins_a_started_stack_on_the_verifiers_it_is_given(monkeypatch, tmp_path):
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)],
                      run_dir=str(tmp_path), verifiers=2, gateway_args=["--verifiers-file", "f"])
    stack = LocalStack(cfg)
    with pytest.raises(LaunchError, match="start the stack first"):
        stack.add_gateway("gateway-rr", 50070, 50071)
    argv = _planned(monkeypatch, cfg, stack)
    assert stack.add_gateway("gateway-rr", 50070, 50071, args=["--routing", "round-robin"],
                             metrics_port=9470) == "127.0.0.1:50070"
    stack.add_gateway("gateway-one", 50072, 50073, verifiers=stack.verifier_addrs[:1])
    rr, one = argv["gateway-rr"], argv["gateway-one"]
    assert flag_values(rr, "--bind") == ["127.0.0.1:50070"]
    assert flag_values(rr, "--admin-bind") == ["127.0.0.1:50071"]
    assert flag_values(rr, "--routing") == ["round-robin"] and flag_values(rr, "--http-port") == ["0"]
    assert flag_values(rr, "--verifier") == ["127.0.0.1:50051", "127.0.0.1:50052"]
    assert flag_values(one, "--verifier") == ["127.0.0.1:50051"]
    assert flag_values(rr, "--drafter") == flag_values(one, "--drafter") == ["127.0.0.1:50061"]
    assert "--verifiers-file" not in rr          # the stack's own gateway's flags stay its own
    assert flag_values(argv["gateway"], "--verifiers-file") == ["f"]
    assert cfg.metrics_ports == {"gateway-rr": 9470}
    with pytest.raises(LaunchError, match="'gateway-rr' is already"):
        stack.add_gateway("gateway-rr", 50074, 50075)


def test_each_replica_may_get_verifier_flags_of_its_own(monkeypatch, tmp_path):
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)],
                      run_dir=str(tmp_path), verifiers=2, verifier_args=["--prefix-cache-mb", "64"],
                      verifier_args_per_replica=[[], ["--prefix-cache", "off"]])
    argv = _planned(monkeypatch, cfg)
    v0, v1 = argv["verifier0"], argv["verifier1"]
    assert flag_values(v0, "--prefix-cache") == [] and flag_values(v1, "--prefix-cache") == ["off"]
    # the common flags go to both, before the replica's own (a later flag wins in argparse)
    assert flag_values(v0, "--prefix-cache-mb") == flag_values(v1, "--prefix-cache-mb") == ["64"]
    assert v1.index("--prefix-cache-mb") < v1.index("--prefix-cache")
    assert not any("--prefix-cache" in a for n, a in argv.items() if not n.startswith("verifier"))
    spawned = []
    monkeypatch.setattr(LocalStack, "_spawn", lambda self, *a: spawned.append(a))
    for per in ([["--prefix-cache", "off"]], [[], [], []]):
        bad = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)],
                          run_dir=str(tmp_path), verifiers=2, verifier_args_per_replica=per)
        with pytest.raises(LaunchError, match=rf"verifier_args_per_replica: one list per replica "
                                              rf"\(2\), got {len(per)}"):
            LocalStack(bad).start()
    assert spawned == []


def test_replica_ports_that_collide_are_refused_before_anything_starts(monkeypatch, tmp_path):
    spawned = []
    monkeypatch.setattr(LocalStack, "_spawn", lambda self, *a: spawned.append(a))
    # verifiers on 50051..50060: the tenth takes the gateway's admin port (50050 + 10)
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)],
                      run_dir=str(tmp_path), verifiers=10)
    with pytest.raises(LaunchError, match="port 50060: both gateway admin and verifier9"):
        LocalStack(cfg).start()
    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=50061)],
                      run_dir=str(tmp_path), verifiers=0)
    with pytest.raises(LaunchError, match="verifiers: must be >= 1, got 0"):
        LocalStack(cfg).start()
    assert spawned == []


def test_dflash_up_takes_verifiers(monkeypatch):
    from dflash_app import cli

    seen = {}

    def start(self):
        seen["verifiers"] = self.cfg.verifiers
        raise launcher.LaunchError("stop here")

    monkeypatch.setattr(launcher.LocalStack, "start", start)
    with pytest.raises(SystemExit, match="stop here"):
        cli.main(["up", "--target", "t", "--drafter", "d", "--verifiers", "3"])
    assert seen == {"verifiers": 3}
    with pytest.raises(SystemExit) as e:
        cli.main(["up", "--target", "t", "--verifiers", "0"])
    assert e.value.code == 2                               # argparse: must be >= 1


class _Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def test_dflash_up_outlives_a_lost_replica_not_the_last_one(tmp_path, capsys):
    from dflash_app.cli import _exited

    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=1)], run_dir=str(tmp_path),
                      verifiers=2)
    stack = LocalStack(cfg)
    stack.procs = {n: _Proc() for n in ("drafter0", "verifier0", "drafter1", "verifier1", "gateway")}
    reported: set[str] = set()
    assert not _exited(stack, reported)
    stack.procs["verifier1"].code = -9                     # killed: the gateway fails over
    assert not _exited(stack, reported) and not _exited(stack, reported)
    assert capsys.readouterr().err.count("verifier1 exited") == 1    # reported once
    stack.procs["verifier0"].code = 1                      # the last replica: nothing serves
    assert _exited(stack, reported)
    stack.procs = {"verifier0": _Proc(), "verifier1": _Proc(), "gateway": _Proc(0)}
    assert _exited(stack, set())                           # the gateway gone
    one = LocalStack(StackConfig(target="t", drafters=[DrafterSpec(path="d", port=1)],
                                 run_dir=str(tmp_path)))
    one.procs = {"drafter0": _Proc(1), "verifier": _Proc(), "gateway": _Proc()}
    assert _exited(one, set())                             # one verifier: any exit ends the stack


def test_local_metrics_ports_name_every_replica():
    from dflash_app.local_prometheus import metrics_ports, prometheus_config

    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=1)], verifiers=2)
    assert metrics_ports(cfg) == {"gateway": 9450, "verifier0": 9451, "verifier1": 9452,
                                  "drafter0": 9461, "drafter1": 9462}
    jobs = {j["job_name"]: [t["targets"][0] for t in j["static_configs"]]
            for j in prometheus_config(cfg)["scrape_configs"]}
    assert jobs["verifier"] == ["127.0.0.1:9451", "127.0.0.1:9452"]
    assert jobs["drafter"] == ["127.0.0.1:9461", "127.0.0.1:9462"]


# --- the verifier's --drafter-alias ------------------------------------------------------------

def test_drafter_alias_flag_parses_and_refuses_with_the_flag_named(monkeypatch, capsys):
    from verifier_svc.flags import drafter_aliases, parse_args

    monkeypatch.setenv("DFLASH_DRAFTER_ALIASES", "a:1=b:2")
    a = parse_args(["--target", "t", "--drafter-alias", "c:3=d:4"])
    assert drafter_aliases(a) == {"a:1": "b:2", "c:3": "d:4"}
    monkeypatch.delenv("DFLASH_DRAFTER_ALIASES")
    for bad in ("a:1", "a:1=b", "=b:2"):
        with pytest.raises(SystemExit):
            parse_args(["--target", "t", "--drafter-alias", bad])
        assert "--drafter-alias" in capsys.readouterr().err


def test_a_named_drafter_is_dialed_at_its_alias(stack, make_drafter, tiny_target):
    """CheckDrafter and Generate name an address where nothing listens; the verifier dials
    its alias, a served drafter, and speculates with it."""
    from drafter_svc.engine import DrafterEngine
    from drafter_svc.server import build as build_drafter
    from verifier_svc.servicer import DrafterPool

    rt = build_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target),
                       "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    (free,) = free_ports(1)
    named, dialed = f"127.0.0.1:{free}", f"127.0.0.1:{rt.port}"
    v = stack.verifier_stub()
    try:
        with pytest.raises(grpc.RpcError) as e:          # no alias: nothing answers there
            v.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=named), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        stack.verifier.servicer.pool = DrafterPool(stack.engine, aliases={named: dialed})
        stack.verifier.servicer.require_registered = True
        card = v.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=named), timeout=10).card
        assert card.block_size == 4
        assert stack.verifier.servicer.registered_drafters() == {named}
        spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address=named)
        ids, last = generate_ids(v, [1, 2, 3, 4], max_tokens=12, ignore_eos=True, speculation=spec)
        assert len(ids) == 12 and last.stats.drafts > 0
        assert stack.verifier.servicer.pool.get(named).address == dialed
    finally:
        stack.verifier.servicer.pool.close()
        rt.server.stop(0)


# --- the stack, on tiny models -----------------------------------------------------------------

def _counter(url: str, name: str) -> float:
    """The sum of ``name``'s samples (every label set) at a /metrics URL."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


@pytest.mark.slow
def test_two_local_replicas_serve_behind_one_gateway(tmp_path, tiny_target, make_drafter):
    from dflash.client import GatewayClient, build_request

    ver, dr = free_run(2), free_run(2)
    gw, admin, *metrics = free_ports(7)
    names = ["gateway", "verifier0", "verifier1", "drafter0", "drafter1"]
    cfg = StackConfig(target=str(tiny_target),
                      drafters=[DrafterSpec(path=str(make_drafter(block_size=8)), port=dr)],
                      gateway_port=gw, verifier_port=ver, admin_port=admin,
                      run_dir=str(tmp_path / "up"), health_timeout_s=120, verifiers=2,
                      metrics_ports=dict(zip(names, metrics)))
    with LocalStack(cfg) as stack:
        serving = [line for line in (stack.run_dir / "gateway.log").read_text().splitlines()
                   if "SERVING on port" in line]
        assert serving, stack.log_tail("gateway")
        assert f"(verifiers {stack.verifier_addrs[0]}, {stack.verifier_addrs[1]}," in serving[-1]
        with GatewayClient(stack.gateway_addr) as c:
            # no load and no shared prefix: the router's tie-break alternates the replicas
            outs = [c.complete(build_request(p, max_tokens=8), timeout=60) for p in ("Hello", "Bye")]
        assert all(o.usage.completion_tokens == 8 and o.acceptance.drafts > 0 for o in outs)
        port = cfg.metrics_ports
        for r in range(2):   # each replica served one, speculating with its own drafter
            assert _counter(f"http://127.0.0.1:{port[f'verifier{r}']}/metrics",
                            "dflash_spec_decode_num_drafts_total") > 0, r
            assert _counter(f"http://127.0.0.1:{port[f'drafter{r}']}/metrics",
                            "dflash_drafter_items_total") > 0, r
