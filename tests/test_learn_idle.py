"""The learner inside the drafter: it trains while the drafter is idle, stops for requests
(a draft's latency stays within one optimizer step of its latency without learning), shows
its progress as Prometheus gauges and in ``dflash learn status``."""

from __future__ import annotations

import json
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from dflash.core.checkpoint import load_drafter
from dflash.core.proposer import ProposalRequest
from dflash.core.sampling import Sampling
from dflash.learn.idle import IdleLearner
from dflash.learn.learner import LearnConfig, Learner
from dflash_app import learn as learn_cli
from drafter_svc.engine import DrafterEngine

from helpers import wait_until
from learn_helpers import fill_store

CFG = LearnConfig(lr=3e-3, warmup_steps=5, max_steps=10**6, ckpt_every=10**6, eval_every=50)


@pytest.fixture(scope="module")
def learn_dir(tiny_target, make_drafter, tmp_path_factory):
    d = tmp_path_factory.mktemp("idle")
    cfg = load_drafter(make_drafter(block_size=4)).cfg
    fill_store(d / "store", tiny_target, cfg.target_layer_ids, 60, fingerprint=cfg.target_fingerprint)
    return d


def _draft(engine, i: int) -> float:
    ctx = torch.randn(6, engine.cfg.context_size)
    t0 = time.perf_counter()
    engine.propose([ProposalRequest(session_id=f"r{i}", context_start=0, context=ctx,
                                    anchor_token=97, block_size=4, sampling=Sampling())])
    return time.perf_counter() - t0


def test_idle_learner_trains_when_idle_and_yields_to_requests(learn_dir, tiny_target, make_drafter):
    d0 = make_drafter(block_size=4)
    engine = DrafterEngine.from_pretrained(d0, tiny_target)
    engine.warmup()
    quiet = sorted(_draft(engine, i) for i in range(10))[5]          # median, no learner
    learner = Learner(learn_dir, d0, tiny_target, cfg=CFG)
    learner.reset()
    t0 = time.perf_counter()
    learner.run(3)
    per_step = (time.perf_counter() - t0) / 3
    registry = CollectorRegistry()
    idle = IdleLearner(engine, learner, idle_s=0.3, registry=registry, steps_per_round=5).start()
    try:
        wait_until(lambda: learner.step >= 10, 60, "the learner to train while idle")
        # a burst of requests closer than idle_s: the learner makes at most the step in flight
        before = learner.step
        waits = []
        for i in range(20):
            waits.append(_draft(engine, 100 + i))
            time.sleep(0.05)
        assert learner.step - before <= 1
        # stated bound: a draft waits at most one optimizer step more than without learning
        assert max(waits) < quiet + per_step + 0.5, (max(waits), quiet, per_step)
        text = generate_latest(registry).decode()
        assert 'dflash_learn_steps{base="tiny-drafter@1"}' in text
        assert 'dflash_learn_store_conversations{split="heldout"} 3.0' in text
    finally:
        idle.close()
        engine.close()


def test_status_shows_store_progress_and_decisions(learn_dir, tiny_target, make_drafter, capsys):
    from dflash.learn import release as rel

    lr = Learner(learn_dir, make_drafter(block_size=4), tiny_target, cfg=CFG)
    lr.run(2)
    lr.log_heldout()
    rel.release(lr)                                 # too little: refused, logged
    assert learn_cli.main(["learn", "status", "--learn-dir", str(learn_dir), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["store"]["train"] == 57 and s["store"]["heldout"] == 3
    assert s["learner"]["step"] == lr.step and s["learner"]["heldout_curve"][-1]["tau"] >= 1.0
    assert s["decisions"][-1]["decision"] == "refused"
    assert learn_cli.main(["learn", "status", "--learn-dir", str(learn_dir)]) == 0
    text = capsys.readouterr().out
    assert "57 training + 3 held-out conversations" in text and "refused" in text


def test_cli_train_then_release_refused_or_forced(learn_dir, tiny_target, make_drafter, capsys):
    d0 = str(make_drafter(block_size=4))
    common = ["--learn-dir", str(learn_dir), "--drafter", d0, "--target", str(tiny_target)]
    assert learn_cli.main(["learn", "train", *common, "--steps", "3"]) == 0
    assert "held-out tau" in capsys.readouterr().out
    assert learn_cli.main(["learn", "release", *common]) == 1       # 3 held-out: too few
    assert '"decision": "refused"' in capsys.readouterr().out
    assert not (learn_dir / "versions").exists()
    assert learn_cli.main(["learn", "release", *common, "--force"]) == 0
    out = learn_dir / "versions" / "tiny-drafter@2"
    assert load_drafter(out).cfg.version == "2"
    assert '"decision": "forced"' in capsys.readouterr().out
    assert learn_cli.main(["learn", "release", *common, "--force"]) == 2   # still based on @1
    assert "released already" in capsys.readouterr().err
