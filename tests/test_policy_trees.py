"""The speculation policy with trees: mode ``tree`` and the adaptive choice between chains and
tree budgets (``verifier_svc/policy.py``), on job doubles."""

from __future__ import annotations

import pytest

from verifier_svc.acceptance import TREE_MEASURED_STEPS
from verifier_svc.policy import CANDIDATES, Shape, SpeculationPolicy, StepFeedback

from doubles import policy_job

LABEL = "d@1"


def job(mode="adaptive", block=16, tree_budget=16, max_tokens=1000, emitted=1):
    return policy_job(LABEL, mode=mode, block=block, max_tokens=max_tokens, emitted=emitted,
                      tree_budget=tree_budget)


def policy(chain_rate: float, tree_tokens: dict[int, float], cost_fn, budgets=(4, 8, 16),
           tree_max_batch=0):
    """Chains accept each position with ``chain_rate`` (unconditional rate_p = chain_rate^p);
    a tree of budget n commits ``tree_tokens[n]`` per step; a step verifying k tokens after
    the anchor costs ``cost_fn(k)`` seconds."""
    p = SpeculationPolicy("adaptive", explore_every=0, tree_budgets=budgets,
                          tree_max_batch=tree_max_batch)
    for _ in range(200):
        # blocks of 15 drafts whose acceptance reproduces rate_p = chain_rate ** p on average
        p.observe_acceptance(LABEL, [(15, a) for a in range(16)
                                     for _ in range(round(1000 * (chain_rate ** a - chain_rate ** (a + 1))))])
    for n, t in tree_tokens.items():
        for _ in range(TREE_MEASURED_STEPS):
            p.observe(StepFeedback(batch=1, k=n, verify_seconds=cost_fn(n), record_cost=False,
                                   trees={LABEL: [(n, t)]}, committed=[round(t)]))
    for batch in (1, 2):
        for k in sorted(set(CANDIDATES) | set(budgets)):
            if k <= 16:
                for _ in range(2):      # confirmed cells (one step is provisional)
                    p.observe_step(batch, k, cost_fn(k), 0.0)
    return p


def flat(k: int) -> float:      # a CPU-like verify: 17 tokens cost little more than one
    return 0.05 + 0.001 * k


def test_mode_tree_gives_every_job_its_budget_and_depth():
    p = SpeculationPolicy("tree")
    jobs = [job("tree", 8, tree_budget=16), job("tree", 8, tree_budget=0),
            job("tree", 8, tree_budget=16, max_tokens=3), job("off", 8)]
    assert p.choose_shapes(jobs).shapes == [Shape(7, 16), Shape(7, 0), Shape(1, 16), Shape(0)]
    # a tree is no deeper than its node count: a 3-node tree asks the drafter for 3 positions
    assert p.choose_shapes([job("tree", 16, tree_budget=3)]).shapes == [Shape(3, 3)]
    assert Shape(7, 16).verified == 16 and Shape(7, 0).verified == 7 and Shape(0, 16).verified == 0
    assert p.choose(jobs) == [7, 7, 1, 0]


def test_adaptive_takes_the_tree_when_it_commits_more_for_the_same_cost():
    # chain: rate 0.45 per position (E[15] ~ 1.8); trees commit 2.0 / 2.1 / 2.6 tokens
    p = policy(0.45, {4: 2.0, 8: 2.1, 16: 2.6}, flat)
    c = p.choose_shapes([job(), job()])
    assert c.shapes == [Shape(15, 16), Shape(15, 16)]
    d = c.decision
    assert d.budget == 16 and d.expected_tokens == pytest.approx(2 * 2.6)


def test_adaptive_keeps_chains_when_trees_commit_less():
    p = policy(0.9, {4: 1.5, 8: 1.6, 16: 1.7}, flat)
    c = p.choose_shapes([job()])
    assert c.shapes[0].budget == 0 and c.shapes[0].k > 4
    assert c.decision.budget == 0


def test_cost_decides_between_budgets():
    # verify cost grows with tokens (a big batch): a 4-node tree that commits 2.0 tokens
    # (2.0 / 0.24 s) beats a 16-node one that commits 2.3 (2.3 / 0.36 s) and every chain
    growing = lambda k: 0.2 + 0.01 * k                                  # noqa: E731
    p = policy(0.3, {4: 2.0, 8: 2.1, 16: 2.3}, growing)
    # a tree of 4 nodes is at most 4 deep: the drafter is asked for 4 positions, not 15
    assert p.choose_shapes([job()]).shapes == [Shape(4, 4)]


def test_each_budget_is_tried_until_measured():
    p = policy(0.45, {}, flat)             # no tree step observed yet
    tried = []
    for _ in range(3 * TREE_MEASURED_STEPS):
        c = p.choose_shapes([job()])
        sh = c.shapes[0]
        tried.append(sh.budget)
        p.observe(StepFeedback(batch=1, k=sh.verified, verify_seconds=flat(sh.verified),
                               trees={LABEL: [(sh.budget, 2)]}, committed=[2]))
    assert tried == [4] * TREE_MEASURED_STEPS + [8] * TREE_MEASURED_STEPS + [16] * TREE_MEASURED_STEPS
    assert c.decision.explored


def test_no_trees_for_jobs_that_may_not_verify_them():
    p = policy(0.45, {4: 3.0, 8: 3.5, 16: 4.0}, flat)
    # one adaptive job without trees (target or request): the batch stays on chains
    shapes = p.choose_shapes([job(), job(tree_budget=0)]).shapes
    assert all(sh.budget == 0 for sh in shapes)
    # a request capping its tree at 8 nodes: the 16-node arm is not offered
    assert p.choose_shapes([job(tree_budget=8)]).shapes == [Shape(8, 8)]
    # no budgets configured: chains only
    q = SpeculationPolicy("adaptive", tree_budgets=())
    assert q.tree_budgets == ()
    with pytest.raises(ValueError, match="tree_budgets"):
        SpeculationPolicy("adaptive", tree_budgets=(0, 4))


def test_tree_steps_do_not_feed_chain_acceptance_or_calibration():
    p = policy(0.45, {4: 2.1, 8: 2.4, 16: 2.6}, flat)
    before = p.rates(LABEL)
    acc = p.accuracy
    p.choose_shapes([job()])               # a tree step: no calibration expectation
    p.observe(StepFeedback(batch=1, k=16, verify_seconds=flat(16),
                           trees={LABEL: [(16, 9)]}, committed=[9]))
    assert p.rates(LABEL) == before and p.accuracy == acc
    assert p.acceptance.tree_table()[(LABEL, 16)] > 2.6


def test_trees_only_up_to_the_largest_tree_batch():
    """``--tree-max-batch``: steps of more adaptive sessions verify chains only (trees cost
    3-6% against chains at 8 and 32 sessions on the CPUs measured); 0 lifts the limit; the
    default is 1; a negative limit is refused."""
    jobs = [job(), job()]
    capped = policy(0.45, {4: 3.0, 8: 3.5, 16: 4.0}, flat, tree_max_batch=1)
    assert capped.choose_shapes([job()]).shapes[0].budget > 0
    assert all(sh.budget == 0 and sh.k > 0 for sh in capped.choose_shapes(jobs).shapes)
    free = policy(0.45, {4: 3.0, 8: 3.5, 16: 4.0}, flat, tree_max_batch=0)
    assert all(sh.budget > 0 for sh in free.choose_shapes(jobs).shapes)
    assert SpeculationPolicy("adaptive").tree_max_batch == 1
    with pytest.raises(ValueError, match="tree_max_batch"):
        SpeculationPolicy("adaptive", tree_max_batch=-1)


def test_exploration_from_a_tree_tries_the_chains_of_about_its_size():
    """Exploring from a tree of n nodes tries the chains of about n drafts, its neighbours by
    rows verified. Listed after every chain, a small tree's neighbours were the longest chain
    and the next tree: under load the chains it had displaced were never measured again."""
    growing = lambda k: 0.2 + 0.01 * k                                  # noqa: E731
    p = policy(0.3, {4: 2.0, 8: 2.1, 16: 2.3}, growing)
    assert p.choose_shapes([job()]).shapes == [Shape(4, 4)]                  # the best arm: 4 nodes
    p.explore.every = 3
    picks = []
    for _ in range(12):
        c = p.choose_shapes([job()])
        sh = c.shapes[0]
        picks.append((sh.k, sh.budget, c.decision.explored))
    explored = {(k, n) for k, n, e in picks if e}
    above = min(c for c in CANDIDATES if c > 4)
    assert explored == {(4, 0), (above, 0)}                 # chain of 4 drafts, the next chain up
    assert all((k, n) == (4, 4) for k, n, e in picks if not e)


def test_trees_tried_before_they_are_measured_leave_the_trees_calibration_alone():
    """Each budget's first steps are valued by the chain's prior, not by a measurement (a tree
    of 15 at 16 tokens before any acceptance): steps that then commit only the bonus token
    must not teach the trees' calibration, which had pinned it near its floor for good."""
    p = policy(0.9, {}, lambda k: 0.2 + 0.01 * k)
    tried = []
    for _ in range(3 * TREE_MEASURED_STEPS):
        c = p.choose_shapes([job()])
        sh = c.shapes[0]
        assert c.decision.explored and sh.budget          # an unmeasured budget, early
        tried.append(sh.budget)
        p.observe(StepFeedback(batch=1, k=sh.budget, verify_seconds=0.2, record_cost=False,
                               trees={LABEL: [(sh.budget, 1)]}, committed=[1]))
    assert sorted(set(tried)) == [4, 8, 16]
    assert p.acceptance.accuracy_of("tree") == 1.0
    c = p.choose_shapes([job()])                           # measured now: chosen on merit
    assert not c.decision.explored and not c.shapes[0].budget   # the trees commit nothing


def test_measuring_a_new_drafters_trees_postpones_the_next_exploration():
    """The steps that measure each tree budget of a drafter first seen are explorations of
    their own: the step chosen on merit right after them does not explore as well."""
    p = policy(0.3, {4: 2.0, 8: 2.1, 16: 2.3}, lambda k: 0.2 + 0.01 * k)
    p.explore.every = 5
    for _ in range(20):
        p.choose_shapes([job()])
    other = policy_job("d@2", block=16, max_tokens=1000, emitted=1, tree_budget=16)
    measuring = 0
    while True:
        c = p.choose_shapes([other])
        if not (c.decision.explored and c.shapes[0].budget):
            break
        measuring += 1
        n = c.shapes[0].budget
        p.observe(StepFeedback(batch=1, k=n, verify_seconds=0.2, record_cost=False,
                               trees={"d@2": [(n, 2)]}, committed=[2]))
    assert measuring == 3 * TREE_MEASURED_STEPS
    assert not c.decision.explored                        # chosen on merit, not explored again
