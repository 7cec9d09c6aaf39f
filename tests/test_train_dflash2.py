"""Training a DFlash2 drafter: warm-started from a DFlash drafter it starts equal to it (same
held-out acceptance), its batched blocks equal separate inference blocks (the convolution never
crosses a block), the selector learns, and a run resumes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dflash.core.checkpoint import load_drafter, load_target_head, target_fingerprint
from dflash.core.dflash2 import DFlash2Drafter
from dflash.recipe.blocks import build_batch
from dflash.train.featcache import as_numpy_seq
from dflash.train.tokdata import TokenStore
from dflash.train.trainer import TrainConfig, Trainer
from dflash_app.testing import make_tiny_target

B, MASK_ID = 4, 259


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train2")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    fp = target_fingerprint(json.loads((Path(target) / "config.json").read_text()),
                            load_target_head(str(target)).embed)
    rng = random.Random(0)
    seqs = []
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(5)]
        resp = [97 + (j % 5) for j in range(24 + i)]
        seqs.append(as_numpy_seq(prompt + resp, 5))
    TokenStore(root / "data", fingerprint=fp).add("shard_t_s0_0000.npz", seqs, source="t",
                                                  vocab_size=260)
    return target, root / "data", root


def cfg(tiny, run, **kw):
    target, data, root = tiny
    base = dict(data_dir=str(data), target_dir=str(target), run_dir=str(root / run),
                block_size=B, num_layers=1, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_taps=2, mask_token_id=MASK_ID, lr=5e-3, warmup_ratio=0.1,
                max_steps=12, seqs_per_step=2, anchors_per_seq=4, log_every=4, vocab_subset=True,
                ckpt_every_min=60.0, heldout_every=4, topk=4, cache_dir=str(root / "featcache"),
                draft_vocab_size=0, conv_group_size=16, selector_rank=8, selector_top_k=4)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def v1(tiny):
    _, _, root = tiny
    Trainer(cfg(tiny, "v1", out_dir=str(root / "v1-out"), max_steps=15)).train()
    return root / "v1-out"


def test_warm_start_from_dflash_keeps_its_heldout_acceptance(tiny, v1):
    base = Trainer(cfg(tiny, "v1-eval", init_from=str(v1), max_steps=0))
    t2 = Trainer(cfg(tiny, "v2-eval", init_from=str(v1), architecture="dflash2", max_steps=0))
    assert isinstance(t2.drafter, DFlash2Drafter)
    a, b = base.evaluate_heldout(), t2.evaluate_heldout()
    assert a["blocks"] > 0 and a["tau"] == b["tau"] and a["acc_pos"] == b["acc_pos"]


def test_batched_blocks_equal_separate_blocks(tiny):
    tr = Trainer(cfg(tiny, "mask2", architecture="dflash2"))
    d, head = tr.drafter.eval(), tr.head
    with torch.no_grad():                # make the convolution act
        for layer in d.layers:
            for c in (layer.attention_conv, layer.mlp_conv):
                c.base_kernel.normal_(0.0, 0.5)
                c.kernel_projection.weight.normal_(0.0, 0.2)
    s, anchors = tr.seqs[0], [6, 11, 17]
    batch = build_batch([s], [anchors], block_size=B, mask_token_id=MASK_ID, gamma=4.0)
    with torch.no_grad():
        kv = d.context_kv(batch.ctx_features.float(), batch.ctx_positions)
        joint = d(head.embed_tokens(batch.block_ids), batch.block_positions, kv, batch.mask,
                  block_len=B)
        for j, a in enumerate(anchors):
            kv1 = d.context_kv(s["taps"][None, :a].float(), torch.arange(a)[None])
            ids = torch.tensor([[int(s["input_ids"][a])] + [MASK_ID] * (B - 1)])
            one = d(head.embed_tokens(ids), torch.arange(a, a + B)[None], kv1)
            torch.testing.assert_close(joint[0, j * B:(j + 1) * B], one[0], atol=1e-4, rtol=1e-4)


def test_trains_resumes_and_saves_a_dflash2_drafter(tiny, v1):
    _, _, root = tiny
    c = cfg(tiny, "v2", init_from=str(v1), architecture="dflash2", out_dir=str(root / "v2-out"))
    first = Trainer(c)
    proj0 = first.drafter.candidate_selector.hidden_projection.weight.clone()
    assert first.train(stop_at_step=6)["interrupted"]
    assert not torch.equal(first.drafter.candidate_selector.hidden_projection.weight, proj0)
    again = Trainer(c)
    summary = again.train(resume=True)
    assert summary["steps"] == 12
    saved = load_drafter(root / "v2-out")
    assert isinstance(saved, DFlash2Drafter) and saved.cfg.selector_top_k == 4
