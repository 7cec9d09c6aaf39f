"""The concurrency sweep's figures (dflash_app.bench_load): definitions, table, plot."""

from __future__ import annotations

import types

import pytest

from dflash_app import bench_load


def row(tokens, ttft, latency, itl, drafts=0, accepted=0, per_pos=()):
    return {"tokens": tokens, "ttft_s": ttft, "latency_s": latency, "itl_s": itl, "drafts": drafts,
            "draft_tokens": 3 * drafts, "accepted": accepted, "accepted_per_position": list(per_pos)}


def test_summarize_definitions():
    rows = [row(10, 0.1, 1.0, [0.1] * 9, drafts=4, accepted=6, per_pos=(4, 2)),
            row(20, 0.3, 2.0, [0.05] * 19, drafts=6, accepted=3, per_pos=(3, 0))]
    x = bench_load.summarize(rows, 2.5, mode="fixed", concurrency=2)
    assert x["agg_tok_s"] == pytest.approx(30 / 2.5)
    assert x["req_tok_s"] == pytest.approx(10.0)
    assert x["tau"] == pytest.approx(1 + 9 / 10)
    assert x["ttft_ms_p50"] == pytest.approx(200)
    assert x["itl_ms_p50"] == pytest.approx(50)


def test_itl_spreads_each_gap_over_the_tokens_of_its_delta():
    c = types.SimpleNamespace(token_times=[0.1, 0.3, 0.4], delta_tokens=[1, 4, 1],
                              usage=types.SimpleNamespace(completion_tokens=6))
    assert bench_load._delta_tokens(c) == [4, 1]


def test_each_speculative_cell_is_compared_with_off_at_its_concurrency_and_round():
    """Slot by slot against the off cell of the same concurrency and round only; a difference is
    named in the table's column and listed with its gap from the probe."""
    def cell(mode, c, rep, outputs):
        x = bench_load.summarize([row(10, 0.1, 1.0, [0.1])], 1.0, mode=mode, concurrency=c)
        return {**x, "repeat": rep, "outputs": outputs}

    levels = [cell("off", 2, 0, {"0": [1, 2], "1": [3, 4]}), cell("fixed", 2, 0, {"0": [1, 2], "1": [3, 9]}),
              cell("off", 2, 1, {"0": [1, 2], "1": [3, 9]}), cell("fixed", 2, 1, {"0": [1, 2], "1": [3, 9]}),
              cell("fixed", 4, 0, {"0": [1, 2]})]                    # no off cell at c=4
    probed = []

    def probe(t, n):
        probed.append((t, n))
        ids = [3, 4][:n]
        return ids, [types.SimpleNamespace(token_id=i, logprob=-1.0, top_ids=[i, 9], top_logprobs=[-1.0, -1.5])
                     for i in ids]

    bench_load.identical_to_off(levels, probe, near_tie=0.125)
    assert probed == [("1", 2)]
    d = levels[1]["identical_to_off"]
    assert (d["identical"], d["total"], d["differs"]) == (1, 2, 1)
    assert d["differences"][0]["position"] == 1 and d["differences"][0]["gap"] == pytest.approx(0.5)
    assert levels[3]["identical_to_off"]["identical"] == 2 and "identical_to_off" not in levels[4]
    md = bench_load.markdown(levels)
    assert "| 3/4 |" in md                               # c=2 fixed: both rounds summed
    assert "- c=2 fixed round 0 1: first difference at token 1: off 4, speculation 9: DIFFERS: gap 0.5" in md


def test_table_and_plot(tmp_path):
    levels = [bench_load.summarize([row(10, 0.1, 1.0, [0.1])], w, mode=m, concurrency=c)
              for c in (1, 4) for m, w in (("off", 2.0), ("fixed", 1.0), ("adaptive", 0.9))]
    md = bench_load.markdown(levels)
    assert md.count("\n| ") == 6          # one row per (concurrency, mode)
    assert "c=1: adaptive 1.11x the better of the others (fixed)" in md
    bench_load.plot(levels, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000


def test_repeats_show_means_ranges_and_spread(tmp_path):
    """With --repeats the table gives the mean and range of each cell and the verdict carries
    the run-to-run spread it has to clear."""
    levels = []
    for rep, (w_off, w_ad) in enumerate(((2.0, 1.9), (1.6, 2.1))):
        for m, w in (("off", w_off), ("fixed", 4.0), ("adaptive", w_ad)):
            x = bench_load.summarize([row(20, 0.1, 1.0, [0.1])], w, mode=m, concurrency=8)
            x["repeat"] = rep
            levels.append(x)
    md = bench_load.markdown(levels)
    assert md.count("\n| ") == 3                               # one row per (concurrency, mode)
    off = (20 / 2.0 + 20 / 1.6) / 2
    ad = (20 / 1.9 + 20 / 2.1) / 2
    assert f"| 8 | off | {off:.1f} (10.0–12.5) |" in md
    assert f"c=8: adaptive {ad / off:.2f}x the better of the others (off)" in md
    spread_off = (12.5 - 10.0) / 2 / off
    assert f"spread ±{100 * (20 / 1.9 - 20 / 2.1) / 2 / ad:.0f}% / ±{100 * spread_off:.0f}%" in md
    # paired within each round: round 0 adaptive 20/1.9 vs off 20/2.0, round 1 20/2.1 vs 20/1.6
    assert f"per round {2.0 / 1.9:.2f}x / {1.6 / 2.1:.2f}x" in md
    bench_load.plot(levels, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000


@pytest.mark.slow
def test_sweep_cli_on_a_tiny_stack(tmp_path):
    """`dflash bench --start --tiny --concurrency ... --repeats 2` end to end: every cell runs
    twice, each client sends at least --requests-per-client requests, the stack is stopped, the
    three outputs are written."""
    import json
    import subprocess
    import sys

    from helpers import free_ports

    gw, ver, dr = free_ports(3)
    out = subprocess.run(
        [sys.executable, "-m", "dflash_app.cli", "bench", "--start", "--tiny", "--concurrency", "1,2",
         "--requests", "2", "--requests-per-client", "2", "--max-tokens", "6", "--limit", "2",
         "--repeats", "2",
         "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "logs"),
         "--gateway-port", str(gw), "--verifier-port", str(ver), "--drafter-port", str(dr)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "load.json").read_text())
    cells = sorted((x["concurrency"], x["mode"], x["repeat"]) for x in res["levels"])
    assert cells == sorted((c, m, r) for c in (1, 2) for m in ("off", "fixed", "adaptive") for r in (0, 1))
    assert all(x["tokens"] > 0 and x["requests"] == 2 * x["concurrency"] for x in res["levels"])
    assert res["config"]["requests_per_client"] == 2
    md = (tmp_path / "out" / "load.md").read_text()
    assert "run-to-run spread" in md and (tmp_path / "out" / "load.png").exists()
    # every speculative request against off's in its slot, same concurrency and round
    same = [(x["concurrency"], x["identical_to_off"]) for x in res["levels"] if x["mode"] != "off"]
    assert len(same) == 8 and all(d["total"] == 2 * c for c, d in same)
    assert all(d["identical"] == d["total"] for _, d in same), same
    assert "| greedy identical to off |" in md and "| 2 | fixed |" in md and "| 4/4 |" in md
    for log in (tmp_path / "logs").iterdir():
        assert "stopped" in log.read_text(), log.name


@pytest.mark.slow
def test_humaneval_bench_cli_interleaves_modes(tmp_path):
    """`dflash bench --start --tiny --spec-modes fixed,adaptive --peer`: every prompt runs through
    every mode (and the in-process peer) before the next prompt starts, so a drift in the
    machine's speed lands on all modes alike; outputs and the identical-to-off counts are written."""
    import json
    import subprocess
    import sys

    from helpers import free_ports

    gw, ver, dr = free_ports(3)
    out = subprocess.run(
        [sys.executable, "-m", "dflash_app.cli", "bench", "--start", "--tiny", "--limit", "3",
         "--max-tokens", "6", "--spec-modes", "fixed,adaptive", "--peer",
         "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "logs"),
         "--gateway-port", str(gw), "--verifier-port", str(ver), "--drafter-port", str(dr)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    modes = set(res["rows"])
    assert modes == {"spec[fixed]", "spec[adaptive]", "off", "peer"}
    runs = sorted((r["t_start_s"], r["task_id"], m) for m, rs in res["rows"].items() for r in rs)
    tasks = [t for _, t, _ in runs]
    assert len(runs) == 3 * len(modes)
    assert tasks == sorted(tasks, key=tasks.index) and len(set(tasks[:4])) == 1, runs
    firsts = [[m for _, t, m in runs if t == task][0] for task in dict.fromkeys(tasks)]
    assert len(set(firsts)) == 3, f"mode order not rotated per prompt: {firsts}"
    assert res["lossless"] == {"spec[fixed]": 3, "spec[adaptive]": 3, "peer": 3}
    assert {m: (c["identical"], c["total"], c["differences"]) for m, c in res["identical_to_off"].items()} \
        == {m: (3, 3, []) for m in ("spec[fixed]", "spec[adaptive]", "peer")}
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "greedy outputs identical to speculation-off: spec[fixed] 3/3, spec[adaptive] 3/3, peer 3/3" in md
    assert "| speedup vs off | greedy identical to off |" in md and (tmp_path / "out" / "bench.png").exists()


@pytest.mark.parametrize("flags, flag", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "-2"], "--concurrency"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "1,1"], "--concurrency"),
    (["--spec-modes", ""], "--spec-modes"),
    (["--spec-modes", "off,bogus"], "--spec-modes"),
    (["--spec-modes", "off,off"], "--spec-modes"),
    (["--spec-modes", "fixed:4"], "--spec-modes"),
    (["--spec-modes", "adaptive:0"], "--spec-modes"),
    (["--spec-modes", "tree:65"], "--spec-modes"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "-1"], "--repeats"),
    (["--requests", "0"], "--requests"),
    (["--requests-per-client", "0"], "--requests-per-client"),
    (["--limit", "0"], "--limit"),
    (["--near-tie-gap", "0"], "--near-tie-gap"),
    (["--near-tie-gap", "x"], "--near-tie-gap"),
])
def test_bench_refuses_bad_flags_naming_them(flags, flag, capsys):
    """Each of these crashed with a traceback mid-run (ZeroDivisionError, IndexError) or was
    silently changed (--repeats 0 ran once; duplicate levels or modes merged into one row as if
    repeated): refused before anything runs, naming the flag."""
    from dflash_app import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--gateway", "127.0.0.1:1", *flags])
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_bench_flag_lists_are_normalised():
    from dflash.serving.argtypes import choice_list, int_list

    assert int_list(1)(" 1, 2,4 ") == "1,2,4" and int_list(1)("") == ""
    assert choice_list(bench_load.MODES)("off, adaptive") == "off,adaptive"
    from dflash_app.bench import mode_list, split_mode

    assert mode_list("off, adaptive:1,adaptive, tree:8") == "off,adaptive:1,adaptive,tree:8"
    assert split_mode("adaptive:1") == ("adaptive", 1) and split_mode("adaptive") == ("adaptive", 0)


def test_bench_without_a_gateway_says_so():
    """A forgotten `dflash up` printed a traceback per client thread and ended in IndexError."""
    from dflash_app.bench import require_gateway

    from helpers import free_ports

    (port,) = free_ports(1)
    with pytest.raises(SystemExit, match=rf"--gateway 127.0.0.1:{port}: no gateway answered"):
        require_gateway(f"127.0.0.1:{port}", timeout_s=0.5)
