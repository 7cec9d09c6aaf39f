"""The pieces ``dflash diagnose`` decides with: the paired block bootstrap, the settings it tries,
the mask-token candidates, the draft-vocabulary coverage and the speculation payoff (which is
the adaptive policy's own choice over the cost model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_app.diagnose_cost import CostTable, blocks_from_rates, payoff
from dflash_app.diagnose_stats import paired
from verifier_svc.cost_model import StepCostModel


def _prompts(n_prompts: int, per: int) -> torch.Tensor:
    return torch.arange(n_prompts).repeat_interleave(per)


def test_paired_finds_a_consistent_gain_and_not_noise():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(800, generator=g) * 2
    prompt = _prompts(8, 100)
    better = paired(y - 0.3 + 0.2 * torch.randn(800, generator=g), y, prompt, block=16)
    assert better.mean == pytest.approx(-0.3, abs=0.05)
    assert better.hi < 0 and better.p_below < 0.001 and better.p_above > 0.99
    wobble = 0.2 * torch.tensor([1.0, -1.0]).repeat(400)     # no gain, as much up as down
    same = paired(y + wobble, y, prompt, block=16)
    assert same.lo < 0 < same.hi and same.p_below > 0.01 and same.p_above > 0.01
    sign = paired(y - 0.3 + 0.2 * torch.randn(800, generator=g), y, prompt, block=16, sign=True)
    assert sign.mean < -0.8 and sign.p_below < 0.001         # almost every anchor is lower


def test_paired_blocks_follow_prompts_and_skip_missing_anchors():
    x = torch.tensor([1.0, float("nan"), 3.0, 4.0, 5.0])
    y = torch.zeros(5)
    r = paired(x, y, torch.tensor([0, 0, 0, 1, 1]), block=2)
    assert r.anchors == 4 and r.mean == pytest.approx(13 / 4)
    assert r.blocks == 2          # prompt 0: (1, 3) after the NaN left; prompt 1: (4, 5)
    with pytest.raises(ValueError, match="block"):
        paired(x, y, torch.zeros(5, dtype=torch.int64), block=0)
    with pytest.raises(ValueError, match="shapes"):
        paired(x, y[:3], torch.zeros(5, dtype=torch.int64), block=2)


def test_correlated_anchors_widen_the_interval():
    """Runs of equal values (what neighbouring anchors are) must not count as independent."""
    g = torch.Generator().manual_seed(1)
    d = torch.randn(50, generator=g).repeat_interleave(16)        # 50 runs of 16 equal values
    prompt = torch.zeros(800, dtype=torch.int64)
    naive = paired(d, torch.zeros(800), prompt, block=1)
    blocked = paired(d, torch.zeros(800), prompt, block=16)
    assert (blocked.hi - blocked.lo) > 2.5 * (naive.hi - naive.lo)


def test_blocks_from_rates_reproduce_the_rates():
    from verifier_svc.acceptance import AcceptanceEstimator

    rates = [0.6, 0.3, 0.1]
    est = AcceptanceEstimator()
    est.observe("x", blocks_from_rates(rates))
    assert est.rates("x") == pytest.approx(rates, abs=1e-4)


def _costs(plain: float, per_draft: float, top: int) -> CostTable:
    m = StepCostModel()
    for k in range(top + 1):
        for _ in range(2):
            m.observe_step(1, k, plain + per_draft * k)
    return CostTable(m, {}, {}, "synthetic")


def test_payoff_is_the_policys_choice():
    costs = _costs(0.100, 0.010, 7)
    good = payoff(costs, [(7, 7)] * 100, 8)             # every draft accepted: tau 8
    fixed, ad = good.row("fixed"), good.row("adaptive")
    assert ad.choice == "k = 7" and fixed.speedup == pytest.approx(8 * 0.1 / 0.17, rel=1e-3)
    assert ad.speedup == pytest.approx(fixed.speedup, rel=1e-3)
    poor = payoff(costs, [(7, 0)] * 100, 8)             # nothing accepted
    assert poor.row("adaptive").choice == "off" and poor.row("adaptive").speedup == pytest.approx(1.0)
    assert poor.row("fixed").speedup == pytest.approx(0.1 / 0.17, rel=1e-3)
    assert "adaptive turns speculation off (k = 0)" in poor.sentence() and poor.does_not_pay
    # a first draft often right, later ones rarely: a short block pays, block 8 does not
    mid = payoff(_costs(0.100, 0.030, 7), [(7, 1)] * 60 + [(7, 0)] * 40, 8)
    ad = mid.row("adaptive")
    assert mid.row("fixed").speedup < 1.0 and ad.choice == "k = 1" and ad.speedup > 1.0
    assert mid.best.speedup == pytest.approx(ad.speedup) and mid.pays
    assert f"adaptive chooses k = 1; expected {ad.speedup:.2f}x" in mid.sentence()
    assert payoff(CostTable(StepCostModel(), {}, {}, "none"), [(7, 1)], 8) is None   # no plain cell


def test_settings_tried(tiny_target, make_drafter):
    import json

    from dflash.core.config import DrafterConfig
    from dflash_app.diagnose_wiring import settings

    d = make_drafter(block_size=8, target_layer_ids=[1, 2])
    cfg = DrafterConfig.from_pretrained(d)
    t = json.loads((tiny_target / "config.json").read_text())      # 4 layers
    by = {s.name: s for s in settings(cfg, d, t, masks=[256])}
    assert by["shift -1"].cfg.target_layer_ids == (0, 1) and by["shift +1"].cfg.target_layer_ids == (2, 3)
    assert "shift -2" not in by and "shift +2" not in by            # -1 or 4: out of range
    assert by["control: every tap at the last layer"].cfg.target_layer_ids == (3, 3)
    assert by["control: taps reversed"].cfg.target_layer_ids == (2, 1)
    assert by["mask_token_id 256"].edit == {"dflash_config.mask_token_id": 256}
    assert not any(s.kind in ("rope", "sliding") for s in by.values())   # nothing differs
    other = dataclasses.replace(cfg, rope_theta=5e5)
    rope = next(s for s in settings(other, d, t, masks=[]) if s.kind == "rope")
    assert rope.cfg.rope_theta == 10000.0 and rope.edit == {"rope_theta": 10000.0}


def test_mask_candidates_keep_one_id_per_distinct_row():
    from types import SimpleNamespace

    from dflash_app.diagnose_wiring import mask_candidates

    embed = torch.zeros(10, 4)
    embed[:, 0] = 1.0
    embed[7] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    embed[8] = embed[7] * (1 + 1e-5)                  # the same row up to rounding
    special = SimpleNamespace(special=True)
    tok = SimpleNamespace(added_tokens_decoder={5: special, 6: special}, all_special_ids=[5],
                          __len__=None)
    tok = type("Tok", (), {"added_tokens_decoder": tok.added_tokens_decoder,
                           "all_special_ids": [5], "__len__": lambda self: 7})()
    # 5 and 6 equal the configured row (id 9), 7 is new, 8 repeats 7
    assert mask_candidates(tok, embed, configured=9) == [7]


def test_vocab_coverage_names_what_the_draft_vocabulary_misses():
    from dflash_app.diagnose_tf import ProbeSeq
    from dflash_app.diagnose_wiring import vocab_coverage

    seq = ProbeSeq("x", torch.tensor([1, 2, 3, 4, 4, 5]), 2, torch.zeros(1, 5, 4))
    v = vocab_coverage([seq], torch.tensor([3, 5]), 8)
    assert v["tokens"] == 4 and v["coverage"] == 0.5 and v["missing"] == [["4", 2]]
    assert vocab_coverage([seq], None, 8) is None
