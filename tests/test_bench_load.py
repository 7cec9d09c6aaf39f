"""The concurrency sweep's figures (dflash.bench_load): definitions, table, plot."""

from __future__ import annotations

import types

import pytest

from dflash import bench_load


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


def test_table_and_plot(tmp_path):
    levels = [bench_load.summarize([row(10, 0.1, 1.0, [0.1])], w, mode=m, concurrency=c)
              for c in (1, 4) for m, w in (("off", 2.0), ("fixed", 1.0), ("adaptive", 0.9))]
    md = bench_load.markdown(levels)
    assert md.count("\n| ") == 6          # one row per (concurrency, mode)
    assert "c=1: adaptive 1.11x the better of the others" in md
    bench_load.plot(levels, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000
