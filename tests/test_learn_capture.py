"""Online-learning capture: a bounded, crash-safe store; committed tokens rebuilt exactly from
what the drafter sees; no-learn sessions never kept; drafts unchanged with capture on."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from dflash.core.proposer import DraftError, FallbackReason, Proposal, ProposalRequest
from dflash.core.sampling import Sampling
from dflash.learn.capture import Capture
from dflash.learn.store import HELDOUT_EVERY, CaptureStore
from drafter_svc.engine import DrafterEngine

from helpers import PROMPTS, assert_same_tokens, generate_ids, reference, spec, wait_until

KH = 12


def _conv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (n,), generator=g)
    mask = (torch.arange(n) >= n // 3).to(torch.uint8)
    return ids, mask, torch.randn(n, KH, generator=g).to(torch.bfloat16)


def test_store_keeps_its_budget_oldest_first_and_private_modes(tmp_path):
    one = CaptureStore(tmp_path / "probe", max_bytes=1 << 30)
    size = one.add(*_conv(50, 0)).stat().st_size
    store = CaptureStore(tmp_path / "s", max_bytes=int(size * 3.5))
    for i in range(10):
        store.add(*_conv(50, i))
    seqs = [s for s, _ in store.files()]
    assert seqs == [7, 8, 9]                       # the three newest fit
    assert store.nbytes() <= store.max_bytes
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for _, p in store.files())
    got = store.read("train")
    want = _conv(50, 9)
    assert torch.equal(got[-1]["input_ids"], want[0]) and torch.equal(got[-1]["taps"], want[2])
    assert CaptureStore(tmp_path / "s", max_bytes=10**9)._next == 10   # numbering resumes


def test_every_20th_conversation_is_held_out(tmp_path):
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    for i in range(2 * HELDOUT_EVERY + 1):
        store.add(*_conv(8, i))
    held = [int(d["seq"]) for d in store.read("heldout")]
    assert held == [0, HELDOUT_EVERY, 2 * HELDOUT_EVERY]
    assert len(store.read("train")) == 2 * HELDOUT_EVERY - 2
    with pytest.raises(ValueError, match="split"):
        store.read("test")


WRITER = """
import os, sys, time, torch
import dflash.learn.store as st
real, files = os.write, [0]

def write(fd, data):                # the 4th file: half written, then held until killed
    if files[0] == 3:
        real(fd, bytes(data[:len(data) // 2]))
        print("mid", flush=True)
        time.sleep(60)
    return real(fd, data)

st.os.write = write
s = st.CaptureStore(sys.argv[1], max_bytes=1 << 40)
while True:
    s.add(torch.arange(20000), torch.ones(20000, dtype=torch.uint8), torch.randn(20000, 256).bfloat16())
    files[0] += 1
    print(files[0], flush=True)
"""


def test_sigkill_during_a_write_leaves_a_valid_store(tmp_path):
    d = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], stdout=subprocess.PIPE, env=env)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert lines == [b"1", b"2", b"3", b"mid"], lines
        assert len(list(d.glob("*.tmp"))) == 1            # killed mid-write, really
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    store = CaptureStore(d, max_bytes=1 << 40)
    assert not list(d.glob("*.tmp"))      # a new writer clears a killed one's temp file
    got = store.read("train") + store.read("heldout")
    assert len(got) == 3 == len(store.files())
    assert all(g["taps"].shape == (20000, 256) and torch.equal(g["input_ids"], torch.arange(20000))
               for g in got)
    assert store.add(*_conv(10, 0)).name == "conv_00000003.safetensors"   # numbering goes on


def _req(sid, start, ctx, anchor, block, no_learn=False, ids=()):
    return ProposalRequest(session_id=sid, context_start=start, context=ctx, anchor_token=anchor,
                           block_size=block, sampling=Sampling(), no_learn=no_learn,
                           context_ids=tuple(ids))


def test_sent_ids_label_a_step_the_drafter_was_not_called_for(tmp_path):
    """A chain of 3 drafts, 1 accepted with bonus 7, then a step without a draft call that
    committed 8: the next call's 3 rows cover both steps. Inferred from the drafts, row 2 would
    be labelled with the rejected draft 12; the ids the verifier sends say 7, and the
    conversation is not recorded as served by greedy chains."""
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, min_answer_tokens=1, served_by="d@1")
    taps = torch.randn(10, KH)
    cap.observe([_req("a", 0, taps[:3], 10, 4, ids=[-1, -1, -1])],
                [Proposal(tokens=torch.tensor([11, 12, 13]))])
    cap.observe([_req("a", 3, taps[3:6], 8, 4, ids=[10, 11, 7])],
                [Proposal(tokens=torch.tensor([20, 21, 22]))])
    cap.observe([_req("a", 6, taps[6:8], 21, 4, ids=[8, 20])],
                [Proposal(tokens=torch.tensor([30, 31, 32]))])
    cap.close()
    (conv,) = store.read("heldout")
    assert conv["input_ids"].tolist() == [0, 0, 0, 10, 11, 7, 8, 20, 21]
    assert conv["loss_mask"].tolist() == [0, 0, 0] + [1] * 6
    assert "served" not in conv


def test_ids_sent_for_a_greedy_chain_keep_its_served_record(tmp_path):
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, min_answer_tokens=1, served_by="d@1")
    taps = torch.randn(10, KH)
    cap.observe([_req("a", 0, taps[:3], 10, 4, ids=[-1, -1, -1])],
                [Proposal(tokens=torch.tensor([11, 12, 13]))])
    cap.observe([_req("a", 3, taps[3:6], 7, 4, ids=[10, 11, 12])],
                [Proposal(tokens=torch.tensor([20, 21, 22]))])
    cap.close()
    (conv,) = store.read("heldout")
    assert conv["input_ids"].tolist() == [0, 0, 0, 10, 11, 12, 7]
    assert (conv["served"].steps, conv["served"].tokens) == (1, 3)


def test_committed_tokens_rebuilt_from_drafts_and_anchors(tmp_path):
    """A verifier-shaped run: the prompt's taps, then per step the taps of the accepted
    positions and the bonus; accepted drafts come from the previous proposal."""
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, stop_ids={99}, min_answer_tokens=1)
    B, prompt = 4, 5
    answer = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    taps = torch.randn(prompt + len(answer), KH)
    # step 0: prompt taps, anchor answer[0]; proposal drafts answer[1:3] then a wrong one
    cap.observe([_req("a", 0, taps[:prompt], answer[0], B)],
                [Proposal(tokens=torch.tensor([11, 12, 50]))])
    # step 1: 2 accepted (+ anchor row) -> rows prompt..prompt+2, bonus answer[3]; tree next
    cap.observe([_req("a", prompt, taps[prompt:prompt + 3], answer[3], B)],
                [Proposal(tokens=torch.tensor([14, 15, 16]))])
    # step 2: all 3 accepted: rows for answer[3..6], bonus answer[7]; a context-only update next
    cap.observe([_req("a", prompt + 3, taps[prompt + 3:prompt + 7], answer[7], 1)],
                [Proposal(tokens=torch.empty(0, dtype=torch.int64))])
    # step 3: one token committed without speculation
    cap.observe([_req("a", prompt + 7, taps[prompt + 7:prompt + 8], answer[8], 1)],
                [Proposal(tokens=torch.empty(0, dtype=torch.int64))])
    cap.close()
    (conv,) = store.read("heldout")       # the first conversation: seq 0 is held out
    n = prompt + len(answer)
    assert conv["input_ids"].tolist() == [0] * prompt + answer
    assert conv["loss_mask"].tolist() == [0] * prompt + [1] * len(answer)
    assert torch.equal(conv["taps"][:n - 1], taps[:n - 1].bfloat16())
    assert not conv["taps"][n - 1].any()


def test_unknown_tokens_are_never_labelled(tmp_path):
    """Rows past what the last chain proposal covers (a tree step, suffix drafts, a new turn
    after a stop token) get loss_mask 0."""
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, stop_ids={99}, min_answer_tokens=1)
    taps = torch.randn(30, KH)
    cap.observe([_req("a", 0, taps[:3], 20, 4)], [Proposal(tokens=torch.tensor([21, 99, 7]))])
    # 2 accepted, the second a stop token; then a new turn's 4 prompt rows arrive with them
    cap.observe([_req("a", 3, taps[3:10], 40, 4)], [Proposal(tokens=torch.tensor([1, 2, 3]))])
    # 5 rows after a chain of 3 drafts: more than it covers
    cap.observe([_req("a", 10, taps[10:16], 41, 1)], [Proposal(tokens=torch.empty(0, dtype=torch.int64))])
    cap.close()
    (conv,) = store.read("heldout")
    mask = conv["loss_mask"].tolist()
    assert conv["input_ids"].tolist()[3:6] == [20, 21, 99] and mask[3:6] == [1, 1, 1]
    assert mask[6:10] == [0] * 4 and mask[10] == 1          # the new turn's prompt; its bonus
    assert mask[11:16] == [0] * 5 and mask[16] == 1


def test_no_learn_session_is_never_captured(tmp_path):
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, min_answer_tokens=1)
    secret, public = torch.full((4, KH), 7.0), torch.full((4, KH), 1.0)
    for sid, taps, nl in (("secret", secret, True), ("pub", public, False)):
        cap.observe([_req(sid, 0, taps[:2], 5, 1, no_learn=nl)], [Proposal(tokens=torch.empty(0, dtype=torch.int64))])
    # a later item of the no-learn session without the flag is still not recorded
    for sid, taps in (("secret", secret), ("pub", public)):
        cap.observe([_req(sid, 2, taps[2:4], 6, 1)], [Proposal(tokens=torch.empty(0, dtype=torch.int64))])
    cap.end(["secret", "pub"])
    cap.close()
    got = store.read("train") + store.read("heldout")
    assert len(got) == 1
    assert torch.equal(got[0]["taps"][:3], public[:3].bfloat16())
    assert not any((g["taps"] == 7.0).any() for g in got)


def _serve_captured(stack, make_drafter, tiny_target, hf_target, tmp_path, *, mode="",
                    wrap=None):
    """Serve PROMPTS greedily through the verifier and a block-4 drafter that captures (``wrap``:
    a wrapper around its engine), each answer identical to the target's own ``generate()``; the
    capture closed. Returns the drafter served (``wrap``'s), the last chunk of each request and
    the store's conversations as (ids, loss mask, the served answer), from the first answer
    position on."""
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30, fingerprint=engine.card.target_fingerprint)
    engine.capture = Capture(store, min_answer_tokens=1)
    drafter = wrap(engine) if wrap else engine
    addr = stack.add_drafter(drafter)
    v = stack.verifier_stub()
    answers, lasts = {}, []
    for i, prompt in enumerate(PROMPTS):
        want = reference(hf_target, prompt)
        p = spec(addr)
        p.mode = mode
        got, last = generate_ids(v, prompt, max_tokens=len(want), session_id=f"c{mode}{i}",
                                 speculation=p)
        assert_same_tokens(hf_target, prompt, got, want)
        answers[len(prompt)] = got
        lasts.append(last)
    engine.capture.close()                                # every session written
    convs = store.read("train") + store.read("heldout")
    assert len(convs) == len(PROMPTS)
    out = []
    for c in convs:
        n_prompt = int(c["loss_mask"].nonzero()[0])       # the first answer token is known
        out.append((c["input_ids"][n_prompt:], c["loss_mask"][n_prompt:].bool(),
                    torch.tensor(answers[n_prompt])))
    return drafter, lasts, out


def test_served_greedy_identical_with_capture_and_captured_tokens_are_the_answer(
        stack, make_drafter, tiny_target, hf_target, tmp_path):
    _, _, convs = _serve_captured(stack, make_drafter, tiny_target, hf_target, tmp_path)
    for ids, mask, answer in convs:
        assert mask.sum() >= 1
        assert ids[mask].tolist() == answer[:len(ids)][mask[:len(answer)]].tolist()


def test_capture_changes_no_draft(make_drafter, tiny_target, tmp_path):
    plain = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    taped = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    taped.capture = Capture(CaptureStore(tmp_path / "s", max_bytes=1 << 30), min_answer_tokens=1)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(12, plain.cfg.context_size, generator=g)
    try:
        for start, end, anchor in ((0, 5, 3), (5, 7, 9), (7, 8, 11), (8, 12, 4)):
            reqs = [_req("s", start, ctx[start:end], anchor, 4)]
            a, b = plain.propose(reqs)[0], taped.propose(reqs)[0]
            assert torch.equal(a.tokens, b.tokens)
    finally:
        plain.close()
        taped.close()
    assert taped.capture.written == 1


def test_no_learn_tenant_is_never_captured_through_the_verifier(stack, make_drafter, tiny_target,
                                                                tmp_path):
    """The verifier's --no-learn-tenants marks its items ``no_learn`` on the Draft stream."""
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    engine.capture = Capture(store, min_answer_tokens=1, idle_s=0.2)
    addr = stack.add_drafter(engine)
    stack.verifier.servicer.no_learn_tenants = frozenset({"secret"})
    v = stack.verifier_stub()
    secret, public = PROMPTS[2], PROMPTS[1]           # 18 and 11 prompt tokens
    generate_ids(v, secret, max_tokens=12, session_id="a", tenant="secret", speculation=spec(addr))
    generate_ids(v, public, max_tokens=12, session_id="b", tenant="pub", speculation=spec(addr))
    wait_until(lambda: engine.capture.written >= 1, 30, "the public conversation")
    time.sleep(0.5)                                   # a second one would be written by now
    convs = store.read("train") + store.read("heldout")
    assert len(convs) == 1
    assert int(convs[0]["loss_mask"].nonzero()[0]) == len(public)


def test_a_session_first_seen_mid_conversation_or_with_a_gap_is_not_misaligned(tmp_path):
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, min_answer_tokens=1)
    none = torch.empty(0, dtype=torch.int64)
    taps = torch.randn(20, KH)
    cap.observe([_req("late", 5, taps[5:7], 30, 1)], [Proposal(tokens=none)])   # starts at 5
    cap.observe([_req("late", 7, taps[7:8], 31, 1)], [Proposal(tokens=none)])
    cap.observe([_req("gap", 0, taps[:3], 40, 1)], [Proposal(tokens=none)])
    cap.observe([_req("gap", 3, taps[3:4], 41, 1)], [Proposal(tokens=none)])
    cap.observe([_req("gap", 9, taps[9:10], 42, 1)], [Proposal(tokens=none)])  # a gap: stop
    cap.close()
    (conv,) = store.read("heldout")
    assert conv["input_ids"].tolist() == [0, 0, 0, 40, 41]          # "gap" up to its gap
    assert torch.equal(conv["taps"][:4], taps[:4].bfloat16())


def test_a_resend_from_position_0_continues_the_conversation(tmp_path):
    """After a failed draft the verifier resends the whole context: one record, not a fragment
    per resend with its prefix's taps stored again; the rows gained without the drafter are
    unlabelled. A restart at 0 with other taps, or fewer rows, is a new conversation."""
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    cap = Capture(store, min_answer_tokens=1)
    B, none = 4, torch.empty(0, dtype=torch.int64)
    taps = torch.randn(20, KH)
    cap.observe([_req("a", 0, taps[:3], 20, B)], [Proposal(tokens=torch.tensor([21, 22, 50]))])
    cap.observe([_req("a", 3, taps[3:6], 23, B)], [Proposal(tokens=torch.tensor([24, 25, 26]))])
    # the drafter missed two steps (rows 6..8 committed without it); the verifier resends 0..9
    cap.observe([_req("a", 0, taps[:9], 30, B)], [Proposal(tokens=torch.tensor([31, 32, 33]))])
    cap.observe([_req("a", 9, taps[9:12], 32, B)], [Proposal(tokens=none)])
    cap.observe([_req("b", 0, taps[:3], 20, 1)], [Proposal(tokens=none)])
    cap.observe([_req("b", 3, taps[3:5], 40, 1)], [Proposal(tokens=none)])
    other = taps[:6].clone()
    other[1] += 1
    cap.observe([_req("b", 0, other, 41, 1)], [Proposal(tokens=none)])      # other taps: new
    cap.observe([_req("c", 0, taps[:4], 20, 1)], [Proposal(tokens=none)])
    cap.observe([_req("c", 4, taps[4:6], 50, 1)], [Proposal(tokens=none)])
    cap.observe([_req("c", 0, taps[:5], 51, 1)], [Proposal(tokens=none)])  # fewer rows: new
    cap.observe([_req("d", 0, taps[:4], 20, 1)], [Proposal(tokens=none)])
    cap.observe([_req("d", 0, taps[:4], 60, 1)], [Proposal(tokens=none)])  # another anchor: new
    cap.observe([_req("e", 0, taps[:4], 20, 1)], [Proposal(tokens=none)])
    cap.observe([_req("e", 0, taps[:4], 20, 1)], [Proposal(tokens=none)])  # all it holds: same
    cap.close()
    convs = store.read("heldout") + store.read("train")
    assert len(convs) == 8
    a = next(c for c in convs if c["input_ids"].shape[0] == 13)
    u = 0
    assert a["input_ids"].tolist() == [u, u, u, 20, 21, 22, 23, u, u, 30, 31, 32, 32]
    assert a["loss_mask"].tolist() == [0, 0, 0] + [1] * 4 + [0, 0] + [1] * 4
    assert torch.equal(a["taps"][:12], taps[:12].bfloat16())
    assert sorted(c["input_ids"].shape[0] for c in convs) == [5, 5, 5, 6, 6, 7, 7, 13]


class _Failing:
    """``engine``, answering every ``every``-th draft call after a session's first (its upload)
    with an error for each item, unseen (a call lost on the way): the verifier then resends
    the session's whole context from position 0."""

    def __init__(self, engine, every: int):
        self.engine, self.card, self.every, self.calls = engine, engine.card, every, 0

    def propose(self, requests):
        if any(r.context_start == 0 for r in requests):
            return self.engine.propose(requests)
        self.calls += 1
        if self.calls % self.every == 0:
            return [DraftError(FallbackReason.INTERNAL, "injected") for _ in requests]
        return self.engine.propose(requests)

    def release(self, ids):
        self.engine.release(ids)


def test_failed_drafts_through_the_verifier_keep_one_record_per_conversation(
        stack, make_drafter, tiny_target, hf_target, tmp_path):
    failing, lasts, convs = _serve_captured(stack, make_drafter, tiny_target, hf_target, tmp_path,
                                            wrap=lambda e: _Failing(e, every=3))
    assert all(last.stats.fallback_steps > 0 for last in lasts)   # the failures reached it
    assert failing.calls >= 3 * len(PROMPTS)
    for ids, mask, answer in convs:
        assert len(ids) >= len(answer) - 3        # all but the last step's (at most a block of 4)
        assert mask.all()                  # the verifier sends the ids: none missed is unknown
        assert ids.tolist() == answer[:len(ids)].tolist()


@pytest.mark.parametrize("mode", ["adaptive", "hybrid"])
def test_captured_labels_are_the_answer_under_steps_without_a_draft_call(
        mode, stack, make_drafter, tiny_target, hf_target, tmp_path):
    """Adaptive and hybrid verify blocks, trees or suffix drafts and may skip the drafter on a
    step; with the ids the verifier sends every answer position is labelled, each with the
    token served there (inferred from drafts instead, tree and suffix steps' rows were not)."""
    _, _, convs = _serve_captured(stack, make_drafter, tiny_target, hf_target, tmp_path, mode=mode)
    for ids, mask, answer in convs:
        assert len(ids) >= len(answer) // 2
        assert mask.all()
        assert ids.tolist() == answer[:len(ids)].tolist()


def test_read_with_a_cache_rereads_only_what_changed(tmp_path):
    store = CaptureStore(tmp_path / "s", max_bytes=1 << 30)
    for i in range(3):
        store.add(*_conv(30, i))
    cache: dict = {}
    first = store.read("train", cache)
    again = store.read("train", cache)
    assert [a is b for a, b in zip(first, again)] == [True, True]    # not read twice
    store.add(*_conv(45, 7), seq=1)                                   # conversation 1 grew
    (p2,) = [p for s, p in store.files() if s == 2]
    p2.unlink()                                                       # 2 dropped
    now = store.read("train", cache)
    assert [int(d["seq"]) for d in now] == [1] and now[0]["input_ids"].shape[0] == 45
    assert set(cache) == {1}


def test_learn_flags_off_by_default_and_private_dir(make_drafter, tiny_target, tmp_path):
    from dflash.learn.flags import capture_from_args
    from drafter_svc.server import parse_args

    card = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target).card
    base = ["--drafter", "d", "--target", str(tiny_target)]
    assert capture_from_args(parse_args(base), card) is None
    a = parse_args(base + ["--learn-dir", str(tmp_path / "l"), "--learn-bytes", "1000"])
    cap = capture_from_args(a, card)
    try:
        assert cap.store.max_bytes == 1000 and cap.store.fingerprint == card.target_fingerprint
        assert stat.S_IMODE(os.stat(tmp_path / "l").st_mode) == 0o700
        assert cap.stop_ids                      # the target's end-of-turn id
    finally:
        cap.close()


def test_context_ids_of_the_wrong_length_fail_their_item_alone(make_drafter, tiny_target):
    import grpc

    from dflash.core import wire
    from dflash.core.convert import sampling_to_proto
    from dflash.v1 import drafter_pb2, drafter_pb2_grpc
    from drafter_svc.server import build as build_drafter

    engine = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target)
    rt = build_drafter(engine, "127.0.0.1:0")
    rt.server.start()
    rt.set_serving(True)
    ctx = wire.to_proto(torch.randn(3, engine.cfg.context_size))
    item = lambda sid, ids: drafter_pb2.DraftItem(  # noqa: E731
        session_id=sid, context_start=0, context=ctx, anchor_token=5, block_size=4,
        sampling=sampling_to_proto(Sampling()), context_ids=ids)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
            replies = drafter_pb2_grpc.DrafterStub(ch).Draft(iter([drafter_pb2.DraftBatch(
                batch_id=1, items=[item("bad", [-1, 7]), item("good", [-1, -1, 7])])]), timeout=10)
            bad, good = next(iter(replies)).results
        assert bad.error and "context_ids" in bad.error and "2 ids for 3 context rows" in bad.error
        assert bad.error_code == drafter_pb2.DRAFT_ERROR_BAD_REQUEST
        assert not good.error and len(good.tokens) == 3
    finally:
        rt.server.stop(0)
        engine.close()
