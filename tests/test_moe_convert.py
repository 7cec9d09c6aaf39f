"""The exact mixture-of-experts form of a dense target (``dflash convert-moe``) and the sparse
random-weight MoE maker used by the expert-parallel tests."""

from __future__ import annotations

import json

import pytest
import torch

PROMPT = [200, 201, 7, 7, 7, 31, 90, 114, 115, 116, 117, 118, 5, 6, 240, 241, 30, 33]


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from dflash_app.testing import make_tiny_moe_target

    return AutoModelForCausalLM.from_pretrained(
        make_tiny_moe_target(tmp_path_factory.mktemp("moe"))).eval()


def test_moe_conversion_is_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_app.moe_convert import convert
    from dflash_app.testing import make_tiny_target

    dense_dir = make_tiny_target(tmp_path / "dense", arch="llama")
    moe_dir = convert(dense_dir, tmp_path / "moe", num_experts=4)
    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    assert cfg["num_experts_per_tok"] == 4 and cfg["intermediate_size"] == 128 // 4
    assert (moe_dir / "tokenizer.json").exists()
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    moe = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        a, b = dense(ids).logits, moe(ids).logits
    assert (a - b).abs().max() < 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    gen = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(dense.generate(ids, **gen), moe.generate(ids, **gen))


def test_moe_conversion_refuses_bad_expert_counts():
    from dflash_app.moe_convert import moe_config

    dense = {"model_type": "llama", "intermediate_size": 1536, "hidden_size": 576}
    for e in (3, 0, 1024 * 4):
        with pytest.raises(ValueError, match="experts"):
            moe_config(dense, e)
    with pytest.raises(ValueError, match="model_type"):
        moe_config({"model_type": "gpt2", "intermediate_size": 8}, 2)


def test_tiny_moe_routing_matters(moe_hf):
    """Top-2 of 8 with a random router: dropping one expert changes the logits of the tokens
    routed to it (so a mis-sharded expert cannot go unnoticed)."""
    cfg = moe_hf.config
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (8, 2)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        base = moe_hf(ids).logits
        experts = moe_hf.model.layers[1].mlp.experts
        saved = experts.down_proj[3].clone()
        experts.down_proj[3].zero_()
        try:
            changed = moe_hf(ids).logits
        finally:
            experts.down_proj[3].copy_(saved)
    diff = (base - changed).abs().amax(-1)[0]
    assert diff.max() > 1e-3            # some tokens used expert 3 ...
    assert (diff < 1e-6).any()          # ... others did not: routing is sparse
