"""DFlash2 checkpoints load from config + safetensors; a bad one is refused naming the field or
tensor; a DFlash2 drafter made from a DFlash one equals it at step 0."""

from __future__ import annotations

import json

import pytest
import torch
from dflash2_models import random_drafter, small_config
from safetensors.torch import load_file, save_file

from dflash.core.checkpoint import load_drafter, save_drafter
from dflash.core.config import ConfigError, DrafterConfig
from dflash.core.dflash2 import DFlash2Drafter, selector_rows
from dflash.core.modeling import DFlashDrafter


@pytest.fixture
def saved(tmp_path):
    m = random_drafter(small_config())
    save_drafter(m, tmp_path)
    return tmp_path, m


def test_round_trip_is_a_dflash2_drafter_with_its_fields(saved):
    path, m = saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["selector_top_k"] == 8
    got = load_drafter(path)
    assert isinstance(got, DFlash2Drafter) and got.cfg == m.cfg
    for k, v in m.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.parametrize("name", ["layers.1.mlp_conv.base_kernel",
                                  "layers.0.attention_conv.kernel_projection.weight",
                                  "candidate_selector.successor_codebook",
                                  "candidate_selector.hidden_projection.weight"])
def test_missing_or_misshapen_tensor_is_refused_by_name(saved, name):
    path, _ = saved
    state = load_file(str(path / "model.safetensors"))
    good = state[name]
    del state[name]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        load_drafter(path)
    assert e.value.field == f"model.safetensors:{name}" and "missing" in str(e.value)
    state[name] = torch.zeros(*good.shape[:-1], good.shape[-1] + 1)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        load_drafter(path)
    assert e.value.field == f"model.safetensors:{name}" and "shape" in str(e.value)


@pytest.mark.parametrize("field,value,needle", [
    ("conv_group_size", 24, "does not divide"),
    ("conv_kernel_size", 0, "positive"),
    ("selector_top_k", 10_000, "exceeds vocab_size"),
    ("selector_rank", None, "missing"),
    ("final_logit_softcapping", -1.0, ">= 0"),
    ("output_multiplier", 0.0, "positive"),
])
def test_bad_dflash2_config_names_the_field(saved, field, value, needle):
    path, _ = saved
    d = json.loads((path / "config.json").read_text())
    if value is None:
        del d["dflash_config"][field]
    else:
        d["dflash_config"][field] = value
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_dict(d)
    assert e.value.field == f"dflash_config.{field}" and needle in str(e.value)


def test_causal_and_unknown_architectures_are_refused(saved):
    path, _ = saved
    d = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_dict({**d, "is_causal": True})
    assert e.value.field == "is_causal"
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_dict({**d, "architectures": ["DFlash3DraftModel"]})
    assert e.value.field == "architectures"


def test_scalars_read_from_dflash_config_or_top_level(saved):
    path, _ = saved
    d = json.loads((path / "config.json").read_text())
    dc = {k: v for k, v in d["dflash_config"].items()
          if k not in ("output_multiplier", "final_logit_softcapping")}
    c = DrafterConfig.from_dict({**d, "dflash_config": dc, "output_multiplier": 0.25,
                                 "final_logit_softcapping": 20.0})
    assert (c.output_multiplier, c.final_logit_softcapping) == (0.25, 20.0)
    c = DrafterConfig.from_dict({**d, "dflash_config": dc})
    assert (c.output_multiplier, c.final_logit_softcapping) == (1.0, 0.0)


def test_initialised_from_dflash_equals_it_at_step_zero():
    import dataclasses

    v2cfg = small_config(final_logit_softcapping=0.0, output_multiplier=1.0,
                         input_embedding_scale=1.0)
    v1cfg = dataclasses.replace(v2cfg, architecture="DFlashDraftModel")
    torch.manual_seed(5)
    v1 = DFlashDrafter(v1cfg).eval()
    with torch.no_grad():
        for p in v1.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.12)
    v2 = DFlash2Drafter(v2cfg).eval()
    v2.init_from_dflash(v1)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 9, v1cfg.context_size, generator=g)
    emb = torch.randn(1, 8, v1cfg.hidden_size, generator=g)
    head = torch.randn(v1cfg.vocab_size, v1cfg.hidden_size, generator=g)
    pos, cpos = torch.arange(9, 17)[None], torch.arange(9)[None]
    with torch.no_grad():
        h1 = v1(emb, pos, v1.context_kv(feats, cpos))[0]
        h2 = v2(emb, pos, v2.context_kv(feats, cpos))[0]
        assert torch.equal(h1, h2)
        logits = h1[1:] @ head.T
        rows = selector_rows(v2.candidate_selector, logits, h2[1:], 3, None)
    assert torch.equal(rows.argmax(-1), logits.argmax(-1))     # v6's chain drafts
    on = torch.isfinite(rows)
    assert torch.equal(rows[on], logits[on])                    # the candidates' scores are v6's logits
    # the selector can learn: its projection gets a gradient from a pairwise loss
    v2.train()
    cols, vals = v2.candidate_selector.candidates(logits)
    s = v2.candidate_selector.edges(cols[None], vals[None], h2[None, 1:].detach(),
                                    torch.tensor([3]))
    s[..., 1].sum().backward()
    assert v2.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0
