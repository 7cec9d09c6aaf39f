"""The drafters' deadline from the cost model, without sockets: the budget formula, the policy's
expected tokens in it, how a draft the step stopped waiting for is bookkept, and the breaker's
reasons."""

from __future__ import annotations

import pytest
import torch

from dflash.core.proposer import DrafterCard, DraftError, FallbackReason, Proposal
from dflash.core.sampling import Sampling
from verifier_svc.acceptance import AcceptanceEstimator
from verifier_svc.breaker import FAILING, SLOW, BreakerConfig, CircuitBreaker
from verifier_svc.cost_model import StepCostModel
from verifier_svc.drafter_client import RemoteProposer
from verifier_svc.drafter_sync import DrafterState, DrafterSync, DraftItem, DraftRound
from verifier_svc.policy import Shape, SpeculationPolicy

from doubles import policy_job

WIDTH = 4
CARD = DrafterCard(name="d", version="1", block_size=4, mask_token_id=0, target_layer_ids=(0,),
                   hidden_size=WIDTH, vocab_size=32, dtype="float32")


def test_draft_budget_is_the_no_speculation_cost_of_the_expected_tokens_minus_the_verify():
    m = StepCostModel()
    assert m.draft_budget(1, 3, 3.0) is None                      # nothing measured
    m.observe_verify(1, 3, 0.012)
    m.observe_overhead(0.002)
    # verify(1, 0) not measured: bounded above by the bucket's cheapest cell (errs long)
    assert m.draft_budget(1, 3, 3.0) == pytest.approx(3 * (0.012 + 0.002) - (0.012 + 0.002))
    m.observe_verify(1, 0, 0.010)
    assert m.draft_budget(1, 3, 3.0) == pytest.approx(3 * (0.010 + 0.002) - (0.012 + 0.002))
    # verify(1, 7) not measured: bounded below by the dearest cell with fewer drafts
    assert m.draft_budget(1, 7, 3.0) == pytest.approx(3 * (0.010 + 0.002) - (0.012 + 0.002))
    assert m.verify_seconds(1, 7) == pytest.approx(0.012)
    # nothing gained: one expected token never pays for a draft
    assert m.draft_budget(1, 3, 1.0) < 0
    assert m.draft_budget(2, 3, 3.0) is None                      # another bucket: unknown
    assert m.cost_table() == {}                                  # verify cells are their own


def fixed_job(label, block=4, proposer=True):
    return policy_job(label, mode="fixed", block=block, max_tokens=100, proposer=proposer)


def test_policy_budget_values_each_job_as_the_choice_of_blocks_does():
    p = SpeculationPolicy("fixed")
    p.observe_verify(2, 0, 0.010)
    p.observe_verify(2, 3, 0.013)
    p.observe_overhead(0.001)
    jobs = [fixed_job("d@1"), fixed_job("d@1", proposer=False)]
    shapes = p.choose_shapes(jobs).shapes
    assert shapes == [Shape(3), Shape(0)]
    e3 = p.expected_tokens("d@1", 3)                 # the prior before any acceptance: 3.439
    tokens = (e3 + 1.0) / 2                          # the session without a drafter emits 1
    assert p.draft_budget(jobs, shapes) == pytest.approx(
        tokens * (0.010 + 0.001) - (0.013 + 0.001))
    assert p.draft_budget(jobs, [Shape(0), Shape(0)]) is None     # nothing drafted: no wait
    # acceptance learnt: a drafter that is never right is worth no wait at all
    for _ in range(50):
        p.observe_acceptance("d@1", [(3, 0)])
    c = p.choose_shapes(jobs)
    assert p.draft_budget(jobs, c.shapes, c.expectations) < 0.001


def test_calibration_leaves_out_jobs_whose_drafts_never_arrived():
    est = AcceptanceEstimator()
    for _ in range(10):
        est.expect([0, 1], [2.0, 2.0])
        est.observe_outcome([3, 1], skip={1})         # job 1's drafter failed: not a miss
    assert est.accuracy == pytest.approx(1.0)
    for _ in range(10):
        est.expect([0, 1], 4.0)                      # a total spreads evenly
        est.observe_outcome([3, 1])
    assert est.accuracy < 0.9


def test_breaker_records_why_it_opened():
    b = CircuitBreaker(2)
    assert not b.failure(FAILING) and b.failure(SLOW, readmit_s=0.03)
    assert b.is_open and b.reason == SLOW and b.readmit_s == 0.03
    assert b.trips_by_reason == {SLOW: 1, FAILING: 0}
    b.close()
    assert not b.failure(SLOW) and b.failure(FAILING, readmit_s=2.0)
    assert b.trips == 2 and b.trips_by_reason == {SLOW: 1, FAILING: 1} and b.reason == FAILING
    with pytest.raises(ValueError, match="deadline_floor_s"):
        BreakerConfig(deadline_floor_s=0)


def test_deadline_is_the_budget_between_the_floor_and_the_cap():
    p = RemoteProposer("127.0.0.1:9", CARD, timeout_s=2.0,
                       breaker=BreakerConfig(deadline_floor_s=0.05))   # never connects
    try:
        assert p.deadline(None) == 2.0
        assert p.deadline(-1.0) == 0.05 and p.deadline(0.01) == 0.05
        assert p.deadline(0.3) == 0.3 and p.deadline(9.0) == 2.0
    finally:
        p.close()


class DeadlineDouble:
    """A ``DeadlineProposer`` that records each call and answers as told: "ok" (k zeros), or
    "late" (every result ``DraftError(FallbackReason.LATE)``, the late-failure callback kept)."""

    def __init__(self):
        self.card = CARD
        self.calls = []              # (budget_s, [(session, context_start, rows)])
        self.answer = "ok"
        self.on_late = None

    def propose_within(self, requests, budget_s, on_late_failure):
        self.calls.append((budget_s, [(r.session_id, r.context_start, r.context.shape[0])
                                      for r in requests]))
        if self.answer == "late":
            self.on_late = on_late_failure
            return [DraftError(FallbackReason.LATE)] * len(requests)
        return [Proposal(tokens=torch.zeros(r.block_size - 1, dtype=torch.int64)) for r in requests]

    def propose(self, requests):
        raise AssertionError("a DeadlineProposer is called through propose_within")

    def release(self, ids):
        pass


def step(sync, state, proposer, budget, grow=1):
    """One step of session "s": ``grow`` new committed rows, then a call for 3 drafts (its
    DraftRound)."""
    state.taps.append(torch.ones(grow, WIDTH))
    item = DraftItem(session_id="s", state=state, proposer=proposer, cached=len(state.taps),
                     anchor=1, k=3, room=True, sampling=Sampling(), trace_context={})
    return sync.draft([item], budget)


def test_a_late_draft_keeps_the_context_on_the_drafter_and_a_late_failure_resends_it():
    sync, d, state = DrafterSync(vocab_size=32), DeadlineDouble(), DrafterState()
    sync.bind("s", state, d)
    state.proposer = d
    rnd = step(sync, state, d, 0.02, grow=5)
    out = rnd.outcomes[0]
    assert d.calls[-1][1] == [("s", 0, 5)] and out.tokens.tolist() == [0, 0, 0]
    assert rnd.uploaded                               # the whole context: a join
    rnd = step(sync, state, d, 0.02)
    out = rnd.outcomes[0]
    assert not rnd.uploaded
    # what is left of the step's budget when the call starts
    assert 0.01 < d.calls[-1][0] <= 0.02 and d.calls[-1][1] == [("s", 5, 1)]
    assert sync.draft([], None) == DraftRound([], 0.0)
    d.answer = "late"
    rnd = step(sync, state, d, 0.02)
    out = rnd.outcomes[0]
    assert out.fallback == FallbackReason.LATE and out.tokens.tolist() == [] and out.called
    assert state.length == 7                          # the late batch still carries its rows
    assert rnd.wasted_seconds > 0
    d.answer = "ok"
    step(sync, state, d, 0.02)
    assert d.calls[-1][1] == [("s", 7, 1)]            # only the new row: nothing resent
    d.answer = "late"
    step(sync, state, d, 0.02)
    d.on_late(["s"])                                  # ... that late batch failed after all
    d.answer = "ok"
    rnd = step(sync, state, d, 0.02)
    assert d.calls[-1][1] == [("s", 0, 10)]           # resent whole
    assert rnd.wasted_seconds == 0.0 and rnd.uploaded
