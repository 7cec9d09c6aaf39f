"""Drafter training on a tiny random target: block mask, loss weights, overfit, resume."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from dflash.config import default_target_layer_ids
from dflash.testing import make_tiny_target
from dflash.train.blocks import block_mask, build_batch, position_weights, valid_anchors
from dflash.train.data import Sequence, batch_taps, load_target, read_shards, write_shard
from dflash.train.trainer import Trainer, TrainConfig, batch_loss

B = 4
MASK_ID = 259          # "<|mask|>" of the tiny byte tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)     # tiny matmuls; avoids OpenMP oversubscription on shared cores
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny target + one shard of repetitive sequences with their taps."""
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    model, _ = load_target(str(target))
    ids = tuple(default_target_layer_ids(6, 2))
    rng = random.Random(0)
    seqs = []
    for i in range(6):
        prompt = [rng.randrange(256) for _ in range(5)]
        resp = [97 + (j % 5) for j in range(24 + i)]          # "abcdeabcde..." (learnable)
        seqs.append(Sequence(input_ids=prompt + resp, loss_mask=[0] * 5 + [1] * len(resp)))
    data = root / "data"
    data.mkdir()
    write_shard(data / "shard_00000.safetensors", seqs, batch_taps(model, seqs, ids))
    return target, data, root


def _cfg(tiny, run, **kw):
    target, data, root = tiny
    base = dict(data_dir=str(data), target_dir=str(target), run_dir=str(root / run),
                block_size=B, num_layers=1, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_taps=2, mask_token_id=MASK_ID, lr=5e-3, warmup_ratio=0.1,
                max_steps=20, seqs_per_step=2, anchors_per_seq=4, log_every=5, vocab_subset=False,
                ckpt_every_min=60.0)
    base.update(kw)
    return TrainConfig(**base)


def test_block_mask_hides_anchor_feature_and_other_blocks():
    m = block_mask([3, 6], ctx_len=8, block_size=B, num_blocks=3)    # [12, 8 + 12]
    ctx, blk = m[:, :8], m[:, 8:]
    assert ctx[0:4, :3].all() and not ctx[0:4, 3:].any()             # block 0: ctx < 3 only
    assert ctx[4:8, :6].all() and not ctx[4:8, 6:].any()             # block 1: ctx < 6 only
    assert not ctx[8:].any()                                         # padding block: no ctx
    for j in range(3):
        own = torch.zeros(12, dtype=torch.bool)
        own[j * B:(j + 1) * B] = True
        assert (blk[j * B:(j + 1) * B] == own).all()                 # own block only


def test_position_weights_and_labels():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    s = {"input_ids": torch.arange(10), "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0]),
         "taps": torch.zeros(10, 3)}
    assert valid_anchors(s["loss_mask"]).tolist() == [2, 3, 4, 5, 6]
    b = build_batch([s], [[2, 6]], block_size=B, mask_token_id=MASK_ID, gamma=4.0)
    assert b.block_ids[0].tolist() == [2, MASK_ID, MASK_ID, MASK_ID, 6, MASK_ID, MASK_ID, MASK_ID]
    assert b.block_positions[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    # block at 6: position 7 is a response token, 8 and 9 have loss_mask 0 -> excluded
    assert b.labels[0].tolist() == [-100, 3, 4, 5, -100, 7, -100, -100]
    assert torch.allclose(b.weights[0, 1:4], position_weights(B, 4.0)[1:])


def test_batched_blocks_equal_separate_blocks(tiny):
    """The training mask makes N blocks in one forward equal N separate inference forwards."""
    tr = Trainer(_cfg(tiny, "mask"))
    s = tr.seqs[0]
    anchors = [6, 11, 17]
    batch = build_batch([s], [anchors], block_size=B, mask_token_id=MASK_ID, gamma=4.0)
    d, head = tr.drafter.eval(), tr.head
    with torch.no_grad():
        kv = d.context_kv(batch.ctx_features.float(), batch.ctx_positions)
        joint = d(head.embed_tokens(batch.block_ids), batch.block_positions, kv, batch.mask)
        for j, a in enumerate(anchors):
            kv1 = d.context_kv(s["taps"][None, :a].float(), torch.arange(a)[None])
            ids = torch.tensor([[int(s["input_ids"][a])] + [MASK_ID] * (B - 1)])
            one = d(head.embed_tokens(ids), torch.arange(a, a + B)[None], kv1)
            torch.testing.assert_close(joint[0, j * B:(j + 1) * B], one[0], atol=1e-4, rtol=1e-4)


def test_loss_decreases_on_tiny_overfit(tiny):
    tr = Trainer(_cfg(tiny, "overfit"))
    batch = build_batch(tr.seqs[:2], [[8, 12, 16], [9, 13, 17]], block_size=B, mask_token_id=MASK_ID,
                        gamma=4.0)
    with torch.no_grad():
        before, _ = batch_loss(tr.drafter, tr.head, batch, tr.head_w, tr.label_map, 64)
    tr.train()
    with torch.no_grad():
        after, stats = batch_loss(tr.drafter, tr.head, batch, tr.head_w, tr.label_map, 64)
    assert after < 0.8 * before, (before, after)
    assert (tr.run_dir / "train_log.csv").is_file() and (tr.run_dir / "train_loss.png").is_file()


def test_resume_matches_uninterrupted_run(tiny):
    full = Trainer(_cfg(tiny, "full", max_steps=12, vocab_subset=True))
    full.train()
    part = Trainer(_cfg(tiny, "part", max_steps=12, vocab_subset=True))
    assert part.train(stop_at_step=5)["interrupted"]
    resumed = Trainer(_cfg(tiny, "part", max_steps=12, vocab_subset=True))
    resumed.train(resume=True)
    assert resumed.step == 12
    for (k, a), b in zip(full.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    run = Path(resumed.cfg.run_dir)
    assert sorted(p.name for p in run.glob("ckpt*")) == ["ckpt.json", "ckpt.safetensors"]


def test_torn_checkpoint_is_refused(tiny):
    """The JSON and the tensors of a checkpoint must be of the same step."""
    import json

    from dflash.train import ckpt

    t = Trainer(_cfg(tiny, "torn", max_steps=3, vocab_subset=True))
    t.train()
    run = Path(t.cfg.run_dir)
    meta = json.loads((run / "ckpt.json").read_text())
    meta["step"] = 2
    (run / "ckpt.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="step 3"):
        ckpt.load(run)


def test_final_save_is_loadable(tiny):
    from dflash.checkpoint import load_drafter

    target, data, root = tiny
    tr = Trainer(_cfg(tiny, "save", max_steps=2, out_dir=str(root / "drafter")))
    tr.train()
    d = load_drafter(root / "drafter")
    assert d.cfg.block_size == B and d.cfg.mask_token_id == MASK_ID and d.cfg.version == "1"
    assert d.cfg.target_fingerprint.startswith("sha256:")
    assert len(read_shards(data)) == 6
    from dflash.draft_vocab import load_draft_vocab

    ids = load_draft_vocab(root / "drafter", d.cfg.vocab_size)   # most frequent response ids first
    seqs = read_shards(data)
    resp = torch.cat([s["input_ids"][s["loss_mask"].bool()] for s in seqs])
    counts = torch.bincount(resp, minlength=d.cfg.vocab_size)
    assert ids.numel() == min(16384, d.cfg.vocab_size)
    assert counts[ids[0]] == counts.max() and (counts[ids[:-1]] >= counts[ids[1:]]).all()


def test_new_shards_are_picked_up_and_resume_keeps_order(tiny, tmp_path):
    import shutil

    target, data, root = tiny
    d2 = tmp_path / "data"
    d2.mkdir()
    shutil.copy(data / "shard_00000.safetensors", d2 / "shard_00005.safetensors")
    tr = Trainer(_cfg(tiny, "reload", data_dir=str(d2), vocab_subset=True, max_steps=4))
    n0, v0 = len(tr.seqs), len(tr.vocab)
    s = tr.seqs[0]
    extra = [Sequence(input_ids=s["input_ids"].tolist()[:-1] + [258], loss_mask=s["loss_mask"].tolist())]
    write_shard(d2 / "shard_00001.safetensors", extra, [s["taps"]])
    assert tr.add_shards() == 1 and len(tr.seqs) == n0 + 1 and len(tr.vocab) == v0 + 1
    assert tr.shards == ["shard_00005.safetensors", "shard_00001.safetensors"]
    tr.train()
    again = Trainer(_cfg(tiny, "reload", data_dir=str(d2), vocab_subset=True, max_steps=4))
    assert again.shards[0] == "shard_00001.safetensors"       # sorted on a fresh start ...
    again.load_checkpoint()
    assert again.shards == tr.shards                          # ... checkpoint order on resume
    assert torch.equal(again.head_w, tr.head_w)


def test_full_vocab_phase(tiny):
    tr = Trainer(_cfg(tiny, "fullphase", vocab_subset=True, full_vocab_after=0.5, max_steps=4))
    assert tr.softmax_head()[1] is not None and tr.softmax_head()[0].shape[0] < tr.head.vocab_size
    tr.step = 2
    w, m = tr.softmax_head()
    assert m is None and w.shape[0] == tr.head.vocab_size
    tr.train(resume=False)


def test_train_until_budget_spans_the_resumed_run(tmp_path):
    """--train-until with --resume: minutes already trained count into the schedule's budget."""
    import json
    import time as _time

    from dflash.train.__main__ import budget_until

    now = _time.struct_time((2026, 11, 30, 6, 20, 0, 0, 334, 0))
    assert budget_until("07:20", tmp_path, resume=True, now=now) == 58.0
    (tmp_path / "ckpt.json").write_text(json.dumps({"elapsed": 40 * 60.0}))
    assert budget_until("07:20", tmp_path, resume=False, now=now) == 58.0
    assert budget_until("07:20", tmp_path, resume=True, now=now) == 98.0
    with pytest.raises(ValueError, match="train_until"):
        budget_until("7h", tmp_path, resume=False, now=now)
