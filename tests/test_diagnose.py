"""``dflash diagnose``: static findings name their field (and the fix); the teacher-forced probe
measures exactly what the greedy decode loop measures; the CLI names a drafter saved with its
target_layer_ids shifted by one and the fix, passes the correctly wired one, and reads a running
deployment's counters and cost cells (tests/tap_models.py builds drafters that depend on their
taps). Planted faults of other kinds: tests/test_diagnose_faults.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import pytest
import torch

from dflash_app.drafter_check import check

from tap_models import (
    edited_drafter,
    letter_prompt,
    make_probe_drafter,
    make_tap_drafter,
    make_tap_target,
    mixed_prompt,
)

B = 8
MAX_NEW = 1 + 3 * B                     # prefill token + three full blocks
TAPPED = 1                              # the drafter really reads the output of layer 1


@pytest.fixture(scope="module")
def tap(tmp_path_factory):
    root = tmp_path_factory.mktemp("tap")
    target = make_tap_target(root / "target")
    dirs = {ids: make_tap_drafter(root / f"drafter{ids}", target, tapped_layer=TAPPED,
                                  saved_layer_ids=[ids], block_size=B) for ids in (0, 1, 2)}
    return target, dirs


def fields(findings, level):
    return {f.field for f in findings if f.level == level}


def diagnose_json(*args) -> tuple[int, dict]:
    from dflash_app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["diagnose", *map(str, args), "--json"])
    return rc, json.loads(out.getvalue())


# ---------------------------------------------------------------------- static
def test_static_check_clean_pair(tiny_target, make_drafter):
    findings = check(make_drafter(block_size=8), tiny_target)
    assert not fields(findings, "error") and not fields(findings, "warning")
    assert {"hidden_size", "vocab_size", "dflash_config.target_layer_ids", "rope_theta",
            "block_size", "model.safetensors", "card", "dflash_serve.target_fingerprint",
            "dflash_config.mask_token_id"} <= fields(findings, "ok")


@pytest.mark.parametrize("changes,level,field", [
    ({"dflash_config__target_layer_ids": [0, 4]}, "error", "dflash_config.target_layer_ids"),
    ({"rope_theta": 500000.0}, "warning", "rope_theta"),
    ({"block_size": 100}, "error", "block_size"),
    ({"dflash_config__mask_token_id": 258}, "warning", "dflash_config.mask_token_id"),   # = eos
    ({"dflash_config__mask_token_id": 97}, "warning", "dflash_config.mask_token_id"),    # 'a'
    ({"layer_types": ["sliding_attention"], "sliding_window": 4, "use_sliding_window": True},
     "error", "sliding_window"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 16, "use_sliding_window": False},
     "warning", "use_sliding_window"),
    ({"num_target_layers": 8}, "warning", "num_target_layers"),
    ({"dflash_serve__target_fingerprint": "sha256:0000000000000000"}, "warning",
     "dflash_serve.target_fingerprint"),
    ({"dflash_config__mask_token_id": 9999}, "error", "dflash_config.mask_token_id"),  # config error
])
def test_static_check_names_the_field(tiny_target, make_drafter, tmp_path, changes, level, field):
    d = edited_drafter(make_drafter(block_size=8), tmp_path / "d", **changes)
    assert field in fields(check(d, tiny_target), level)


def test_static_findings_carry_the_fix(tiny_target, make_drafter, tmp_path):
    d = edited_drafter(make_drafter(block_size=8), tmp_path / "d", rope_theta=500000.0)
    rope = next(f for f in check(d, tiny_target) if f.field == "rope_theta")
    assert "set rope_theta to 10000" in rope.fix and "Fix:" in str(rope)


def test_static_check_hidden_size_and_vocab(tiny_target, tmp_path):
    from dflash_app.testing import make_tiny_drafter, make_tiny_target

    other = make_tiny_target(tmp_path / "other", hidden=48, vocab=300)
    d = make_tiny_drafter(tmp_path / "d", other, block_size=4)
    errs = fields(check(d, tiny_target), "error")
    assert {"hidden_size", "vocab_size"} <= errs


def test_static_check_spots_a_shifted_default_spread(tmp_path):
    from dflash.core.config import default_target_layer_ids
    from dflash_app.testing import make_tiny_drafter, make_tiny_target

    t = make_tiny_target(tmp_path / "t", num_layers=8)
    shifted = [i + 1 for i in default_target_layer_ids(8, 3)]
    d = make_tiny_drafter(tmp_path / "d", t, target_layer_ids=shifted)
    warn = [f for f in check(d, t) if f.level == "warning"]
    assert any(f.field == "dflash_config.target_layer_ids" and "shifted by +1" in f.message for f in warn)


@pytest.mark.parametrize("own", ["copy", "trained"])
def test_static_check_names_a_drafter_with_its_own_lm_head(tiny_target, make_drafter, tmp_path, own):
    from safetensors.torch import load_file, save_file

    from dflash.core.checkpoint import load_target_head

    d = tmp_path / "d"
    shutil.copytree(make_drafter(block_size=8), d)
    head = load_target_head(tiny_target).lm_head
    state = load_file(str(d / "model.safetensors"))
    state["lm_head.weight"] = head.clone() if own == "copy" else torch.randn_like(head)
    save_file(state, str(d / "model.safetensors"))
    f = next(f for f in check(d, tiny_target) if f.field == "model.safetensors:lm_head.weight")
    assert f.level == "error"
    assert ("drop lm_head.weight" in f.fix) == (own == "copy")
    assert ("fine-tune" in f.fix) == (own == "trained")


# ---------------------------------------------------------------------- the probe is exact
def test_teacher_forced_walk_is_the_decode_loop(tap, tmp_path):
    """Walking the teacher-forced anchors gives the decode loop's own counts, block by block
    (a drafter with partial acceptance: the wrong rope spreads its attention)."""
    from dflash_app.diagnose_tf import Head, counter, score, walk
    from dflash_app.probe import InProcessProbe

    target, _ = tap
    d = make_probe_drafter(tmp_path / "recent", target, recent=True, block_size=B)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1e8
    (d / "config.json").write_text(json.dumps(cfg))
    probe = InProcessProbe(target, d)
    try:
        prompts = [mixed_prompt(), mixed_prompt("c", "d", 28, 14), letter_prompt("k", 9)]
        live = probe.run(prompts, max_tokens=MAX_NEW)
        seqs = probe.collect(prompts, ["x"] * 3, max_new_tokens=MAX_NEW)
        sc = score(probe.drafter, probe.head, Head.of(probe.head.lm_head, None), seqs,
                   layer_ids=probe.layer_ids, mask_token_id=probe.drafter.cfg.mask_token_id)
        c = counter(walk(sc, seqs)["all"])
    finally:
        probe.close()
    assert 1.2 < live.tau < B - 1                       # neither nothing nor everything accepted
    assert (c.drafts, c.accepted_tokens) == (live.stats.drafts, live.stats.accepted_tokens)
    assert c.accepted_per_position == live.stats.accepted_per_position


# ---------------------------------------------------------------------- the CLI
def test_cli_names_the_shifted_drafter_and_its_fix(tap):
    target, dirs = tap
    for saved, fix in ((TAPPED + 1, -1), (TAPPED - 1, +1)):     # off by one either way
        rc, r = diagnose_json("--target", target, "--drafter", dirs[saved], "--raw", "--prompt",
                              "a" * 12, "--prompt", "k" * 9, "--max-tokens", MAX_NEW, "--no-cost")
        assert rc == 1 and r["verdict"] == "mis-wired"
        assert r["fixes"][0]["edit"] == {"dflash_config.target_layer_ids": [TAPPED]}
        assert r["causes"][0].startswith(f"target_layer_ids are off by {-fix:+d}")
        rows = {s["name"]: s for s in r["probe"]["settings"]}
        assert rows["saved"]["tau"] == pytest.approx(1.0)
        assert rows[f"shift {fix:+d}"]["tau"] == pytest.approx(B)
        assert rows[f"shift {fix:+d}"]["significant"]
        assert rows[f"shift {fix:+d}"]["vs_saved_sign"]["p_below"] < 0.01


def test_cli_passes_the_correctly_wired_drafter(tap, capsys):
    from dflash_app.cli import main

    target, dirs = tap
    rc = main(["diagnose", "--target", str(target), "--drafter", str(dirs[TAPPED]), "--raw",
               "--prompt", "pppppppppp", "--prompt", "cccccccccccc", "--max-tokens", str(MAX_NEW)])
    text = capsys.readouterr().out
    assert rc == 0 and "verdict: healthy" in text
    assert "all: tau 8.00" in text and "<- fits better" not in text
    assert "speculation (all): speculation at block 8 is" in text
    # every draft is accepted (tau 8), so adaptive speculates and expects a gain; which k or
    # tree wins (and at which share of the replayed steps) rests on measured milliseconds, so
    # it is not pinned
    m = re.search(r"adaptive chooses (k = [1-9]\d*|a tree of \d+ nodes)[^;]*; expected ([\d.]+)x", text)
    assert m and float(m.group(2)) > 1.0, text


def test_cli_refuses_bad_arguments(tap, capsys):
    from dflash_app.cli import main

    target, dirs = tap
    with pytest.raises(SystemExit, match="--target and --drafter, or --gateway"):
        main(["diagnose", "--target", str(target)])
    with pytest.raises(SystemExit, match="--threads"):
        main(["diagnose", "--target", str(target), "--drafter", str(dirs[1]), "--threads", "-1"])
    with pytest.raises(SystemExit, match="--max-tokens"):
        main(["diagnose", "--target", str(target), "--drafter", str(dirs[1]), "--max-tokens", "1"])
    with pytest.raises(SystemExit, match="--prompts"):
        main(["diagnose", "--target", str(target), "--drafter", str(dirs[1]), "--prompts", "nope"])
    with pytest.raises(SystemExit, match="--metrics"):
        main(["diagnose", "--target", str(target), "--drafter", str(dirs[1]), "--metrics", "x:1"])


def test_gateway_mode_reads_the_deployment(tap):
    """--gateway: live tau on the prompts; --metrics: the verifier's counters and the policy's
    cost cells, from which the verdict on speculation is made."""
    from transformers import AutoTokenizer

    from dflash.serving.telemetry import Telemetry, serve_metrics
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

    from helpers import Stack

    target, dirs = tap
    tele = {name: Telemetry(service=name) for name in ("gateway", "verifier", "drafter")}
    s = Stack(TargetModel(target), AutoTokenizer.from_pretrained(target), telemetry=tele.get,
              spec_mode="adaptive")
    server = serve_metrics(tele["verifier"].registry, 0, "127.0.0.1")
    try:
        s.add_drafter(DrafterEngine.from_pretrained(dirs[TAPPED], target))
        rc, r = diagnose_json("--gateway", s.gateway_addr, "--metrics",
                              f"127.0.0.1:{server.server_port}", "--raw", "--prompt", "a" * 12,
                              "--prompt", "k" * 9, "--max-tokens", MAX_NEW)
        tree_table = s.engine.policy.acceptance.tree_table()
    finally:
        server.shutdown()
        s.close()
    assert r["live"]["tau"] > 2 and r["live"]["block_size"] == B
    dep = r["deployment"]
    assert dep["drafter_version"] == "tap-drafter@L1" and dep["drafts"] > 0
    assert dep["tau"] == pytest.approx(r["live"]["tau"])          # the only traffic so far
    # accepted drafts by source: the deployment's counters, the responses' own figures
    by = r["live"]["accepted_by_source"]
    assert dep["accepted_by_source"] == pytest.approx({k: float(v) for k, v in by.items()})
    assert sum(by.values()) == pytest.approx((r["live"]["tau"] - 1) * r["live"]["drafts"])
    assert r["costs"]["source"].startswith("reported by http://127.0.0.1:")
    assert r["costs"]["cells_ms"]                                 # the policy's own cells
    assert set(r["speculation"]) == {"all", "deployment (lifetime)"}
    assert r["verdict_from"] == "deployment (lifetime)"           # its costs, its acceptance
    table = {str(n): v for (label, n), v in tree_table.items() if label == "tap-drafter@L1"}
    assert r["deployment"]["tree_tokens"] == pytest.approx(table)    # the policy's own trees
    assert r["verdict"] in ("healthy", "degraded") and rc == {"healthy": 0, "degraded": 3}[r["verdict"]]


def test_prompt_sets_are_drawn_by_seed_and_split_by_domain(tiny_target, make_drafter, tmp_path):
    """--prompts humaneval,chat,FILE: each set is a domain of its own (its own tau and
    speculation verdict); --seed draws other prompts."""
    from argparse import Namespace

    from dflash_app.bench_prompts import prompt_set
    from dflash_app.diagnose import draw_prompts

    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"}\n')
    a = Namespace(prompt=None, prompts=f"humaneval,chat,{f}", num_prompts=7, seed=0, first=False)
    drawn = draw_prompts(a)
    assert [d for d, _ in drawn].count("humaneval") == 3 and [d for d, _ in drawn].count("mine.jsonl") == 2
    assert draw_prompts(a) == drawn and draw_prompts(Namespace(**{**vars(a), "seed": 1})) != drawn
    first = draw_prompts(Namespace(**{**vars(a), "prompts": "humaneval", "num_prompts": 3,
                                      "first": True}))
    assert [m for _, m in first] == [m for _, m in prompt_set("humaneval", 3)]   # bench's --limit 3
    rc, r = diagnose_json("--target", tiny_target, "--drafter", make_drafter(block_size=4),
                          "--prompts", "humaneval,chat", "--num-prompts", 4, "--max-tokens", 12)
    doms = r["probe"]["domains"]
    assert set(doms) == {"all", "humaneval", "chat"}
    assert doms["humaneval"]["prompts"] == doms["chat"]["prompts"] == 2
    assert doms["all"]["drafts"] == doms["humaneval"]["drafts"] + doms["chat"]["drafts"]
    assert set(r["speculation"]) == {"all", "humaneval", "chat"}
