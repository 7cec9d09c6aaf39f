"""scripts/bench_replicas.py: its figures from made-up samples and streams (the drain's routing
counts against the mark and the health period, the failover's identity and resume gaps, the
routing ratio), its flags, and one smoke run on tiny models that starts the real stack, drains
a replica and kills one. No timing is asserted (the figures are for docs/bench)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_replicas.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_replicas", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_drain_counts_what_went_to_the_drained_replica_after_the_period(bench):
    samples = [(9.9, {"a": 5, "b": 5}), (10.05, {"a": 5, "b": 6}), (10.5, {"a": 6, "b": 7}),
               (11.2, {"a": 8, "b": 7}), (12.0, {"a": 10, "b": 7})]
    d = bench.drain_summary(samples, 10.0, 1.0, "b", "a")
    assert d == {"routed_to_drained_after_period": 0, "routed_to_drained_after_mark": 2,
                 "last_routed_to_drained_s": pytest.approx(0.5), "routed_to_other_after_mark": 5}
    # one more, seen 2.5 s after the mark: past the period (and its poll)
    d = bench.drain_summary(samples + [(12.5, {"a": 10, "b": 8})], 10.0, 1.0, "b", "a")
    assert d["routed_to_drained_after_period"] == 1
    assert d["last_routed_to_drained_s"] == pytest.approx(2.5)
    # nothing went there after the mark
    d = bench.drain_summary([(9.0, {"a": 1, "b": 3}), (11.0, {"a": 4, "b": 3})], 10.0, 1.0, "b", "a")
    assert d["last_routed_to_drained_s"] is None and d["routed_to_drained_after_mark"] == 0


def test_failover_compares_with_the_reference_and_times_each_resume(bench):
    S = bench.Stream
    ref = [S(ids=[1, 2, 3, 4], finish="length"), S(ids=[5, 6, 7, 8], finish="length"),
           S(ids=[9, 9], finish="stop"), S(ids=[1, 1, 1], finish="length")]
    run = [S(ids=[1, 2, 3, 4], times=[1.0, 1.1, 1.6, 1.7], resumes=1, finish="length"),
           S(ids=[5, 6, 7, 8], times=[0.9, 1.15, 1.3, 1.4], resumes=1, finish="length"),
           S(ids=[9, 8], times=[0.5, 0.6], finish="stop"),          # differs, not moved
           S(ids=[1], error="UNAVAILABLE: verifier: no replica available")]
    f = bench.failover_summary(ref, run, t_kill=1.2)
    assert (f["streams"], f["failed"], f["resumed"], f["identical"]) == (4, 1, 2, 2)
    assert f["failures"] == ["UNAVAILABLE: verifier: no replica available"]
    assert [d["stream"] for d in f["differences"]] == [2, 3]
    assert f["differences"][0]["first_difference"] == 1
    assert f["differences"][1]["first_difference"] == 1        # shorter: differs where it ends
    assert f["resume_gap_s"] == pytest.approx([0.5, 0.15])     # 1.1 -> 1.6, 1.15 -> 1.3
    assert f["resume_gap_p50_s"] == pytest.approx(0.325) and f["resume_gap_max_s"] == pytest.approx(0.5)
    assert f["kill_to_next_token_max_s"] == pytest.approx(0.4)
    assert bench.failover_summary(ref, run, None)["resume_gap_p50_s"] is None    # never killed


def _workload(cached: list[list[int]], prompt: int = 100, ids=(1, 2)) -> dict:
    rows = [[{"cached_tokens": c, "prompt_tokens": prompt, "token_ids": list(ids), "ttft_s": 0.1,
              "decode_tok_s": 10.0, "tau": 2.0} for c in turn] for turn in cached]
    return {"workload": "multiturn", "arms": ["cache"], "turns": len(rows), "rows": {"cache": rows}}


def test_routing_ratio_is_cached_tokens_against_one_replica(bench):
    res = {"score": _workload([[0, 0], [90, 80]]), "round-robin": _workload([[0, 0], [40, 0]], ids=(3,)),
           "one": _workload([[0, 0], [90, 90]])}
    r = bench.routing_summary(res, {"score": {"a": 2, "b": 2}})
    assert r["score"]["ratio_to_one"] == pytest.approx(170 / 180)
    assert r["round-robin"]["ratio_to_one"] == pytest.approx(40 / 180)
    assert [t["cached_share"] for t in r["one"]["turns"]] == [0.0, 0.9]
    assert r["score"]["identical_to_one"] == 4 and r["round-robin"]["identical_to_one"] == 0
    assert r["score"]["requests"] == {"a": 2, "b": 2} and r["one"]["requests"] == {}


def test_the_report_says_which_targets_are_met(bench):
    S = bench.Stream
    ref = [S(ids=[1, 2], finish="length")] * 2
    run = [S(ids=[1, 2], times=[1.0, 2.0], resumes=1, finish="length"), S(ids=[1, 2], finish="length")]
    fo = {**bench.failover_summary(ref, run, 1.5), "killed": "verifier1", "kill_at_tokens": 1,
          "reference_tokens": 4, "requests_reference": {"a": 1, "b": 1},
          "requests_killed_run": {"a": 2, "b": 1}}
    dr = {"requests": 12, "failed": 0, "requests_after_period": 8, "health_period_s": 1.0,
          "poll_s": 0.05, "drained": "b", "routed_to_drained_after_period": 1,
          "routed_to_drained_after_mark": 3, "last_routed_to_drained_s": 1.4,
          "routed_to_other_after_mark": 9}
    ro = bench.routing_summary({"score": _workload([[0], [95]]), "round-robin": _workload([[0], [10]]),
                                "one": _workload([[0], [100]])}, {})
    cfg = {"tiny": True, "target": "t", "commit": "abc", "host": {"cpus": 2, "machine": "x86_64"},
           "max_tokens": 8, "conversations": 1, "turns": 2, "streams": 2, "drain_rounds": 2}
    md = bench.markdown({"config": cfg, "routing": ro, "drain": dr, "failover": fo})
    assert "| cached tokens, two replicas / one >= 90% | score 95.0% (round-robin 10.0%) | met |" in md
    assert "| replica killed: 0 failed | 0 of 2 (1 resumed) | met |" in md
    assert "| every greedy stream identical to an uninterrupted run | 2/2 | met |" in md
    assert "| time to resume (reported) | p50 1.000 s, max 1.000 s | - |" in md
    assert "| drained: nothing new after one health period (1 s) | 1 | **not met** |" in md
    assert md.count("\n| 2 | 100 | 100.0% | 95.0% | 10.0% |") == 1


def test_flags_take_the_tiny_defaults_and_refuse_a_bad_kill_point(bench, capsys):
    a = bench.parse_args(["--out", "x", "--tiny"])
    assert (a.conversations, a.turns, a.max_tokens, a.streams, a.drain_rounds) == (3, 3, 32, 4, 3)
    a = bench.parse_args(["--out", "x", "--streams", "8"])
    assert (a.conversations, a.turns, a.max_tokens, a.streams, a.drain_rounds) == (9, 6, 128, 8, 2)
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x", "--kill-at", bad])
        assert "--kill-at" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_on_tiny_models(tmp_path, tiny_target, make_drafter):
    """--tiny end to end: every phase ran on the real processes; nothing failed, a killed
    replica's streams resumed on the other one identically, the drained one was left alone."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--target", str(tiny_target),
         "--drafter", str(make_drafter(block_size=8)), "--conversations", "3", "--turns", "3",
         "--max-tokens", "48", "--streams", "4", "--out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "replicas.json").read_text())
    assert "| target | measured | verdict |" in (out / "replicas.md").read_text()
    ro = res["routing"]
    assert ro["one"]["cached_tokens"] > 0 and ro["score"]["ratio_to_one"] is not None
    assert ro["score"]["identical_to_one"] == ro["round-robin"]["identical_to_one"] == 9
    assert sorted(ro["round-robin"]["requests"].values()) == [4, 5]   # 9 requests in turn
    assert list(ro["one"]["requests"].values()) == [9]
    dr = res["drain"]
    assert dr["failed"] == 0 and dr["requests_after_period"] >= 12
    assert dr["routed_to_other_after_mark"] > dr["routed_to_drained_after_mark"]
    fo = res["failover"]
    # the replica serving most of the streams was the one killed, so some had to move
    assert fo["killed"] in ("verifier0", "verifier1") and fo["reference_failed"] == 0
    assert fo["requests_killed_run"][fo["killed_address"]] >= 2, fo
    assert fo["failed"] == 0 and fo["identical"] == 4 and fo["resumed"] >= 1
    assert fo["resume_gap_p50_s"] is not None
