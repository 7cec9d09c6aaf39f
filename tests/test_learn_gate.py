"""The online learner and its release gate on tiny models with constructed stores: a better
candidate passes, a worse one (trained on a poisoned store) never does, training resumes from
its checkpoint and yields between optimizer steps."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from dflash.core.checkpoint import load_drafter
from dflash.learn.gate import ConvScore, GateResult, gate, score
from dflash.learn.learner import LearnConfig, Learner

from learn_helpers import fill_store

N_CONVS = 120                      # 6 held out
FAST = LearnConfig(lr=3e-3, warmup_steps=5, max_steps=400, ckpt_every=20, eval_every=1000,
                   anchors_per_seq=8, margin=0.02)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stores(tiny_target, make_drafter, tmp_path_factory):
    """(random drafter dir, a drafter trained on clean data, clean learn dir, poisoned learn dir)."""
    root = tmp_path_factory.mktemp("learn")
    d0 = make_drafter(block_size=4)
    cfg = load_drafter(d0).cfg
    clean, poison = root / "clean", root / "poison"
    fill_store(clean / "store", tiny_target, cfg.target_layer_ids, N_CONVS,
               fingerprint=cfg.target_fingerprint)
    fill_store(poison / "store", tiny_target, cfg.target_layer_ids, N_CONVS, poisoned=True,
               fingerprint=cfg.target_fingerprint)
    trainer = Learner(root / "v1", d0, tiny_target, cfg=FAST)
    trainer.store = Learner(clean, d0, tiny_target, cfg=FAST).store
    trainer.run(150)
    v1 = trainer.save_candidate(root / "v1_drafter", version="2")
    return d0, v1, clean, poison


def test_gate_accepts_a_better_candidate(stores, tiny_target):
    d0, _, clean, _ = stores
    lr = Learner(clean, d0, tiny_target, cfg=FAST)
    before = lr.evaluate()
    assert not before.release and before.gain == 0.0      # the copy is the serving version
    assert lr.run(150) == 150
    res = lr.evaluate()
    assert res.release, res
    assert res.tau_candidate > res.tau_serving and res.gain_lower > FAST.margin


def test_gate_refuses_a_candidate_trained_on_a_poisoned_store(stores, tiny_target, tmp_path):
    _, v1, clean, poison = stores
    lr = Learner(poison, v1, tiny_target, cfg=FAST)
    lr.run(150)
    on_poison = lr.evaluate()                      # its own (poisoned) held-out slice
    assert not on_poison.release, on_poison
    lr.store = Learner(clean, v1, tiny_target, cfg=FAST).store
    on_clean = lr.evaluate()                       # what it does to real traffic
    assert not on_clean.release and on_clean.gain < 0, on_clean


def test_gate_refuses_a_store_that_does_not_replay_what_was_served(stores, tiny_target, tmp_path,
                                                                    monkeypatch):
    """The poisoned store, recorded as served by version v1 before its labels were shuffled:
    v1's replay finds a fraction of the τ it served, so the gate refuses whatever the gain;
    the clean store with the same records replays all of it."""
    _, v1, _, _ = stores
    cfg = load_drafter(v1).cfg
    for name, poisoned in (("clean", False), ("poison", True)):
        fill_store(tmp_path / name / "store", tiny_target, cfg.target_layer_ids, N_CONVS,
                   poisoned=poisoned, fingerprint=cfg.target_fingerprint, served_by=v1)
    clean = Learner(tmp_path / "clean", v1, tiny_target, cfg=FAST).evaluate()
    assert clean.replay == 1.0 and clean.replay_conversations == 6
    lr = Learner(tmp_path / "poison", v1, tiny_target, cfg=FAST)
    lr.run(20)
    res = lr.evaluate()
    assert res.replay < 0.5 and res.replay_conversations == 6, res
    assert not res.release and "does not replay what was served" in res.reason
    passed = GateResult(release=True, reason="forced", conversations=6, tau_serving=1.0,
                        tau_candidate=2.0, gain=1.0, gain_lower=1.0, wins=6, losses=0,
                        margin=0.02, confidence=0.95)
    monkeypatch.setattr("dflash.learn.learner.gate", lambda *a, **k: passed)  # passes anything ...
    forced = Learner(tmp_path / "poison", v1, tiny_target, cfg=FAST).evaluate()
    assert not forced.release and "does not replay" in forced.reason  # ... still refused


def test_gate_statistics():
    same = [ConvScore(i, 5.0, 10) for i in range(8)]
    better = [ConvScore(i, 8.0, 10) for i in range(8)]
    mixed = [ConvScore(i, 8.0 if i % 2 else 2.0, 10) for i in range(8)]
    assert gate(same, better).release and gate(same, better).wins == 8
    assert not gate(same, same).release
    assert not gate(same, mixed).release                  # same mean, noisy: no gain
    assert not gate(same[:4], better[:4]).release         # too few conversations
    with pytest.raises(ValueError, match="candidate"):
        gate(same, better[1:])
    # Served walks: a drafter that accepts more takes fewer steps through the same tokens, so
    # each side's τ is over its own blocks (27 tokens: 27 steps of 1, or 7 of about 4).
    plain = [ConvScore(i, 0.0, 27) for i in range(8)]
    walks = [ConvScore(i, 20.0, 7) for i in range(8)]
    g = gate(plain, walks)
    assert g.release and g.tau_serving == 1.0 and g.tau_candidate == pytest.approx(27 / 7, abs=1e-4)
    assert g.wins == 8 and not gate(walks, plain).release


def test_gate_releases_a_small_sure_gain_and_refuses_a_small_or_unsure_one():
    """The margin is on the gain, the test only has to show the gain is real: +3% in 20
    conversations, most of it in a quarter of them, is released though its lower bound is
    under 2%; +1%, however
    sure, is not worth a release; +2.6% from two big wins among 18 losses is not sure."""
    base = [ConvScore(i, 10.0, 20) for i in range(20)]           # τ 1.5 each
    small = [ConvScore(i, 10.0 + (3.2 if i % 4 == 0 else 0.2), 20) for i in range(20)]
    g = gate(base, small)
    assert 0.03 <= g.gain < 0.04 and 0 < g.gain_lower < 0.02 and g.release is True, g
    tiny = [ConvScore(i, 10.0 + (0.2 if i % 2 else 0.4), 20) for i in range(20)]
    t = gate(base, tiny)
    assert t.gain < 0.02 and t.gain_lower > 0 and not t.release, t
    lucky = [ConvScore(i, 10.0 + (14.0 if i < 2 else -0.7), 20) for i in range(20)]
    u = gate(base, lucky)
    assert u.gain >= 0.02 and u.gain_lower <= 0 and not u.release, u


def test_a_refused_candidate_starts_afresh_once_its_schedule_is_spent(stores, tiny_target, tmp_path):
    """Refused mid-schedule, the candidate keeps its steps and trains on; refused at the end
    of its schedule, it is dropped and the next starts from the serving version."""
    from dflash.learn.release import decisions, release

    d0, _, clean, _ = stores
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "store").symlink_to(clean / "store")
    cfg = dataclasses.replace(FAST, max_steps=3, margin=100.0)     # nothing passes a 10,000% margin
    lr = Learner(tmp_path / "l", d0, tiny_target, cfg=cfg)
    lr.run(2)
    assert release(lr) is None and lr.step == 2
    assert Learner(tmp_path / "l", d0, tiny_target, cfg=cfg).step == 2     # its checkpoint stays
    assert lr.run(5) == 1 and lr.step == 3
    assert any(not torch.equal(v, lr.serving.state_dict()[k]) for k, v in lr.drafter.state_dict().items())
    assert release(lr) is None and lr.step == 0
    assert all(torch.equal(v, lr.serving.state_dict()[k]) for k, v in lr.drafter.state_dict().items())
    assert Learner(tmp_path / "l", d0, tiny_target, cfg=cfg).step == 0     # no checkpoint to resume
    assert [(d["decision"], d["afresh"]) for d in decisions(tmp_path / "l")] == [
        ("refused", False), ("refused", True)]
    assert lr.run(5) == 3                                                # a full schedule again


def test_learner_resumes_from_its_checkpoint(stores, tiny_target):
    d0, _, clean, _ = stores
    import shutil

    shutil.rmtree(clean / "run", ignore_errors=True)
    a = Learner(clean, d0, tiny_target, cfg=dataclasses.replace(FAST, ckpt_every=10))
    a.run(10)
    w = {k: v.clone() for k, v in a.drafter.state_dict().items()}
    b = Learner(clean, d0, tiny_target, cfg=FAST)
    assert b.step == 10
    assert all(torch.equal(w[k], v) for k, v in b.drafter.state_dict().items())
    a.run(5)
    b.run(5)
    assert all(torch.equal(a.drafter.state_dict()[k], v) for k, v in b.drafter.state_dict().items())
    b.reset()
    assert b.step == 0 and b.evaluate().gain == 0.0          # the serving version's weights again
    assert Learner(clean, d0, tiny_target, cfg=FAST).step == 0


def test_learner_stops_within_one_step_of_a_request(stores, tiny_target):
    d0, _, clean, _ = stores
    lr = Learner(clean, d0, tiny_target, cfg=dataclasses.replace(FAST, ckpt_every=10**6))
    lr.reset()
    t0 = time.perf_counter()
    lr.run(3)
    per_step = (time.perf_counter() - t0) / 3
    arrived = threading.Event()
    th = threading.Thread(target=lr.run, args=(10**6,), kwargs={"should_stop": arrived.is_set})
    th.start()
    time.sleep(0.3)
    t_req = time.perf_counter()
    arrived.set()
    th.join(30)
    waited = time.perf_counter() - t_req
    # the bound: one optimizer step plus the final checkpoint write, with room for shared cores
    assert waited < 3 * per_step + 1.0, (waited, per_step)


def test_score_is_paired_by_conversation(stores, tiny_target):
    d0, v1, clean, _ = stores
    lr = Learner(clean, d0, tiny_target, cfg=FAST)
    held = lr.heldout()
    a = score(lr.serving, lr.head, held)
    b = score(lr.serving, lr.head, list(reversed(held)))
    assert sorted(a, key=lambda s: s.seq) == sorted(b, key=lambda s: s.seq)
    assert [s.seq for s in a] == [int(c["seq"]) for c in held]


def test_training_softmax_is_the_seen_ids_then_the_full_vocabulary(stores, tiny_target):
    d0, _, clean, _ = stores
    lr = Learner(clean, d0, tiny_target, cfg=dataclasses.replace(FAST, max_steps=10, full_vocab_after=0.5))
    lr.reset()
    lr.reload()
    head_w, label_map = lr.softmax_head()
    seen = torch.unique(torch.cat([c["input_ids"] for c in lr.train_convs]))
    assert head_w.shape[0] == len(seen) < lr.head.vocab_size
    assert (label_map[seen] >= 0).all() and torch.equal(head_w[label_map[seen]], lr.head.lm_head[seen])
    lr.run(5)
    assert lr.softmax_head()[1] is None and lr.softmax_head()[0] is lr.head.lm_head
