"""Release and rollback of a learned version under live traffic: the gate's release becomes
``name@N+1``, served by a drafter process registered as a canary through the admin plane;
its served τ falls below the old version's and it is rolled back automatically; every
stream is greedy-identical before, during and after both swaps; each decision is logged."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from prometheus_client import generate_latest

from dflash.core.checkpoint import load_drafter
from dflash.learn import release as rel
from dflash.learn.learner import LearnConfig, Learner
from dflash.serving.telemetry import Telemetry
from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from drafter_svc.engine import DrafterEngine

from doubles import ReferenceDrafter
from helpers import Stack, reference, wait_until
from learn_helpers import fill_store

THREADS, MAX_NEW = 3, 17
FAST = LearnConfig(lr=3e-3, warmup_steps=5, max_steps=400, ckpt_every=50, eval_every=1000,
                   anchors_per_seq=8)


def test_next_version_and_decision_log(tmp_path):
    assert rel.next_version("6") == "7" and rel.next_version("6a") == "6a.1"
    rel.log_decision(tmp_path, "refused", gain=-0.1)
    rel.log_decision(tmp_path, "released", version="x@2")
    assert [d["decision"] for d in rel.decisions(tmp_path)] == ["refused", "released"]


METRICS = """# TYPE dflash_spec_decode_num_drafts counter
dflash_spec_decode_num_drafts_total{{drafter_version="a@1"}} {d1}
dflash_spec_decode_num_drafts_total{{drafter_version="a@2"}} {d2}
# TYPE dflash_spec_decode_num_accepted_tokens counter
dflash_spec_decode_num_accepted_tokens_total{{drafter_version="a@1"}} {a1}
dflash_spec_decode_num_accepted_tokens_total{{drafter_version="a@2"}} {a2}
"""


def test_rollback_rule_on_a_window_of_counters():
    before = METRICS.format(d1=100, d2=0, a1=150, a2=0)
    worse = METRICS.format(d1=400, d2=300, a1=750, a2=450)      # a@1 2.0 -> 3.0 ... a@2 2.5
    win = rel.window(before, worse)
    assert win["a@1"].tau == pytest.approx(3.0) and win["a@2"].tau == pytest.approx(2.5)
    assert rel.rollback_check(win, "a@1", "a@2", min_drafts=200)[0] == "rollback"
    assert rel.rollback_check(win, "a@1", "a@2", min_drafts=400)[0] == "wait"
    better = METRICS.format(d1=400, d2=300, a1=750, a2=1200)
    assert rel.rollback_check(rel.window(before, better), "a@1", "a@2", min_drafts=200)[0] == "keep"
    # by default the watch waits for thousands of drafted steps a version: at 200, two answers
    # each, the bench kept a worse version on its prompts' luck (docs/learning.md)
    assert rel.rollback_check(win, "a@1", "a@2")[0] == "wait"
    huge = METRICS.format(d1=100 + rel.MIN_DRAFTS, d2=rel.MIN_DRAFTS, a1=150 + 2 * rel.MIN_DRAFTS,
                          a2=int(1.5 * rel.MIN_DRAFTS))
    assert rel.MIN_DRAFTS >= 1000 and rel.rollback_check(rel.window(before, huge), "a@1", "a@2")[0] == "rollback"


def _admin(stack):
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.gateway.admin.port}")
    stack._channels.append(ch)
    return gateway_pb2_grpc.GatewayAdminStub(ch)


def test_release_canary_and_automatic_rollback_under_live_traffic(
        target_model, tokenizer, hf_target, tiny_target, make_drafter, tmp_path):
    from drafter_svc.server import build as build_drafter

    tel = {s: Telemetry(service=s) for s in ("verifier", "gateway", "drafter")}
    stack = Stack(target_model, tokenizer, telemetry=tel.__getitem__)
    stop, threads = threading.Event(), []
    try:
        tp = tokenizer.encode("Hi there")
        ref = tp + reference(hf_target, tp, MAX_NEW)
        refs = {f"w{t}-{i}": ref for t in range(THREADS) for i in range(200)}
        stack.add_drafter(ReferenceDrafter(target_model, refs, block_size=4), default=True)  # oracle@1
        # a learned version: trained on a constructed store, released by the gate
        d0 = make_drafter(block_size=4)
        cfg = load_drafter(d0).cfg
        learn = tmp_path / "learn"
        fill_store(learn / "store", tiny_target, cfg.target_layer_ids, 120,
                   fingerprint=cfg.target_fingerprint)
        learner = Learner(learn, d0, tiny_target, cfg=FAST)
        learner.run(150)
        path = rel.release(learner)
        assert path is not None and path.name == "tiny-drafter@2"
        v2 = build_drafter(DrafterEngine.from_pretrained(path, tiny_target), "127.0.0.1:0")
        v2.server.start()
        v2.set_serving(True)
        stack.drafters.append(v2)

        gw, admin = stack.gateway_stub(), _admin(stack)
        results, errors = [], []

        def load(t):
            i = 0
            while not stop.is_set() and i < 200:
                try:
                    req = gateway_pb2.GenerateRequest(prompt="Hi there", max_tokens=MAX_NEW,
                                                      session_id=f"w{t}-{i}")
                    started = time.monotonic()
                    resps = list(gw.Generate(req))
                    results.append((started, [x for r in resps for x in r.token_ids], resps[-1]))
                except grpc.RpcError as e:
                    errors.append(e)
                i += 1

        threads += [threading.Thread(target=load, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        wait_until(lambda: len(results) >= 6 or errors, 60, "requests before the release")
        scrape = lambda: generate_latest(tel["verifier"].registry).decode()   # noqa: E731
        new = rel.register_canary(admin, f"127.0.0.1:{v2.port}", "oracle@1", 0.5, learn)
        canary_at = time.monotonic()
        assert new == "tiny-drafter@2"
        decision, figures = rel.watch_canary(admin, scrape, "oracle@1", new, learn, min_drafts=5,
                                             poll_s=0.2, timeout_s=90)
        assert decision == "rollback", figures         # the oracle's tau is the block size
        rolled_at = time.monotonic()
        wait_until(lambda: sum(s > rolled_at for s, _, _ in results) >= 3 or errors, 60,
                   "requests after the rollback")
        stop.set()
        for th in threads:
            th.join(60)
        assert not errors, errors
        for _, ids, _last in results:
            assert ids == ref[len(tp):]               # lossless before, during and after
        during = {last.drafter for s, _, last in results if canary_at < s < rolled_at}
        assert new in during
        assert {last.drafter for s, _, last in results if s > rolled_at} == {"oracle@1"}
        log = [d["decision"] for d in rel.decisions(learn)]
        assert log == ["released", "canary", "rollback"]
        assert rel.decisions(learn)[-1]["new_tau"] < rel.decisions(learn)[-1]["old_tau"]
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        stack.close()
