"""``dflash diagnose`` checks a DFlash2 drafter as it checks a DFlash one: its own fields, and a
missing or misshapen DFlash2 tensor named as the error."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash_app.drafter_check import check


def fields(findings, level):
    return {f.field for f in findings if f.level == level}


def test_clean_dflash2_pair(tiny_target, make_drafter):
    findings = check(make_drafter(block_size=8, dflash2=True), tiny_target)
    assert not fields(findings, "error") and not fields(findings, "warning")
    assert {"architectures", "model.safetensors", "card", "hidden_size"} <= fields(findings, "ok")
    arch = next(f for f in findings if f.field == "architectures")
    assert "selector top-8 at rank 16" in arch.message and "2 taps in groups of 8" in arch.message


@pytest.mark.parametrize("change", ["drop", "reshape"])
def test_bad_dflash2_tensor_is_named(tiny_target, make_drafter, tmp_path, change):
    d = tmp_path / "d"
    shutil.copytree(make_drafter(block_size=8, dflash2=True), d)
    state = load_file(str(d / "model.safetensors"))
    name = "candidate_selector.predecessor_codebook"
    if change == "drop":
        del state[name]
    else:
        state[name] = state[name][:, :-1].contiguous()
    save_file(state, str(d / "model.safetensors"))
    assert f"model.safetensors:{name}" in fields(check(d, tiny_target), "error")


def test_bad_dflash2_field_is_named(tiny_target, make_drafter, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(make_drafter(block_size=8, dflash2=True), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["conv_group_size"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    assert "dflash_config.conv_group_size" in fields(check(d, tiny_target), "error")
