"""``dflash diagnose``: static findings name their field; the live probe and the layer-offset
probe catch a drafter saved with its target_layer_ids shifted by one (tests/tap_models.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash.drafter_check import check
from dflash.probe import InProcessProbe, judge, offset_conclusion
from tap_models import letter_prompt, make_tap_drafter, make_tap_target

B = 8
MAX_NEW = 1 + B                         # prefill token + one full block
PROMPTS = [letter_prompt("a"), letter_prompt("k", 9)]
TAPPED = 1                              # the drafter really reads the output of layer 1


@pytest.fixture(scope="module")
def tap(tmp_path_factory):
    root = tmp_path_factory.mktemp("tap")
    target = make_tap_target(root / "target")
    dirs = {ids: make_tap_drafter(root / f"drafter{ids}", target, tapped_layer=TAPPED,
                                  saved_layer_ids=[ids], block_size=B) for ids in (0, 1, 2)}
    return target, dirs


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        node = cfg
        *path, last = k.split("__")
        for p in path:
            node = node[p]
        node[last] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def fields(findings, level):
    return {f.field for f in findings if f.level == level}


def test_static_check_clean_pair(tiny_target, make_drafter):
    findings = check(make_drafter(block_size=8), tiny_target)
    assert not fields(findings, "error") and not fields(findings, "warning")
    assert {"hidden_size", "vocab_size", "dflash_config.target_layer_ids", "rope_theta",
            "block_size", "model.safetensors"} <= fields(findings, "ok")


@pytest.mark.parametrize("changes,level,field", [
    ({"dflash_config__target_layer_ids": [0, 4]}, "error", "dflash_config.target_layer_ids"),
    ({"rope_theta": 500000.0}, "warning", "rope_theta"),
    ({"block_size": 100}, "error", "block_size"),
    ({"dflash_config__mask_token_id": 258}, "warning", "dflash_config.mask_token_id"),   # = eos
    ({"layer_types": ["sliding_attention"], "sliding_window": 4, "use_sliding_window": True},
     "error", "sliding_window"),
    ({"num_target_layers": 8}, "warning", "num_target_layers"),
    ({"dflash_config__mask_token_id": 9999}, "error", "dflash_config.mask_token_id"),  # config error
])
def test_static_check_names_the_field(tiny_target, make_drafter, tmp_path, changes, level, field):
    d = _edited(make_drafter(block_size=8), tmp_path / "d", **changes)
    assert field in fields(check(d, tiny_target), level)


def test_static_check_hidden_size_and_vocab(tiny_target, tmp_path):
    from dflash.testing import make_tiny_drafter, make_tiny_target

    other = make_tiny_target(tmp_path / "other", hidden=48, vocab=300)
    d = make_tiny_drafter(tmp_path / "d", other, block_size=4)
    errs = fields(check(d, tiny_target), "error")
    assert {"hidden_size", "vocab_size"} <= errs


def test_static_check_spots_a_shifted_default_spread(tmp_path):
    from dflash.config import default_target_layer_ids
    from dflash.testing import make_tiny_drafter, make_tiny_target

    t = make_tiny_target(tmp_path / "t", num_layers=8)
    shifted = [i + 1 for i in default_target_layer_ids(8, 3)]
    d = make_tiny_drafter(tmp_path / "d", t, target_layer_ids=shifted)
    warn = [f for f in check(d, t) if f.level == "warning"]
    assert any(f.field == "dflash_config.target_layer_ids" and "shifted by +1" in f.message for f in warn)


def test_live_probe_healthy_and_shift_is_found(tap):
    target, dirs = tap
    good = InProcessProbe(target, dirs[TAPPED]).run(PROMPTS, max_tokens=MAX_NEW)
    assert good.tau == pytest.approx(B) and good.stats.per_position_rate == [1.0] * (B - 1)
    assert judge(good).verdict == "healthy"
    for saved, fix in ((TAPPED + 1, -1), (TAPPED - 1, +1)):   # off by one either way
        probe = InProcessProbe(target, dirs[saved])
        live = probe.run(PROMPTS[1:], max_tokens=MAX_NEW)
        v = judge(live)
        assert live.tau == pytest.approx(1.0) and v.verdict == "broken"
        assert any("target_layer_ids" in c for c in v.causes)
        rows = probe.offsets(PROMPTS[1:], max_tokens=MAX_NEW, base=live)
        taus = {d: (r.tau if r else None) for d, _, r in rows}
        assert taus[fix] == pytest.approx(B) and taus[0] == pytest.approx(1.0)
        best, sentence = offset_conclusion(rows)
        assert best == fix and f"shifted by {fix:+d}" in sentence and f"[{TAPPED}]" in sentence


def test_cli_flags_the_shifted_drafter(tap, capsys):
    from dflash.cli import main

    target, dirs = tap
    rc = main(["diagnose", "--target", str(target), "--drafter", str(dirs[TAPPED + 1]), "--raw",
               "--prompt", "aaaaaaaaaaaa", "--max-tokens", str(MAX_NEW), "--offset-probe", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 2 and report["verdict"] == "broken"
    assert report["live"]["tau"] == pytest.approx(1.0)
    assert report["offsets"]["best_shift"] == -1
    assert report["causes"][0].startswith("target_layer_ids look shifted by -1")
    assert main(["diagnose", "--target", str(target), "--drafter", str(dirs[TAPPED]), "--raw",
                 "--prompt", "pppppppppp", "--max-tokens", str(MAX_NEW)]) == 0
    text = capsys.readouterr().out
    assert "verdict: healthy" in text and "live probe: tau 8.00" in text


def test_gateway_probe_of_a_running_stack(tap):
    from transformers import AutoTokenizer

    from conftest import Stack
    from dflash.probe import gateway_probe
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

    target, dirs = tap
    s = Stack(TargetModel(target), AutoTokenizer.from_pretrained(target))
    try:
        s.add_drafter(DrafterEngine.from_pretrained(dirs[TAPPED], target))
        r = gateway_probe(s.gateway_addr, ["aaaaaaaaaaaa", "kkkkkkkkk"], max_tokens=MAX_NEW, raw=True)
    finally:
        s.close()
    assert r.tau == pytest.approx(B) and r.block_size == B and judge(r).verdict == "healthy"
