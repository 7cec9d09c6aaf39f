"""Drafter training on a tiny random target: block mask, loss weights, overfit, resume."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from dflash.recipe.blocks import block_mask, build_batch, position_weights, valid_anchors
from dflash.recipe.loss import batch_loss
from dflash.train.featcache import as_numpy_seq
from dflash.train.tokdata import TokenStore
from dflash.train.trainer import TrainConfig, Trainer
from dflash_app.testing import make_tiny_target

B = 4
MASK_ID = 259          # "<|mask|>" of the tiny byte tokenizer


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _fingerprint(target) -> str:
    import json

    from dflash.core.checkpoint import load_target_head, target_fingerprint

    return target_fingerprint(json.loads((Path(target) / "config.json").read_text()),
                              load_target_head(str(target)).embed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny target + a token store with one shard of repetitive sequences (features are
    computed into the run's cache by the trainer)."""
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    rng = random.Random(0)
    seqs = []
    for i in range(6):
        prompt = [rng.randrange(256) for _ in range(5)]
        resp = [97 + (j % 5) for j in range(24 + i)]          # "abcdeabcde..." (learnable)
        seqs.append(as_numpy_seq(prompt + resp, 5))
    data = root / "data"
    TokenStore(data, fingerprint=_fingerprint(target)).add("shard_t_s0_0000.npz", seqs, source="t",
                                                           vocab_size=260)
    return target, data, root


def _cfg(tiny, run, **kw):
    target, data, root = tiny
    base = dict(data_dir=str(data), target_dir=str(target), run_dir=str(root / run),
                block_size=B, num_layers=1, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_taps=2, mask_token_id=MASK_ID, lr=5e-3, warmup_ratio=0.1,
                max_steps=20, seqs_per_step=2, anchors_per_seq=4, log_every=5, vocab_subset=False,
                ckpt_every_min=60.0, heldout_every=0, topk=4, cache_dir=str(root / "featcache"))
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
    curve = lambda run: [r.split(",")[4] for r in (Path(run) / "train_log.csv").read_text().splitlines()[1:]]
    assert curve(full.cfg.run_dir) == curve(resumed.cfg.run_dir) and len(curve(full.cfg.run_dir)) == 2
    run = Path(resumed.cfg.run_dir)
    assert sorted(p.name for p in run.glob("ckpt*")) == ["ckpt.json", "ckpt.safetensors"]


def test_torn_checkpoint_is_refused(tiny):
    """The JSON and the tensors of a checkpoint must be of the same step."""
    import json

    from dflash.recipe import ckpt

    t = Trainer(_cfg(tiny, "torn", max_steps=3, vocab_subset=True))
    t.train()
    run = Path(t.cfg.run_dir)
    meta = json.loads((run / "ckpt.json").read_text())
    meta["step"] = 2
    (run / "ckpt.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="step 3"):
        ckpt.load(run)


def test_final_save_is_loadable(tiny):
    from dflash.core.checkpoint import load_drafter

    target, data, root = tiny
    tr = Trainer(_cfg(tiny, "save", max_steps=2, out_dir=str(root / "drafter")))
    tr.train()
    d = load_drafter(root / "drafter")
    assert d.cfg.block_size == B and d.cfg.mask_token_id == MASK_ID and d.cfg.version == "1"
    assert d.cfg.target_fingerprint.startswith("sha256:")
    from dflash.core.draft_vocab import load_draft_vocab

    ids = load_draft_vocab(root / "drafter", d.cfg.vocab_size)   # most frequent response ids first
    store = TokenStore(data)
    seqs = store.read(store.shards()[0])
    assert len(seqs) == 6
    resp = torch.cat([torch.from_numpy(s.ids[s.loss_mask.astype(bool)]) for s in seqs])
    counts = torch.bincount(resp, minlength=d.cfg.vocab_size)
    assert ids.numel() == min(16384, d.cfg.vocab_size)
    assert counts[ids[0]] == counts.max() and (counts[ids[:-1]] >= counts[ids[1:]]).all()


def test_new_shards_are_picked_up_and_resume_keeps_order(tiny, tmp_path):
    import shutil

    target, data, root = tiny
    d2 = tmp_path / "data"
    shutil.copytree(data, d2)
    store = TokenStore(d2)
    first = store.shards()[0]
    (d2 / first["name"]).rename(d2 / "shard_t_s0_0005.npz")      # listed under another name
    first["name"] = "shard_t_s0_0005.npz"
    store.save()
    tr = Trainer(_cfg(tiny, "reload", data_dir=str(d2), vocab_subset=True, max_steps=4))
    n0, v0 = len(tr.seqs), len(tr.vocab)
    s = tr.seqs[0]
    extra = [as_numpy_seq(s["input_ids"].tolist()[:-1] + [258], 5)]
    TokenStore(d2).add("shard_t_s0_0001.npz", extra, source="t", vocab_size=260)
    assert tr.add_shards() == 1 and len(tr.seqs) == n0 + 1 and len(tr.vocab) == v0 + 1
    assert tr.shards == ["shard_t_s0_0005.npz", "shard_t_s0_0001.npz"]
    tr.train()
    again = Trainer(_cfg(tiny, "reload", data_dir=str(d2), vocab_subset=True, max_steps=4))
    assert again.shards[0] == "shard_t_s0_0001.npz"            # sorted on a fresh start ...
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


def test_distillation_heldout_and_warm_start(tiny):
    """kl_weight trains on the target's top-k distribution; the held-out split is stable and
    evaluated; a saved drafter warm-starts a run exactly."""
    target, data, root = tiny
    tr = Trainer(_cfg(tiny, "kl", kl_weight=0.5, heldout_every=3, max_steps=15,
                      out_dir=str(root / "kl_drafter")))
    again = Trainer(_cfg(tiny, "kl2", kl_weight=0.5, heldout_every=3))
    assert len(tr.heldout) >= 1 and len(tr.heldout) + len(tr.seqs) == 6
    assert [h["input_ids"].tolist() for h in tr.heldout] == [h["input_ids"].tolist() for h in again.heldout]
    batch = tr.next_batch()
    assert batch.soft_ids is not None and torch.allclose(
        batch.soft_p[batch.labels >= 0].sum(-1), torch.ones(int((batch.labels >= 0).sum())))
    with torch.no_grad():
        hard, _ = batch_loss(tr.drafter, tr.head, batch, tr.head_w, tr.label_map, 64, 0.0)
        mixed, _ = batch_loss(tr.drafter, tr.head, batch, tr.head_w, tr.label_map, 64, 0.5)
    assert not torch.isclose(hard, mixed)
    before = tr.evaluate_heldout()
    summary = tr.train()
    assert summary["heldout"]["blocks"] == before["blocks"] > 0
    assert summary["heldout"]["loss"] < before["loss"]
    log = (tr.run_dir / "heldout_log.csv").read_text().splitlines()
    assert log[0].startswith("step,") and [r.split(",")[0] for r in log[1:]] == ["0", "15"]
    warm = Trainer(_cfg(tiny, "warm", init_from=str(root / "kl_drafter"), heldout_every=3))
    for k, v in warm.drafter.state_dict().items():        # bf16 save: equal to bf16 rounding
        torch.testing.assert_close(v, tr.drafter.state_dict()[k].to(torch.bfloat16).float(), msg=k)
    with pytest.raises(ValueError, match="init_from"):
        Trainer(_cfg(tiny, "warm2", init_from=str(root / "kl_drafter"), num_layers=2))
