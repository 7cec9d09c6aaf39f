"""dflash.serving.threads: one multi-threaded torch thread per process (libgomp throttles every team's
busy-wait once a process holds more OpenMP threads than CPUs)."""

import subprocess
import sys
import threading

import pytest

_SCRIPT = r"""
import threading, torch
from dflash.serving.threads import claim, reserve
n = reserve(3)
seen = {"main_after_reserve": torch.get_num_threads()}
def compute():
    claim(n)
    torch.ones(1 << 17).add_(1)                      # a parallel region on this thread
    seen["compute"] = torch.get_num_threads()
    done.set(); stop.wait()
    seen["compute_later"] = torch.get_num_threads()
done, stop = threading.Event(), threading.Event()
t = threading.Thread(target=compute); t.start(); done.wait()
other = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
other.start(); other.join()
stop.set(); t.join()
seen["main"] = torch.get_num_threads()
print(seen)
"""


def test_claim_gives_one_thread_the_threads_and_every_other_one():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert eval(out) == {"main_after_reserve": 1, "compute": 3, "other": 1, "compute_later": 3,
                         "main": 1}


def test_claim_rejects_zero():
    from dflash.serving.threads import claim

    with pytest.raises(ValueError, match="threads"):
        claim(0)


def test_drafter_engine_drafts_on_its_compute_thread(tiny_target, make_drafter, monkeypatch):
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    d = DrafterEngine.from_pretrained(make_drafter(), tiny_target)
    names = []
    real = d._draft_blocks
    monkeypatch.setattr(d, "_draft_blocks",
                        lambda items: names.append(threading.current_thread()) or real(items))
    import torch

    req = ProposalRequest(session_id="s", context_start=0,
                          context=torch.zeros(3, d.cfg.context_size), anchor_token=1,
                          block_size=4, sampling=Sampling())
    caller = []
    t = threading.Thread(target=lambda: caller.append(d.propose([req])))
    t.start()
    t.join()
    assert caller[0][0].tokens.numel() == 3
    assert names and all(th.name.startswith("drafter-compute") for th in names)
    assert all(th.is_alive() for th in names)
    d.close()                                 # the compute thread ends with the engine
    assert not any(th.is_alive() for th in names)
    with pytest.raises(RuntimeError):
        d.propose([req])


def test_context_only_calls_run_on_context_threads(tiny_target, make_drafter, monkeypatch):
    """A call whose items only carry context (the verifier's updates it does not wait for) runs
    on the context thread with ``context_threads`` torch threads at SCHED_IDLE; a call with a
    block to draft, on the compute thread with the engine's drafting threads."""
    import os

    import torch

    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    def req(start, rows, block):
        return ProposalRequest(session_id="s", context_start=start,
                               context=torch.randn(rows, d.cfg.context_size), anchor_token=1,
                               block_size=block, sampling=Sampling())

    for sched, policy in (("idle", os.SCHED_IDLE), ("normal", os.sched_getscheduler(0))):
        d = DrafterEngine.from_pretrained(make_drafter(), tiny_target, threads=2,
                                          context_threads=1, context_sched=sched)
        seen = []
        real = d.drafter.context_kv
        monkeypatch.setattr(d.drafter, "context_kv", lambda *a, seen=seen, real=real: seen.append(
            (threading.current_thread().name.split("_")[0], torch.get_num_threads(),
             os.sched_getscheduler(0))) or real(*a))
        try:
            assert not isinstance(d.propose([req(0, 3, 1)])[0], Exception)
            assert len(d.propose([req(3, 2, 4)])[0].tokens) == 3
            assert not isinstance(d.propose([req(5, 2, 1)])[0], Exception)
            assert [(n, t) for n, t, _ in seen] == [("drafter-context", 1), ("drafter-compute", 2),
                                                    ("drafter-context", 1)]
            assert seen[0][2] == seen[2][2] == policy
            assert d.cached_tokens == 7
        finally:
            d.close()
    with pytest.raises(ValueError, match="context_threads"):
        DrafterEngine.from_pretrained(make_drafter(), tiny_target, context_threads=-1)
    with pytest.raises(ValueError, match="context_sched"):
        DrafterEngine.from_pretrained(make_drafter(), tiny_target, context_sched="realtime")


def test_context_threads_zero_runs_context_calls_on_the_compute_thread(tiny_target, make_drafter,
                                                                       monkeypatch):
    import torch

    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    d = DrafterEngine.from_pretrained(make_drafter(), tiny_target, context_threads=0)
    names = []
    real = d.drafter.context_kv
    monkeypatch.setattr(d.drafter, "context_kv",
                        lambda *a: names.append(threading.current_thread().name) or real(*a))
    try:
        d.propose([ProposalRequest(session_id="s", context_start=0,
                                   context=torch.randn(3, d.cfg.context_size), anchor_token=1,
                                   block_size=1, sampling=Sampling())])
        assert len(names) == 1 and names[0].startswith("drafter-compute")
    finally:
        d.close()


def test_context_sched_flag_checks_the_environment_too(monkeypatch):
    from drafter_svc.server import parse_args

    assert parse_args(["--drafter", "d", "--target", "t"]).context_sched == "idle"
    assert parse_args(["--drafter", "d", "--target", "t", "--context-sched", "normal"]).context_sched == "normal"
    monkeypatch.setenv("DFLASH_CONTEXT_SCHED", "fifo")
    with pytest.raises(SystemExit):
        parse_args(["--drafter", "d", "--target", "t"])


def test_context_flush_below_one_is_refused(tiny_target):
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.server import parse_args
    from verifier_svc.target import TargetModel

    with pytest.raises(ValueError, match="context_flush"):
        VerifierEngine(TargetModel(tiny_target), context_flush=0)
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--context-flush", "0"])


def test_verifier_flags_default_to_adaptive_and_bound_unread_events(monkeypatch, capsys):
    """A new user's first run speculates adaptively (fixed blocks of 16 run slower than no
    speculation at batch 1 on a CPU); the unread-event bound is a flag with its env var and a
    value below 1 is refused naming the flag."""
    from verifier_svc.server import parse_args

    monkeypatch.delenv("DFLASH_SPEC_MODE", raising=False)
    a = parse_args(["--target", "t"])
    assert a.spec_mode == "adaptive" and a.max_unread_events == 4096
    monkeypatch.setenv("DFLASH_MAX_UNREAD_EVENTS", "7")
    assert parse_args(["--target", "t"]).max_unread_events == 7
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--max-unread-events", "0"])
    assert "--max-unread-events" in capsys.readouterr().err


def test_default_spin_count_yields_to_the_users_setting():
    from dflash.serving.omp import SPIN_COUNT, default_spin_count

    env = {}
    assert default_spin_count(env) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    mine = {"GOMP_SPINCOUNT": "300000"}
    assert not default_spin_count(mine) and mine == {"GOMP_SPINCOUNT": "300000"}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert not default_spin_count(passive) and passive == {"OMP_WAIT_POLICY": "PASSIVE"}


_ENTRY = r"""
import os, runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("SPIN", os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.slow   # a child process that imports torch and the service: 4-5 s
@pytest.mark.parametrize("service", ["verifier_svc", "drafter_svc"])
def test_services_set_the_spin_count_before_torch_loads(service):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    r = subprocess.run([sys.executable, "-c", _ENTRY, service], capture_output=True, text=True,
                       timeout=120, env=env)
    assert "SPIN 10000" in r.stdout, r.stdout + r.stderr
    assert "after torch was imported" not in r.stderr
