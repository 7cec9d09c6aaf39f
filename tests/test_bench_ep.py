"""``dflash bench --ep-sizes 1,2``: the all-to-all arithmetic, and one short real run on the tiny MoE
(a stack per EP size through dflash_app.launcher)."""

from __future__ import annotations

import json

import pytest

from dflash_app.bench_ep import a2a_bytes_per_step, a2a_table


def test_a2a_bytes_per_step():
    # tokens x hidden x dtype bytes x 2 (dispatch + combine) per MoE layer
    assert a2a_bytes_per_step(1, 576, 30, 4) == 576 * 4 * 2 * 30
    assert a2a_bytes_per_step(16, 2048, 48, 2) == 16 * 2048 * 2 * 2 * 48   # Qwen3-30B-A3B, bf16
    table = a2a_table(16)
    assert "Qwen3-30B-A3B" in table and "6.00 MiB" in table


@pytest.mark.slow
def test_bench_ep_sizes_side_by_side(tmp_path):
    from dflash_app.cli import main
    from dflash_app.testing import make_tiny_drafter, make_tiny_moe_target

    from helpers import free_ports

    target = make_tiny_moe_target(tmp_path / "moe")
    drafter = make_tiny_drafter(tmp_path / "drafter", target, block_size=4)
    gw, ver, dr = free_ports(3)
    rc = main(["bench", "--ep-sizes", "1,2", "--target", str(target), "--drafter", str(drafter),
               "--limit", "1", "--max-tokens", "8", "--out", str(tmp_path / "out"),
               "--gateway-port", str(gw), "--verifier-port", str(ver), "--drafter-port", str(dr),
               "--run-dir", str(tmp_path / "logs")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "ep.json").read_text())
    assert set(res["aggregate"]) == {"spec@ep1", "off@ep1", "spec@ep2", "off@ep2"}
    assert all(n == 1 for n in res["identical_to_first"].values())   # greedy: same tokens everywhere
    assert res["aggregate"]["spec@ep2"]["verify_ms_per_step"] > 0
    md = (tmp_path / "out" / "ep.md").read_text()
    assert "EP overhead per target step" in md and "| 2 | spec |" in md
