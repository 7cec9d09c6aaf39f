"""Adaptive's regret against the best fixed mode of the same run, the mode race's exploration
read from the verifier's /metrics, and ``dflash bench --sweep`` (dflash_app.bench_regret)."""

from __future__ import annotations

import pytest

from dflash_app import bench_load, bench_regret


def test_regret_is_against_the_best_other_mode_off_included():
    assert bench_regret.regret({"off": 10.0, "suffix": 12.0, "adaptive": 11.4}, "adaptive") == \
        ("suffix", 12.0, pytest.approx(0.95))
    assert bench_regret.regret({"off": 10.0, "fixed": 6.0, "adaptive": 9.0}, "adaptive")[0] == "off"
    assert bench_regret.regret({"adaptive": 9.0}, "adaptive") is None
    line = bench_regret.regret_line({"spec[suffix]": 12.0, "off": 10.0, "spec[adaptive]": 11.4},
                                    "spec[adaptive]")
    assert "0.950x the best fixed mode of this run (spec[suffix], 12.0 tok/s), regret +5.0%" in line


def test_race_delta_and_line():
    before = {"steps": {"adaptive": 10.0}, "explored_steps": 10.0, "explored_seconds": 1.0,
              "seconds": 1.0, "explore_cost_tokens": 0.0, "leaders": {}, "estimates": {}}
    after = {"steps": {"adaptive": 60.0, "off": 40.0}, "explored_steps": 20.0, "explored_seconds": 1.5,
             "seconds": 6.0, "explore_cost_tokens": 12.0, "leaders": {"1": "adaptive", "8": "off"},
             "estimates": {}}
    d = bench_regret.race_delta(before, after)
    assert d["steps"] == {"adaptive": 50.0, "off": 40.0} and d["explored_steps"] == 10.0
    line = bench_regret.race_line(d, 600)
    assert "exploration 11.1% of adaptive's steps, 10.0% of its seconds, cost 12 tokens (+2.0% of " \
           "adaptive's tokens)" in line
    assert "leader per batch bucket: 1: adaptive, 8: off" in line
    assert bench_regret.race_line(None, 5) == ""


def test_sweep_table_and_plot(tmp_path):
    def cell(mode, c, wall, race=None):
        x = bench_load.summarize([{"tokens": 10, "ttft_s": 0.1, "latency_s": 1.0, "itl_s": [0.1],
                                   "drafts": 0, "draft_tokens": 0, "accepted": 0,
                                   "accepted_per_position": []}], wall, mode=mode, concurrency=c)
        return {**x, **({"race": race} if race else {})}

    race = {"steps": {"adaptive": 80.0, "off": 20.0}, "explored_steps": 5.0}
    results = {"chat": [cell("off", 1, 2.0), cell("suffix", 1, 1.0), cell("adaptive", 1, 1.25, race),
                        cell("off", 4, 1.0), cell("suffix", 4, 2.0), cell("adaptive", 4, 0.99)]}
    md = bench_regret.sweep_markdown(results)
    assert "| chat | 1 | suffix | 10.0 | 8.0 | 1.60x | 0.800x | 5% |" in md
    assert "| chat | 4 | off | 10.0 | 10.1 | 1.01x | 1.010x | - |" in md
    bench_regret.sweep_plot(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000


@pytest.mark.slow
def test_sweep_cli_on_a_tiny_stack(tmp_path):
    """`dflash bench --start --tiny --sweep`: every set's cells in its folder, the regret table
    and the plot, and the adaptive cells' race counters from the verifier's /metrics."""
    import json
    import subprocess
    import sys

    from helpers import free_ports

    gw, ver, dr = free_ports(3)
    out = subprocess.run(
        [sys.executable, "-m", "dflash_app.cli", "bench", "--start", "--tiny", "--sweep",
         "--sweep-sets", "chat", "--concurrency", "1,2", "--spec-modes", "off,suffix,adaptive",
         "--requests", "2", "--max-tokens", "6", "--limit", "2",
         "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "logs"),
         "--gateway-port", str(gw), "--verifier-port", str(ver), "--drafter-port", str(dr)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "sweep.json").read_text())
    cells = sorted((x["concurrency"], x["mode"]) for x in res["chat"])
    assert cells == sorted((c, m) for c in (1, 2) for m in ("off", "suffix", "adaptive"))
    races = [x["race"] for x in res["chat"] if x["mode"] == "adaptive"]
    assert all(r is not None and sum(r["steps"].values()) > 0 for r in races), races
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert md.count("| chat |") == 2 and "| 4/4 |" in md
    assert (tmp_path / "out" / "sweep.png").exists() and (tmp_path / "out" / "chat" / "load.json").exists()
