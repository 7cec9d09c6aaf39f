"""Context-only updates to a remote drafter: not waited for, and resent whole when they fail."""

from __future__ import annotations

import threading

import pytest

from verifier_svc.drafter_client import RemoteProposer
from verifier_svc.engine import Request, VerifierEngine

from doubles import ReferenceDrafter, chains
from helpers import PROMPTS, reference

N = 24


class Recorded(ReferenceDrafter):
    """Oracle drafter that records (context_start, rows, block_size) of every item it serves.

    ``gate``: context-only batches wait for it. ``fail_first``: the first context-only item
    fails (the drafter keeps none of it)."""

    def __init__(self, *a, fail_first=False, **kw):
        super().__init__(*a, **kw)
        self.items: list[tuple[int, int, int]] = []
        self.gate = threading.Event()
        self.fail_first = fail_first
        self.resent = threading.Event()     # a whole context (start 0) arrived after a failure

    def propose(self, requests):
        from dflash.core.proposer import DraftError

        if all(r.block_size == 1 for r in requests):
            assert self.gate.wait(30)
        out = []
        for r in requests:
            self.items.append((r.context_start, r.context.shape[0], r.block_size))
            if self.fail_first and r.block_size == 1:
                self.fail_first = False
                out.append(DraftError("boom", "context update lost"))
                continue
            if r.context_start == 0 and len(self.items) > 1:
                self.resent.set()
            out += super().propose([r])
        return out


@pytest.fixture
def served():
    from drafter_svc.server import build as build_drafter

    runtimes, proposers = [], []

    def serve(drafter):
        rt = build_drafter(drafter, "127.0.0.1:0")
        rt.server.start()
        rt.set_serving(True)
        runtimes.append(rt)
        p = RemoteProposer(f"127.0.0.1:{rt.port}", drafter.card, timeout_s=2.0)
        proposers.append(p)
        return p

    yield serve
    for p in proposers:
        p.close()
    for rt in runtimes:
        rt.server.stop(0)


def test_no_speculation_steps_do_not_wait_for_the_drafter(target_model, hf_target, served):
    """While the drafter sits on the context-only updates, the verifier keeps decoding (3
    steps commit with the first update unanswered); once it answers, speculation resumes at
    full acceptance: the context reached the drafter in order, with no resend and no
    fallback. A verifier that waited for the update would time out (2 s) and fall back."""
    p = PROMPTS[1]
    ref = p + reference(hf_target, p, N, ignore_eos=True)
    oracle = Recorded(target_model, {"s": ref}, block_size=4)
    proposer = served(oracle)
    engine = VerifierEngine(target_model, spec_mode="adaptive", context_flush=1)
    plan = iter([0] * 5 + [3] * 40)
    engine.policy.choose_shapes = chains(lambda jobs, waiting=0: [
        min(next(plan), max(0, j.req.max_tokens - j.emitted - 1)) for j in jobs])
    evs = []
    for i, ev in enumerate(engine.generate(Request(request_id="r", session_id="s", prompt=p,
                                                   max_tokens=N, ignore_eos=True,
                                                   proposer=proposer))):
        evs.append(ev)
        if i == 3:
            assert not oracle.items, "the drafter answered before the gate opened"
            oracle.gate.set()
    engine.close()
    assert [t for ev in evs for t in ev.tokens] == ref[len(p):]
    assert all(ev.fallback is None for ev in evs), [ev.fallback for ev in evs]
    assert [ev.drafted for ev in evs[1:6]] == [0] * 5
    assert evs[6].drafted == 3 and evs[6].accepted == 3        # resumed at full acceptance
    assert sum(1 for start, _, _ in oracle.items if start == 0) == 1   # the prompt, once
    pos = 0
    for start, rows, _ in oracle.items:
        assert start == pos, oracle.items
        pos = start + rows


def test_a_lost_context_update_is_resent_whole(target_model, hf_target, served):
    """The first context-only update fails on the drafter: the verifier learns it from the
    reply after the step went on, resends the session's whole context exactly once (failures
    of updates sent before the resend are moot), and speculation after it is fully accepted."""
    p = PROMPTS[2]
    ref = p + reference(hf_target, p, N, ignore_eos=True)
    oracle = Recorded(target_model, {"s": ref}, block_size=4, fail_first=True)
    oracle.gate.set()
    proposer = served(oracle)
    engine = VerifierEngine(target_model, spec_mode="adaptive", context_flush=1)
    engine.policy.choose_shapes = chains(lambda jobs, waiting=0: [
        min(3 if oracle.resent.is_set() else 0, max(0, j.req.max_tokens - j.emitted - 1))
        for j in jobs])
    evs = list(engine.generate(Request(request_id="r", session_id="s", prompt=p, max_tokens=N,
                                       ignore_eos=True, proposer=proposer)))
    engine.close()
    assert [t for ev in evs for t in ev.tokens] == ref[len(p):]
    assert oracle.resent.is_set()
    starts = [start for start, _, _ in oracle.items]
    assert starts.count(0) == 2, oracle.items                  # the prompt, then one resend
    spec = [ev for ev in evs if ev.drafted]
    assert spec and spec[0].accepted == spec[0].drafted, [(e.drafted, e.accepted) for e in evs]
    resend = starts.index(0, 1)
    pos = 0
    for start, rows, _ in oracle.items[resend:]:               # contiguous from the resend on
        assert start == pos, oracle.items
        pos = start + rows
