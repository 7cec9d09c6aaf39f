"""scripts/make_realsize.py: real-size configs without a model hub, and the loaders take them.

The real shapes are checked on the ``meta`` device (no memory); the files are written with the
tiny dimensions through the same code (``--tiny``) and loaded by the services' own loaders.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def realsize():
    spec = importlib.util.spec_from_file_location("make_realsize", ROOT / "scripts" / "make_realsize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_real_configs_are_qwen3_8b_and_zlab_dflash_b16(realsize):
    from transformers import Qwen3ForCausalLM

    from dflash.core.modeling import DFlashDrafter

    t = realsize.target_config(realsize.REAL, torch.bfloat16)
    assert (t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim, t.vocab_size) == (4096, 36, 12288, 32, 8, 128, 151936)
    assert t.rope_parameters["rope_theta"] == 1e6 and not t.tie_word_embeddings
    d = realsize.drafter_config(realsize.REAL, torch.bfloat16)
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim) == (5, 4096, 12288, 32, 8, 128)
    assert (d.target_layer_ids, d.block_size, d.mask_token_id, d.vocab_size, d.rope_theta,
            d.dtype) == ((1, 9, 17, 25, 33), 16, 151669, 151936, 1e6, "bfloat16")
    with torch.device("meta"):
        target = Qwen3ForCausalLM(t)
        drafter = DFlashDrafter(d)
    n_target = sum(p.numel() for p in target.parameters())
    n_drafter = sum(p.numel() for p in drafter.parameters())
    assert 8.1e9 < n_target < 8.3e9          # Qwen3-8B: 8.19 B parameters
    assert 1.0e9 < n_drafter < 1.1e9         # 5 layers + fc over 5 taps (the head is the target's)


def test_tiny_checkpoints_load_in_the_services_loaders_and_decode(realsize, tmp_path):
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.engine import Request, VerifierEngine
    from verifier_svc.target import TargetModel

    assert realsize.main(["--out", str(tmp_path), "--tiny", "--device", "cpu",
                          "--shard-gb", "0.0004"]) == 0
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((tmp_path / "target" / s).is_file() for s in shards)
    assert max((tmp_path / "target" / s).stat().st_size for s in shards) < 0.0004 * 2**30 + 2**18
    report = json.loads((tmp_path / "realsize.json").read_text())
    assert report["target"]["shards"] == len(shards)

    target = TargetModel(tmp_path / "target", dtype="auto", device="cpu")
    assert target.dtype == torch.float32             # auto on a CPU, whatever the checkpoint says
    assert target.vocab_size == realsize.TINY["vocab"] and target.rope_theta == 1e6
    drafter = DrafterEngine.from_pretrained(tmp_path / "drafter", tmp_path / "target",
                                            dtype="bfloat16", device="cpu", context_threads=0)
    assert drafter.card.target_layer_ids == tuple(realsize.TINY["taps"])
    assert drafter.card.block_size == 16 and drafter.card.mask_token_id == realsize.TINY["mask_id"]
    engine = VerifierEngine(target, spec_mode="fixed")
    try:
        evs = list(engine.generate(Request(request_id="r", prompt=list(range(3, 20)),
                                           max_tokens=20, ignore_eos=True, proposer=drafter)))
    finally:
        engine.close()
        drafter.close()
    assert sum(len(ev.tokens) for ev in evs) == 20 and sum(ev.drafted for ev in evs) > 0
