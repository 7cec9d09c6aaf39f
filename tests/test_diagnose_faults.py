"""Planted faults: tiny drafters built to depend on one setting (tests/tap_models.py), saved
with that setting wrong, are each named by ``dflash diagnose`` with the exact config.json edit;
the same drafters saved right pass; a random-weight drafter is broken."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tap_models import MASK, edited_drafter, make_mask_target, make_probe_drafter, mixed_prompt

B = 8
MAX_NEW = 1 + 3 * B
LETTERS = ["a" * 12, "k" * 9, "c" * 20]                  # one letter repeated
MIXED = [bytes(mixed_prompt()).decode(), bytes(mixed_prompt("c", "d", 28, 14)).decode(),
         bytes(mixed_prompt("e", "f", 32, 10)).decode()]  # an older letter, then the newer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    target = make_mask_target(root / "target")
    return root, target, {
        "mask": make_probe_drafter(root / "mask", target, mask_gated=True, block_size=B),
        "recent": make_probe_drafter(root / "recent", target, recent=True, block_size=B),
        "sliding": make_probe_drafter(root / "sliding", target, sliding_window=16, block_size=B)}


def diagnose(target, drafter, prompts) -> tuple[int, dict]:
    from dflash_app.cli import main

    args = ["diagnose", "--target", str(target), "--drafter", str(drafter), "--raw", "--json",
            "--max-tokens", str(MAX_NEW), "--no-cost"]
    for p in prompts:
        args += ["--prompt", p]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args)
    return rc, json.loads(out.getvalue())


@pytest.mark.parametrize("kind,prompts", [("mask", LETTERS), ("recent", MIXED), ("sliding", MIXED)])
def test_the_correctly_wired_drafter_passes(built, kind, prompts):
    _, target, d = built
    rc, r = diagnose(target, d[kind], prompts)
    assert rc == 0 and r["verdict"] == "healthy" and not r["fixes"]
    assert r["probe"]["domains"]["all"]["tau"] == pytest.approx(B)


@pytest.mark.parametrize("kind,prompts,changes,edit,words", [
    ("mask", LETTERS, {"dflash_config__mask_token_id": 259},
     {"dflash_config.mask_token_id": MASK}, "mask_token_id looks wrong"),
    ("recent", MIXED, {"rope_theta": 100.0},
     {"rope_theta": 10000.0}, "rope settings"),
    ("sliding", MIXED, {"use_sliding_window": False},
     {"use_sliding_window": True}, "attention layout"),
])
def test_a_planted_fault_is_named_with_its_fix(built, tmp_path, kind, prompts, changes, edit, words):
    _, target, d = built
    bad = edited_drafter(d[kind], tmp_path / "bad", **changes)
    rc, r = diagnose(target, bad, prompts)
    assert rc == 1 and r["verdict"] == "mis-wired"
    assert len(r["fixes"]) == 1 and r["fixes"][0]["edit"] == edit
    assert r["causes"][0].startswith(words) and "Fix: in config.json set" in r["causes"][0]
    saved = r["probe"]["settings"][0]
    assert saved["tau"] < 2.0                       # the fault costs most of the acceptance
    fixed = next(s for s in r["probe"]["settings"] if s["significant"])
    assert fixed["tau"] == pytest.approx(B) and fixed["stride"] == 1   # scored on every anchor


def test_static_check_points_at_the_planted_rope_and_window(built, tmp_path):
    from dflash_app.drafter_check import check

    _, target, d = built
    rope = edited_drafter(d["recent"], tmp_path / "rope", rope_theta=100.0)
    window = edited_drafter(d["sliding"], tmp_path / "window", use_sliding_window=False)
    assert any(f.field == "rope_theta" and f.level == "warning" for f in check(rope, target))
    assert any(f.field == "use_sliding_window" and f.level == "warning" for f in check(window, target))


def test_a_random_weight_drafter_is_broken(tiny_target, make_drafter):
    rc, r = diagnose(tiny_target, make_drafter(block_size=B), ["hello there", "def f(x):"])
    assert rc == 2 and r["verdict"] == "broken" and not r["fixes"]
    assert r["causes"][0].startswith("the drafter drafts almost nothing")
