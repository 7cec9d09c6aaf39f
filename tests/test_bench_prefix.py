"""``dflash bench --workload`` (dflash_app.bench_prefix) on the tiny in-process stack: the arms
see what they should (``off`` never hits, ``cache`` and ``session`` reuse the history or the
system prompt), every arm's greedy output equals ``off``'s, and the table and the CLI flags
work. No timing is asserted (the figures are for docs/bench, run on a quiet machine)."""

from __future__ import annotations

import json
import types

import pytest

from dflash_app import bench_prefix
from verifier_svc.prefix_reuse import new_prefix_cache

from helpers import Stack

PROMPTS = [(f"p{i}", [{"role": "user", "content": text}]) for i, text in enumerate(
    ["the quick brown fox", "jumps over the lazy dog", "and runs far away", "into the woods"])]


@pytest.fixture
def cached_stack(target_model, tokenizer):
    s = Stack(target_model, tokenizer, prefix_cache=new_prefix_cache(target_model.pool, 64))
    yield s
    s.close()


def test_multiturn_arms_reuse_what_they_should_and_match_off(cached_stack):
    res = bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, workload="multiturn",
                                    max_tokens=4, speculation=False, conversations=2, turns=3)
    rows = res["rows"]
    assert res["arms"] == ["off", "cache", "session"] and len(rows["off"]) == 3
    assert all(r["cached_tokens"] == 0 for turn in rows["off"] for r in turn)
    for arm in ("cache", "session"):
        for t in range(1, 3):             # turns 2+: the previous turn's prompt is reused (its
            for r, prev, off in zip(rows[arm][t], rows[arm][t - 1], rows["off"][t]):
                # answer only as far as its text re-encodes to the same ids)
                assert r["prompt_tokens"] == off["prompt_tokens"]
                assert r["cached_tokens"] >= prev["prompt_tokens"] - 1, (arm, t)
    summary = bench_prefix.summarize(res)
    assert summary["cache"]["identical_to_off"] == summary["cache"]["rows"] == 6
    assert summary["session"]["identical_to_off"] == 6
    assert summary["cache"]["turns"][2]["cached_share"] > 0.4
    md = bench_prefix.markdown(res, summary)
    assert md.count("\n| ") == 3 + 1 and "cache 6/6" in md


def test_a_subset_of_arms_runs_alone(cached_stack):
    res = bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, workload="multiturn",
                                    max_tokens=3, speculation=False, conversations=1, turns=2,
                                    arms=["cache"])
    assert res["arms"] == ["cache"] and list(res["rows"]) == ["cache"]
    assert res["rows"]["cache"][1][0]["cached_tokens"] >= res["rows"]["cache"][0][0]["prompt_tokens"] - 1
    summary = bench_prefix.summarize(res)
    assert summary["cache"]["identical_to_off"] is None and summary["cache"]["rows"] == 2
    assert "identical to off" not in bench_prefix.markdown(res, summary)
    for bad in ([], ["cache", "nope"], ["session"]):
        with pytest.raises(ValueError, match="arms: a subset of"):
            bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, max_tokens=1,
                                      speculation=False, arms=bad,
                                      workload="shared-system" if bad == ["session"] else "multiturn")


def test_shared_system_users_reuse_the_system_prompt(cached_stack, tokenizer):
    system = bench_prefix.system_prompt(PROMPTS, 60, tokenizer)
    assert len(tokenizer.encode(system)) >= 60
    res = bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, workload="shared-system",
                                    max_tokens=3, speculation=False, users=3, system=system)
    assert res["arms"] == ["off", "cache"]
    off, cache = res["rows"]["off"], res["rows"]["cache"]
    assert all(u[0]["cached_tokens"] == 0 for u in off)
    assert cache[0][0]["cached_tokens"] == 0
    for u in cache[1:]:                    # users 2..: the system prompt is cached
        assert u[0]["cached_tokens"] >= 60
    assert bench_prefix.summarize(res)["cache"]["identical_to_off"] == 3


def test_the_cli_writes_its_report_and_refuses_a_bad_workload(cached_stack, tmp_path):
    a = types.SimpleNamespace(gateway=cached_stack.gateway_addr, workload="shared-system",
                              system_file="", system_tokens=40, max_tokens=2, no_speculation=True,
                              conversations=1, turns=1, users=2, spec_modes="fixed")
    assert bench_prefix.cmd_workload(a, PROMPTS, tmp_path) == 0
    data = json.loads((tmp_path / "prefix.json").read_text())
    assert data["summary"]["cache"]["rows"] == 2 and (tmp_path / "prefix.md").exists()
    assert data["speculation_mode"] == "off"            # --no-speculation wins over the mode
    with pytest.raises(ValueError, match="workload"):
        bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, workload="x", max_tokens=1,
                                  speculation=False)


def test_bench_parses_the_workload_flags():
    import argparse

    from dflash_app.bench import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["bench", "--workload", "multiturn", "--conversations", "3", "--turns", "2"])
    assert (a.workload, a.conversations, a.turns, a.users) == ("multiturn", 3, 2, 16)
    assert bench_prefix.workload_mode(a.spec_modes) == (True, "")    # the verifier's mode
    a = p.parse_args(["bench", "--workload", "multiturn", "--spec-modes", "fixed"])
    assert bench_prefix.workload_mode(a.spec_modes) == (True, "fixed")
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--workload", "nope"])


def test_the_workload_runs_the_speculation_mode_it_is_given(cached_stack, monkeypatch):
    import dflash.client
    from dflash_app.bench import DEFAULT_SPEC_MODES

    sent = []
    real = dflash.client.build_request

    def spy(*args, **kw):
        req = real(*args, **kw)
        sent.append((req.speculation, req.speculation_mode, req.tree_budget))
        return req

    monkeypatch.setattr(dflash.client, "build_request", spy)
    for spec_modes, expect in (("fixed", (True, "fixed", 0)), ("tree:8", (True, "tree", 8)),
                               ("off", (False, "", 0)), (DEFAULT_SPEC_MODES, (True, "", 0))):
        speculation, mode = bench_prefix.workload_mode(spec_modes)
        sent.clear()
        res = bench_prefix.run_workload(cached_stack.gateway_addr, PROMPTS, workload="multiturn",
                                        max_tokens=2, speculation=speculation, conversations=1,
                                        turns=2, arms=["off", "cache"], mode=mode)
        assert sent == [expect] * 4, spec_modes
        assert res["speculation_mode"] == {"fixed": "fixed", "tree:8": "tree:8", "off": "off"}.get(
            spec_modes, "verifier default")
    md = bench_prefix.markdown(res, bench_prefix.summarize(res))
    assert "speculation: verifier default" in md and "| cache τ |" in md and "τ per turn, cache / off: " in md
    with pytest.raises(ValueError, match="--spec-modes: --workload runs one speculation mode"):
        bench_prefix.workload_mode("fixed,adaptive")
