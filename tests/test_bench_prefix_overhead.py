"""scripts/bench_prefix_overhead.py and its figures (dflash_app.bench_overhead): the memory
run's prompts, KV size and RSS bound, the summaries of made-up rounds and samples and the
verdicts they print, its flags, and one smoke run on tiny models that starts the real stacks
(a replica with the cache on, one with it off; a verifier under a tiny --prefix-cache-mb). No
timing is asserted (the figures are for docs/bench)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_app import bench_overhead as report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_prefix_overhead.py"
MIB = 1 << 20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_overhead", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_memory_prompts_are_random_ids_of_the_lengths_and_tenants_asked():
    ps = report.memory_prompts(400, vocab=50, lo=20, hi=40, tenants=3, reuse=0.5, seed=1)
    assert ps == report.memory_prompts(400, vocab=50, lo=20, hi=40, tenants=3, reuse=0.5, seed=1)
    assert [t for t, _ in ps[:6]] == [0, 1, 2, 0, 1, 2]
    assert all(20 <= len(ids) <= 40 and all(0 <= x < 50 for x in ids) for _, ids in ps)
    assert {len(ids) for _, ids in ps} == set(range(20, 41))

    def shares(ps) -> int:      # prompts starting with >= 8 tokens of an earlier one of their tenant
        return sum(any(ids[:8] == q[:8] for u, q in ps[:i] if u == t) for i, (t, ids) in enumerate(ps))

    assert shares(report.memory_prompts(400, vocab=50, lo=20, hi=40, tenants=3, reuse=0.0, seed=1)) == 0
    assert shares(ps) > 40


def test_kv_bytes_per_token_is_the_pools(tiny_target, target_model):
    from verifier_svc.prefix_reuse import kv_bytes_per_token

    dtype = str(target_model.pool.dtype).replace("torch.", "")
    assert report.kv_bytes_per_token(str(tiny_target), dtype) == kv_bytes_per_token(target_model.pool)


def test_the_rss_bound_adds_the_pool_the_cache_and_the_slack():
    b = report.memory_bound(start_rss=100 * MIB, kv_per_token=1000, clients=4, positions=513,
                            cache_mb=64, slack_mb=256)
    # rows 4 + 2 + 1; capacity: 1.25 x (513 + 256) = 961.25 -> 4 x 256 = 1024; twice while growing
    assert (b["pool_rows"], b["pool_capacity"], b["kv_pool"]) == (7, 1024, 2 * 7 * 1024 * 1000)
    assert b["total"] == 100 * MIB + 14_336_000 + 64 * MIB + 256 * MIB


def _round(wall: float, ids: list[list[int]], *, tokens: int = 10, cached: int = 0, error: str = "") -> dict:
    return {"wall_s": wall, "rows": [{"ids": x, "tokens": tokens, "cached": cached, "drafts": 4,
                                      "accepted": 6, "error": error} for x in ids]}


def test_throughput_summary_takes_medians_and_compares_the_arms_prompt_by_prompt():
    ids = [[1, 2], [3, 4]]
    res = {"1": {"on": [_round(2.0, ids), _round(4.0, ids), _round(5.0, ids)],
                 "off": [_round(2.0, ids), _round(2.0, [[1, 2], [9]]), _round(8.0, ids)]},
           "8": {"on": [_round(1.0, ids, cached=3)], "off": [_round(1.0, ids, error="UNAVAILABLE: x")]}}
    s = report.throughput_summary(res)
    one = s["1"]
    assert one["on"]["tok_s"] == [10.0, 5.0, 4.0] and one["on"]["tok_s_median"] == 5.0
    assert one["off"]["tok_s_median"] == 10.0 and one["ratio"] == 0.5
    assert (one["identical"], one["compared"]) == (5, 6)
    assert one["on"]["tau"] == pytest.approx(1 + 36 / 24)
    eight = s["8"]
    assert eight["identical"] == 0 and eight["off"]["failed"] == 2 and eight["on"]["cached_tokens"] == 6
    md = report.markdown({"config": _config(), "throughput": s})
    assert "| unique prompts, 1 clients: tokens/s cache on / off >= 0.98 | 0.500 | **not met** |" in md
    assert "| unique prompts, 1 clients: greedy identical | 5/6 | **not met** |" in md
    assert "| 1 | 5.00 (10.00, 5.00, 4.00) | 10.00 (10.00, 10.00, 2.50) | 0.500 | 5/6 |" in md
    assert report.MULTITURN in md and "--spec-modes fixed" in report.MULTITURN


def _config() -> dict:
    return {"tiny": True, "target": "t", "commit": "abc", "cores": 2, "machine": "x86_64",
            "mode": "fixed", "limit": 2, "max_tokens": 8, "prompts": "humaneval", "rounds": 3,
            "threads_per_replica": 1, "shared_tenant": False}


def _memory(samples: list[tuple[int, int]], *, peak=None, failed: int = 0) -> dict:
    raw = {"samples": [{"requests": i * 10, "rss": rss, "bytes": cache, "pinned_bytes": 0,
                        "entries": 3, "tokens": 100, "evictions_total": i, "drafter_rss": None}
                       for i, (rss, cache) in enumerate(samples)],
           "failed": failed, "errors": ["RESOURCE_EXHAUSTED: x"] * failed, "hit_requests": 1,
           "hit_tokens": 16, "peak_rss": peak, "requests": 30, "min_len": 32, "max_len": 512,
           "tenants": 4, "reuse": 0.25, "clients": 2, "sample_every": 10, "prefix_cache_mb": 2.0,
           "bound": report.memory_bound(start_rss=50 * MIB, kv_per_token=1000, clients=2,
                                        positions=513, cache_mb=2, slack_mb=10)}
    return report.memory_summary(raw, 2.0)


def test_memory_checks_catch_rss_over_the_bound_a_cache_over_its_bound_and_refusals():
    ok = _memory([(50 * MIB, 0), (60 * MIB, 2 * MIB), (61 * MIB, MIB)], peak=62 * MIB)
    assert ok["checks"] == {"rss_under_bound": True, "cache_under_bound": True, "none_refused": True}
    assert (ok["max_rss"], ok["rss_growth"], ok["evictions"]) == (61 * MIB, 11 * MIB, 2)
    md = report.markdown({"config": _config(), "memory": ok})
    assert "| memory: cache bytes <= --prefix-cache-mb (2 MiB) | max 2.0 MiB | met |" in md
    assert "| memory: 0 refused | 0 of 30 | met |" in md
    high = _memory([(50 * MIB, 0)], peak=ok["bound"]["total"] + 1)          # the high-water mark
    assert high["checks"]["rss_under_bound"] is False
    assert _memory([(50 * MIB, 2 * MIB + 1)])["checks"]["cache_under_bound"] is False
    bad = _memory([(50 * MIB, 0)], failed=2)
    assert bad["checks"]["none_refused"] is False
    assert "| memory: 0 refused | 2 of 30 | **not met** |" in report.markdown({"config": _config(),
                                                                               "memory": bad})


def test_flags_take_the_tiny_defaults_and_refuse_bad_values(bench, capsys):
    a = bench.parse_args(["--out", "x", "--tiny"])
    assert (a.limit, a.max_tokens, a.concurrency, a.rounds, a.requests, a.prefix_cache_mb, a.mode) == \
        (4, 16, "1,4", 2, 200, 2.0, "fixed")
    a = bench.parse_args(["--out", "x", "--mode", "adaptive"])
    assert (a.limit, a.max_tokens, a.concurrency, a.rounds, a.requests, a.prefix_cache_mb, a.mode) == \
        (20, 128, "1,8", 3, 10000, 64.0, "adaptive")
    for bad, flag in ((["--mode", "off"], "--mode"), (["--mode", "nope"], "--mode"),
                      (["--reuse", "1.5"], "--reuse"), (["--min-len", "600"], "--min-len")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x", *bad])
        assert flag in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_on_tiny_models(tmp_path, tiny_target, make_drafter):
    """--tiny end to end: both arms answered every prompt identically, the cache never hit a
    unique prompt; the memory run evicted under pressure, kept the cache within its bound and
    the verifier within the RSS bound, and refused nothing."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--target", str(tiny_target),
         "--drafter", str(make_drafter(block_size=8)), "--out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "overhead.json").read_text())
    assert "| target | measured | verdict |" in (out / "overhead.md").read_text()
    assert list(res["throughput"]) == ["1", "4"]
    for level in res["throughput"].values():
        assert level["compared"] == 4 * 2 and level["identical"] == level["compared"]
        assert level["on"]["failed"] == level["off"]["failed"] == 0
        assert level["on"]["cached_tokens"] == level["off"]["cached_tokens"] == 0
        assert level["ratio"] is not None and level["on"]["tau"] is not None
    m = res["memory"]
    assert m["failed"] == 0 and m["checks"] == {"rss_under_bound": True, "cache_under_bound": True,
                                                "none_refused": True}
    assert len(m["samples"]) == 200 // 20 + 1 and m["samples"][-1]["requests"] == 200
    assert 0 < m["max_cache_bytes"] <= 2 * MIB and m["evictions"] > 0
    assert m["bytes_per_cached_position"] >= m["kv_bytes_per_token"]
    assert m["max_rss"] <= m["bound"]["total"]
