"""The speculation policy's parts: one feeding point (StepFeedback), the acceptance estimator and
the step cost model on their own."""

from __future__ import annotations

import random

import pytest

from dflash.core.stats import AcceptanceCounter
from verifier_svc.acceptance import AcceptanceEstimator, session_table
from verifier_svc.cost_model import StepCostModel, bucket
from verifier_svc.policy import SpeculationPolicy, StepFeedback

from doubles import policy_job

LABELS = ("d@1", "e@2")


def job(label, mode="adaptive", block=16, max_tokens=1000, emitted=1, stats=None):
    return policy_job(label, mode=mode, block=block, max_tokens=max_tokens, emitted=emitted,
                      stats=stats)


def random_step(rng: random.Random, jobs, ks) -> StepFeedback:
    """A plausible outcome of running ``ks`` drafts for ``jobs``: acceptance falls with the
    position, seconds grow with the work, some steps are ramp steps or lack a cycle overhead."""
    blocks: dict[str, list[tuple[int, int]]] = {}
    committed = []
    for j, k in zip(jobs, ks):
        acc = 0
        while acc < k and rng.random() < 0.8 * 0.9 ** acc:
            acc += 1
        if k:
            blocks.setdefault(j.req.proposer.card.label, []).append((k, acc))
            if getattr(j, "stats", None) is not None:
                j.stats.record(k, acc)
        committed.append(1 + acc)
    top = max(ks)
    return StepFeedback(
        batch=len(jobs), k=top,
        verify_seconds=0.02 + 0.005 * len(jobs) * (top + 1) * rng.uniform(1.0, 1.3),
        draft_seconds=0.004 * rng.uniform(1.0, 2.0) if top else 0.0,
        record_cost=rng.random() < 0.8, blocks=blocks, committed=committed,
        cycle_overhead=rng.uniform(0.0, 0.01) if rng.random() < 0.7 else None)


def feed_by_hand(p: SpeculationPolicy, fb: StepFeedback) -> None:
    """What the engine and the scheduler did before StepFeedback, call by call."""
    if fb.record_cost:
        p.observe_step(fb.batch, fb.k, fb.verify_seconds, fb.draft_seconds)
    for label, blocks in fb.blocks.items():
        p.observe_acceptance(label, blocks)
    p.observe_outcome(fb.committed)
    if fb.cycle_overhead is not None:
        p.observe_overhead(fb.cycle_overhead)


def test_feedback_equals_the_individual_observe_calls():
    rng = random.Random(1234)
    a = SpeculationPolicy("adaptive", explore_every=7)
    b = SpeculationPolicy("adaptive", explore_every=7)
    pool = [job(LABELS[i % 2], stats=AcceptanceCounter() if i % 3 else None) for i in range(6)]
    pool.append(job(LABELS[0], mode="fixed", block=4))
    speculative = 0
    for _ in range(60):
        jobs = rng.sample(pool, rng.randint(1, len(pool)))
        waiting = 2 if rng.random() < 0.1 else 0
        ca, cb = a.choose_shapes(jobs, waiting), b.choose_shapes(jobs, waiting)
        ks = ca.ks
        assert cb.ks == ks and cb.decision == ca.decision
        speculative += ca.decision.k > 0
        fb = random_step(rng, jobs, ks)
        a.observe(fb)
        feed_by_hand(b, fb)
        assert a.cost_table() == b.cost_table()
        assert a.acceptance_table() == b.acceptance_table()
        assert a.accuracy == b.accuracy and a.overhead_seconds == b.overhead_seconds
    jobs = pool[:4]
    ca, cb = a.choose_shapes(jobs), b.choose_shapes(jobs)
    assert ca.ks == cb.ks and ca.decision == cb.decision
    # the run exercised every part: several cells, both drafters, calibration, overhead
    assert len(a.cost_table()) >= 4 and set(a.acceptance_table()) == set(LABELS)
    assert speculative >= 5 and a.accuracy != 1.0 and a.overhead_seconds > 0


def test_observe_goes_through_the_observe_methods_in_order():
    p = SpeculationPolicy("adaptive")
    calls = []
    for name in ("observe_step", "observe_acceptance", "observe_outcome", "observe_overhead"):
        real = getattr(p, name)

        def wrapper(*args, _name=name, _real=real):
            calls.append(_name)
            _real(*args)

        setattr(p, name, wrapper)
    p.observe(StepFeedback(batch=2, k=3, verify_seconds=0.1, draft_seconds=0.01,
                           blocks={"d@1": [(3, 1)], "e@2": [(2, 2)]}, committed=[2, 3],
                           cycle_overhead=0.005))
    assert calls == ["observe_step", "observe_acceptance", "observe_acceptance",
                     "observe_outcome", "observe_overhead"]
    calls.clear()
    p.observe(StepFeedback(batch=2, k=0, verify_seconds=0.1, record_cost=False, committed=[1, 1]))
    assert calls == ["observe_outcome"]


def test_unrecorded_step_leaves_the_cost_table_alone():
    p = SpeculationPolicy("adaptive")
    p.observe(StepFeedback(batch=3, k=2, verify_seconds=0.05, draft_seconds=0.01,
                           blocks={"d@1": [(2, 2)]}, committed=[3, 1, 1]))
    before = p.cost_table()
    assert before == {(4, 2): pytest.approx(0.06)}
    p.observe(StepFeedback(batch=3, k=2, verify_seconds=9.0, draft_seconds=1.0, record_cost=False,
                           blocks={"d@1": [(2, 0)]}, committed=[1, 1, 1], cycle_overhead=0.002))
    p.observe(StepFeedback(batch=8, k=5, verify_seconds=9.0, record_cost=False, committed=[1] * 8))
    assert p.cost_table() == before
    assert p.rates("d@1") == pytest.approx([0.5, 0.5])          # acceptance still learnt
    assert p.overhead_seconds == pytest.approx(0.002)


def test_acceptance_estimator_alone():
    est = AcceptanceEstimator(alpha=0.05)
    assert est.expected_table("d@1", 3) == pytest.approx([1.0, 1.9, 2.71, 3.439])   # prior 0.9
    for acc in (0, 1, 2, 3):                         # one step each: a running mean
        est.observe("d@1", [(3, acc)])
    assert est.rates("d@1") == pytest.approx([0.75, 0.5, 0.25])
    # beyond the measured positions: geometric with the last conditional rate (0.25 / 0.5)
    assert est.expected_table("d@1", 5) == pytest.approx([1, 1.75, 2.25, 2.5, 2.625, 2.6875])
    assert est.expected_tokens("d@1", 2) == pytest.approx(2.25)
    assert est.acceptance_table() == {"d@1": pytest.approx([0.75, 0.5, 0.25])}
    est.observe("d@1", [(0, 0)])                     # blocks without drafts teach nothing
    assert est.rates("d@1") == pytest.approx([0.75, 0.5, 0.25])
    # per request: a request that never accepts pulls its table below the drafter's
    stats = AcceptanceCounter()
    for _ in range(8):
        stats.record(3, 0)
    own = session_table(est.expected_table("d@1", 3), stats)
    assert own == pytest.approx([1, 1 + 3 / 12, 1 + 5 / 12, 1 + 6 / 12])   # (0 + 4 prior) / (8 + 4)
    # calibration: steps that commit half the expected drafted tokens
    assert est.accuracy == 1.0
    for _ in range(10):
        est.expect([0, 2], 4.0)
        est.observe_outcome([3, 9, 1])               # job 1 is not speculative: not counted
    assert est.accuracy == pytest.approx(0.5)
    est.observe_outcome([9, 9, 9])                   # nothing expected: ignored
    est.expect([0], 1.0)
    est.clear_expectation()
    est.observe_outcome([9])
    assert est.accuracy == pytest.approx(0.5)


def test_cost_model_fit_recovers_a_linear_cost():
    a, per_session, per_token = 0.04, 0.012, 0.003
    true = lambda bb, k: a + per_session * bb + per_token * bb * (k + 1)   # noqa: E731
    m = StepCostModel(alpha=0.05)
    assert m.fit() is None
    m.observe_step(1, 0, true(1, 0))
    assert m.fit() is None                           # one token count: no line yet
    for batch in (1, 2):                             # two buckets x two block sizes, confirmed
        for k in (0, 3):
            for _ in range(2):
                m.observe_step(batch, k, true(bucket(batch), k))
    fit = m.fit()
    assert fit is not None
    for got, want in zip(fit, (a, per_session, per_token)):
        assert got == pytest.approx(want, rel=0.05)
    assert m.cost_table() == pytest.approx({(1, 0): true(1, 0), (1, 3): true(1, 3),
                                            (2, 0): true(2, 0), (2, 3): true(2, 3)})
    # an unmeasured cell is priced from the fit, plus the per-cycle overhead
    for _ in range(3):
        m.observe_overhead(0.01)
    m.observe_overhead(-1.0)                         # clock jitter counts as no overhead
    assert m.overhead_seconds == pytest.approx(0.0075)
    assert not m.measured(8, 7)
    assert m.estimate(8, 7, fit) == pytest.approx(true(8, 7) + 0.0075, rel=0.05)
    assert m.estimate(2, 3, fit) == pytest.approx(true(2, 3) + 0.0075)


def transient(m: StepCostModel) -> None:
    """Cells 8 and 16 verified 30 times each during a 3x transient (another process on the
    cores)."""
    for _ in range(30):
        m.observe_verify(1, 8, 0.105)
        m.observe_verify(1, 16, 0.120)


def steady(m: StepCostModel, cells: dict[int, float], steps: int) -> None:
    """``steps`` steps verifying only the rows of ``cells`` at their true seconds (the shapes a
    policy keeps choosing once a transient made others look dear)."""
    for i in range(steps):
        k = list(cells)[i % len(cells)]
        m.observe_verify(1, k, cells[k])


def test_a_stale_verify_cell_is_priced_by_the_fresh_cells_and_restarts():
    from verifier_svc.cost_model import STALE_STEPS, relative_rows

    m = StepCostModel()
    transient(m)
    steady(m, {0: 0.025, 3: 0.029, 6: 0.032}, STALE_STEPS // 2)
    assert m.verify_estimate(1, 8) == pytest.approx(0.105)     # recent: its own price
    steady(m, {0: 0.025, 3: 0.029, 6: 0.032}, STALE_STEPS)
    # stale: the fresh cells' prediction (the 6-row cell scaled), not the transient's price
    want = 0.032 * relative_rows(8) / relative_rows(6)
    assert m.verify_estimate(1, 8) == pytest.approx(want)
    assert m.verify_estimate(1, 16) == pytest.approx(0.032 * relative_rows(16) / relative_rows(6))
    assert m.verify_estimate(1, 4) == pytest.approx(0.029 + (0.032 - 0.029) / 3)   # between 3 and 6
    # its next observation restarts it: the transient's steps are gone, not averaged in
    m.observe_verify(1, 8, 0.036)
    assert m.verify_cells[(1, 8)].n == 1
    assert m.verify_estimate(1, 8) == pytest.approx(min(0.036, want))   # measured once: capped
    m.observe_verify(1, 8, 0.035)
    assert m.verify_estimate(1, 8) == pytest.approx(0.035)


def test_a_verify_cell_measured_once_is_no_dearer_than_its_neighbours_predict():
    m = StepCostModel()
    for _ in range(2):
        m.observe_verify(1, 3, 0.029)
        m.observe_verify(1, 15, 0.040)
    m.observe_verify(1, 7, 0.090)                 # one stalled step
    assert m.verify_estimate(1, 7) == pytest.approx(0.029 + (0.040 - 0.029) * 4 / 12)
    m.observe_verify(1, 7, 0.033)
    assert m.verify_estimate(1, 7) == pytest.approx(0.033)      # confirmed: the faster of two


def test_a_stale_step_cell_is_priced_by_the_fit_of_the_fresh_cells():
    from verifier_svc.cost_model import STALE_STEPS

    true = lambda k: 0.024 + 0.002 * (k + 1)   # noqa: E731
    m = StepCostModel()
    for _ in range(20):                            # a transient: the 15-draft step at 4x
        m.observe_verify(1, 15, 4 * true(15))
        m.observe_step(1, 15, 4 * true(15))
    for i in range(STALE_STEPS // 2):
        k = (0, 3)[i % 2]
        m.observe_verify(1, k, true(k))
        m.observe_step(1, k, true(k))
    assert m.estimate(1, 15, m.fit()) == pytest.approx(4 * true(15))   # recent: its own price
    for i in range(STALE_STEPS):
        k = (0, 3)[i % 2]
        m.observe_verify(1, k, true(k))
        m.observe_step(1, k, true(k))
    fit = m.fit()                                  # over the fresh cells only: the true line
    assert fit is not None and fit[2] == pytest.approx(0.002)
    assert m.estimate(1, 15, fit) == pytest.approx(true(15))
