"""The adaptive policy's suffix-only arms: a suffix tree of any size the candidates pay for, as
mode ``suffix`` sizes its own (the step cells they are priced against: test_suffix_engine.py)."""

from __future__ import annotations

from dflash.core.suffix import SuffixTrie
from verifier_svc.policy import CANDIDATES, SpeculationPolicy
from verifier_svc.shapes import Shape
from verifier_svc.suffix_drafts import SuffixOffer

from doubles import policy_job

LABEL = "d@1"


def offer(probs: list[float]) -> SuffixOffer:
    """A chain of candidates (node j's parent is j - 1) with these calibrated probabilities of
    being reached by the target's walk."""
    n = len(probs)
    trie = SuffixTrie(tokens=list(range(10, 10 + n)), parents=[-1] + list(range(n)),
                      counts=[8] * (n + 1), match=2, depths=list(range(n + 1)))
    p = [1.0] + probs
    cum = [0.0]
    for x in probs:
        cum.append(cum[-1] + x)
    return SuffixOffer(trie=trie, probs=p, order=list(range(1, n + 1)), cumulative=cum, rates=None)


def trained(verify_ms: dict[int, float], draft_ms: float, rate: float) -> SpeculationPolicy:
    """A policy whose drafter's every position is accepted with ``rate``, whose steps with
    ``k`` rows verify in ``verify_ms[k]`` (interpolated where missing) and whose drafts cost
    ``draft_ms`` more."""
    p = SpeculationPolicy("adaptive", explore_every=0, tree_budgets=(3, 7, 15))
    for _ in range(200):
        p.observe_acceptance(LABEL, [(15, int(rate * 15))])
    for k in CANDIDATES:
        if k <= 15:
            v = verify_ms.get(k, verify_ms[max(x for x in verify_ms if x <= k)]) / 1e3
            for _ in range(2):
                p.observe_verify(1, k, v)
                p.observe_step(1, k, v + (draft_ms / 1e3 if k else 0.0), 0.0)
    for n in (3, 7, 15):
        for _ in range(5):
            p.acceptance.observe_trees(LABEL, [(n, 1)])   # the drafter's trees commit nothing
    return p


def job():
    j = policy_job(LABEL, tree_budget=15)
    j.suffix_limit = 15
    return j


def test_adaptive_verifies_a_suffix_tree_of_the_size_mode_suffix_would():
    # two candidates worth nearly a token each, the rest worthless; verify rows priced like a
    # CPU's (2 rows 1.04, 3 rows 1.16, 4 rows 1.47 decodes): 2 nodes pay best, and 2 is no
    # tree budget (3, 7, 15)
    p = trained({0: 25.0, 1: 26.0, 2: 29.0, 3: 37.0, 4: 38.0, 7: 43.0, 15: 50.0}, 8.0, 0.05)
    o = offer([0.9, 0.8] + [0.01] * 6)
    want = p.suffix_shape(o, 1, 15, 15)
    assert want == Shape(0, 2, True)
    c = p.choose_shapes([job()], offers=[o])
    assert c.shapes == [want]
    assert c.decision.suffix and c.decision.budget == 2
    assert abs(c.decision.expected_tokens - o.expected(2)) < 1e-9


def test_suffix_only_arm_explores_without_failing():
    # exploration from a suffix-only best looks up the drafter arm nearest its size (2 nodes is
    # no tree budget, so it is looked up by rows, not by budget)
    p = trained({0: 25.0, 1: 26.0, 2: 29.0, 3: 37.0, 4: 38.0, 7: 43.0, 15: 50.0}, 8.0, 0.05)
    p.explore.every, p.explore.backoff = 1, 1
    o = offer([0.9, 0.8] + [0.01] * 6)
    p.choose_shapes([job()], offers=[o])    # the best arm: exploring starts a step later
    for _ in range(4):
        c = p.choose_shapes([job()], offers=[o])
        assert c.decision.explored and not c.decision.suffix
        assert 1 <= c.shapes[0].k <= 3      # a neighbour of 2 rows: chains of 1-3, the tree of 3



def test_a_hybrid_trees_suffix_gain_is_scaled_by_what_recent_hybrid_trees_realized():
    # the candidates' predicted gain counts nodes the drafter's own tree may already hold; the
    # steps' realized gain measures that: half realized halves every later prediction
    p = trained({0: 25.0, 1: 26.0, 7: 43.0, 15: 50.0}, 8.0, 0.05)
    o = offer([0.9, 0.8, 0.6])
    raw = p.hybrid_gain(o, LABEL, 15, 15)
    assert raw > 2.0
    for _ in range(4):                           # too few steps to judge: the prediction stands
        p.acceptance.observe_hybrid(LABEL, [(2.0, 1.0)])
    assert p.hybrid_gain(o, LABEL, 15, 15) == raw
    for _ in range(200):
        p.acceptance.observe_hybrid(LABEL, [(2.0, 1.0)])
    assert abs(p.hybrid_gain(o, LABEL, 15, 15) - 0.5 * raw) < 1e-6
    assert p.acceptance.hybrid_factor("other@1") == 1.0     # per drafter version
    for _ in range(200):                         # never above 1.5, never below 0
        p.acceptance.observe_hybrid(LABEL, [(1.0, 4.0)])
    assert p.acceptance.hybrid_factor(LABEL) == 1.5
    for _ in range(200):                         # a gain never realized is no longer predicted
        p.acceptance.observe_hybrid(LABEL, [(2.0, 0.0)])
    assert p.hybrid_gain(o, LABEL, 15, 15) < 0.001 * raw


def test_each_arm_family_is_calibrated_by_the_steps_that_ran_it():
    # drafter trees measured at 4 tokens a step, a suffix tree of two good candidates: the
    # tree arm wins; steps that ran it and committed only the bonus token teach the trees'
    # calibration (and not the chains' nor the suffix trees'), until the suffix tree wins
    p = trained({0: 25.0, 1: 26.0, 2: 29.0, 3: 37.0, 4: 38.0, 7: 43.0, 15: 50.0}, 8.0, 0.05)
    for n in (3, 7, 15):
        for _ in range(200):
            p.acceptance.observe_trees(LABEL, [(n, 4)])
    o = offer([0.9, 0.5])
    first = p.choose_shapes([job()], 0, [o]).shapes[0]
    assert first.k and first.budget                      # a drafter tree
    ran = 0                                              # tree steps before the switch
    for _ in range(100):
        sh = p.choose_shapes([job()], 0, [o]).shapes[0]
        if not sh.k:
            break
        p.observe_outcome([1])
        ran += 1
    assert sh.budget and sh.suffix and not sh.k, sh      # the suffix tree alone, in time
    assert ran >= 5                                      # not before 5 steps were seen
    assert p.acceptance.accuracy_of("tree") < 0.5
    assert p.acceptance.accuracy_of("chain") == p.accuracy == 1.0
    assert p.acceptance.accuracy_of("suffix") == 1.0


def test_a_step_of_an_unknown_arm_family_is_refused():
    import pytest

    p = SpeculationPolicy("adaptive")
    with pytest.raises(ValueError, match="family"):
        p.acceptance.expect([0], 1.0, "forest")


def test_an_unmeasured_tree_is_scaled_by_the_trees_calibration_alone():
    # before its budget is measured a tree is valued as the chain of as many drafts; the arm's
    # value is then scaled by the trees' calibration, so the chains' must not scale it too
    from verifier_svc.arms import Arms, Batch, Expectations
    from verifier_svc.shapes import Arm

    p = SpeculationPolicy("adaptive", explore_every=0, tree_budgets=(3, 7, 15))
    for _ in range(50):
        p.observe_acceptance(LABEL, [(15, 9)])
    for _ in range(10):                         # chain steps that committed only the bonus
        p.acceptance.expect([0], 2.0, "chain")
        p.observe_outcome([1])
    assert p.accuracy == 0.25
    jobs = [job()]
    batch = Batch.of(jobs, [None])
    ex = Expectations(p.acceptance, jobs, batch.limits)
    arms = Arms(batch, [Shape(0)], ex, acceptance=p.acceptance, costs=p.costs,
                tree_budgets=p.tree_budgets, tree_max_batch=p.tree_max_batch)
    assert arms.raw(Arm(budget=7)) == [ex.raw(0, 7) - 1.0]
    assert ex.tree(0, 7) == ex.chain(0, 7) < ex.raw(0, 7)    # the deadline's figure: calibrated
    assert arms.gain(Arm(budget=7)) == 1.0 + ex.raw(0, 7) - 1.0   # trees' calibration: 1.0


def test_suffix_trees_are_valued_by_their_candidates_calibration_alone():
    # steps of suffix trees that commit only the bonus token teach the candidates' cells (the
    # engine's SuffixCalibration), not a family ratio that would count the shortfall twice
    p = trained({0: 25.0, 1: 26.0, 2: 29.0, 3: 37.0, 4: 38.0, 7: 43.0, 15: 50.0}, 8.0, 0.05)
    o = offer([0.9, 0.8] + [0.01] * 6)
    first = p.choose_shapes([job()], offers=[o])
    assert first.decision.suffix and first.shapes == [Shape(0, 2, True)]
    for _ in range(50):
        assert p.choose_shapes([job()], offers=[o]).decision.suffix
        p.observe_outcome([1])
    again = p.choose_shapes([job()], offers=[o])
    assert again.shapes == first.shapes
    assert again.decision.expected_tokens == first.decision.expected_tokens
    assert p.acceptance.accuracy_of("suffix") == 1.0


def test_exploration_backs_off_when_the_best_arm_alternates():
    # candidates on every other step: a suffix tree leads on those, a drafter chain on the
    # others; each lead keeps its own gap, so returning to one does not restart its schedule
    p = trained({0: 25.0, 1: 26.0, 2: 29.0, 3: 37.0, 4: 38.0, 7: 43.0, 15: 50.0}, 1.0, 0.3)
    p.explore.every, p.explore.backoff = 5, 8
    o = offer([0.99] * 6 + [0.01] * 2)
    leads, explored = set(), 0
    for step in range(400):
        c = p.choose_shapes([job()], offers=[o if step % 2 else None])
        explored += c.decision.explored
        if not c.decision.explored:
            leads.add("suffix" if c.decision.suffix else "drafter" if c.shapes[0].k else "none")
    assert {"suffix", "drafter"} <= leads                 # the lead does alternate
    # per lead: first after 5 steps, then 10, 20, 40, 40 ...: 12 each in 400 at most
    assert explored <= 2 * 12, explored                   # (every 5 steps: 80)


def test_suffix_trees_priced_out_by_a_transient_come_back_once_their_cells_are_stale():
    # the bench's slow runs: a start-up transient verified 7-16 rows at 2-3x their price, mode
    # suffix then settled on small trees, and nothing re-measured the large ones
    from verifier_svc.cost_model import STALE_STEPS

    true = {0: 25.0, 1: 26.0, 2: 27.0, 3: 29.0, 4: 30.0, 5: 30.5, 6: 32.0, 7: 33.0, 8: 34.0,
            16: 40.0}
    p = SpeculationPolicy("suffix", explore_every=0, tree_budgets=(3, 7, 15))
    o = offer([0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6] + [0.01] * 8)

    def steps(ks, ms, n):
        for i in range(n):
            k = ks[i % len(ks)]
            p.observe_verify(1, k, ms[k] / 1e3)
            p.observe_step(1, k, ms[k] / 1e3, 0.0)

    steps(list(true), true, 2 * len(true))
    assert p.suffix_size(o, 1, 16, 16) == 8            # priced right, 8 candidates pay best
    steps([7, 8, 16], {k: 3 * v for k, v in true.items()}, 60)
    small = p.suffix_size(o, 1, 16, 16)
    assert small < 7                                   # the transient priced 7+ out
    steps([0, small], true, STALE_STEPS + 1)           # what the policy then keeps verifying
    assert p.suffix_size(o, 1, 16, 16) == 8
