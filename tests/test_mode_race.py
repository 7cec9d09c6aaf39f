"""The mode race (``verifier_svc/mode_race.py``): in a simulated world of step costs and
acceptance (no model, no clock: seconds come from the world's cost formula, acceptance from a
seeded generator), adaptive plays the best of the modes a user could pin, within a bounded
number of steps and with a bounded share of exploration, also when the best mode changes
mid-stream (the batch grows and drains, acceptance drops)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from dflash.core.suffix import SuffixTrie
from verifier_svc.mode_race import ModeRace
from verifier_svc.policy import DEFAULT_RACE_ARMS, SpeculationPolicy, split_arm
from verifier_svc.race_state import ONE_BLOCK_NOISE, PRIOR_STEPS, Block, LeaderLevel, OpenBlock, pair_sample
from verifier_svc.shapes import Shape, StepFeedback
from verifier_svc.suffix_drafts import SuffixOffer

from doubles import policy_job

LABEL = "d@1"
ARMS = ("adaptive", "off", "suffix", "hybrid:15", "fixed")


@dataclasses.dataclass
class World:
    """Step seconds ``a + per_token * B * (K + 1)`` (+ ``draft`` when the drafter is asked),
    each draft accepted with probability ``r`` (a tree's path with ``r_tree``), each suffix
    candidate of a chain offer with probability ``q`` (None: no candidates)."""

    r: float
    a: float = 0.010
    per_token: float = 0.001
    draft: float = 0.004
    r_tree: float | None = None
    q: float | None = None

    def tokens(self, sh: Shape, rng: random.Random) -> tuple[int, int]:
        """(committed tokens with the bonus, accepted drafts) of one job's shape."""
        if sh.budget and not sh.k:            # suffix candidates alone: a chain offer
            p, depth = (self.q or 0.0), sh.budget
        elif sh.budget:
            p, depth = (self.r_tree if self.r_tree is not None else self.r), sh.k
        else:
            p, depth = self.r, sh.k
        acc = 0
        while acc < depth and rng.random() < p:
            acc += 1
        return acc + 1, acc

    def offer(self) -> SuffixOffer | None:
        if self.q is None:
            return None
        n = 8
        trie = SuffixTrie(tokens=list(range(10, 10 + n)), parents=[-1] + list(range(n)),
                          counts=[8] * (n + 1), match=2, depths=list(range(n + 1)))
        probs = [self.q ** j for j in range(n + 1)]
        cum = [0.0]
        for x in probs[1:]:
            cum.append(cum[-1] + x)
        return SuffixOffer(trie=trie, probs=probs, order=list(range(1, n + 1)), cumulative=cum,
                           rates=None)

    def step(self, p: SpeculationPolicy, batch: int, rng: random.Random) -> tuple[float, float, str, int]:
        """One step of ``batch`` adaptive jobs: (tokens, seconds, the race's arm, rows verified)."""
        jobs = []
        for _ in range(batch):
            j = policy_job(LABEL, tree_budget=15)
            j.suffix_limit = 15 if self.q is not None else 0
            jobs.append(j)
        c = p.choose_shapes(jobs, offers=[self.offer() for _ in jobs])
        got = [self.tokens(sh, rng) for sh in c.shapes]
        k = max(sh.verified for sh in c.shapes)
        drafted = any(sh.k for sh in c.shapes)
        verify = self.a + self.per_token * batch * (k + 1)
        draft = self.draft if drafted else 0.0
        chains = [(sh.k, acc) for sh, (_, acc) in zip(c.shapes, got) if sh.k and not sh.budget]
        trees = [(sh.budget, t) for sh, (t, _) in zip(c.shapes, got) if sh.k and sh.budget]
        p.observe(StepFeedback(batch=batch, k=k, verify_seconds=verify, draft_seconds=draft,
                               blocks={LABEL: chains} if chains else {},
                               trees={LABEL: trees} if trees else {},
                               committed=[t for t, _ in got], cycle_overhead=0.002))
        return float(sum(t for t, _ in got)), verify + draft + 0.002, c.decision.arm, k


def policy(arms=ARMS) -> SpeculationPolicy:
    return SpeculationPolicy("adaptive", tree_budgets=(3, 7, 15), race=True, race_arms=arms)


def rate_of(world: World, arm: str, batch: int, steps: int = 300, seed: int = 1) -> float:
    """Tokens per second of ``arm`` pinned (a race of one arm always plays it)."""
    p, rng = policy((arm,)), random.Random(seed)
    toks = secs = 0.0
    for _ in range(steps):
        t, s, _, _ = world.step(p, batch, rng)
        toks, secs = toks + t, secs + s
    return toks / secs


def run(world: World, p: SpeculationPolicy, batch: int, steps: int, rng: random.Random):
    """(tokens/s over the steps, (arm, rows verified) per step in order)."""
    toks = secs = 0.0
    played = []
    for _ in range(steps):
        t, s, arm, k = world.step(p, batch, rng)
        toks, secs = toks + t, secs + s
        played.append((arm, k))
    return toks / secs, played


def oracle(world: World, batch: int) -> dict[str, float]:
    """Each arm's tokens/s pinned, over enough steps that its noise is ~2%."""
    return {a: rate_of(world, a, batch, 1000) for a in ARMS if world.q is not None or a != "suffix"}


WORLDS = {
    # a good drafter and cheap rows: a long chain or tree pays
    "drafter": World(r=0.85),
    # a poor drafter whose calls cost more than a verify: no speculation
    "poor-drafter": World(r=0.1, draft=0.030),
    # suffix candidates that are nearly always right, a mediocre and slow drafter
    "suffix": World(r=0.4, draft=0.015, q=0.9),
    # trees well above chains
    "trees": World(r=0.5, r_tree=0.85),
}


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_race_converges_to_the_best_fixed_mode(name):
    w = WORLDS[name]
    rates = oracle(w, 1)
    best = max(v for a, v in rates.items() if a != "adaptive")
    p = policy()
    run(w, p, 1, 400, random.Random(2))
    leader = p.race.leader(1)
    assert leader is not None, f"race undecided after 400 steps: {p.race.estimates(1)}"
    assert rates[leader] >= 0.95 * best, (leader, rates)
    # from then on nearly every step plays an arm within 5% of the best fixed mode (adaptive's
    # own per-step choice counts, at its rate in the same world)
    _, late = run(w, p, 1, 300, random.Random(3))
    good = sum(rates[a] >= 0.95 * best for a, _ in late)
    assert good >= 0.9 * len(late), (name, rates, p.race.estimates(1))


def test_exploration_share_is_bounded_after_the_race():
    w = WORLDS["poor-drafter"]
    p = policy()
    run(w, p, 1, 400, random.Random(4))
    before = p.race.stats.explored_steps
    run(w, p, 1, 1200, random.Random(5))
    later = p.race.stats.explored_steps - before
    # rechecks at gaps of 8 to 64 leader blocks: well under a tenth of the steps
    assert later <= 0.1 * 1200, later
    assert p.race.stats.explored_steps < p.race.stats.total_steps


def test_batch_growth_shortens_speculation_and_draining_lengthens_it():
    # rows cost a lot per session: at 32 sessions a verify of 16 rows costs ~12 decodes
    w = World(r=0.85, a=0.020, per_token=0.002)
    off32 = rate_of(w, "off", 32, 100)
    assert off32 > 1.3 * rate_of(w, "fixed", 32, 100)
    assert rate_of(w, "fixed", 1, 100) > 1.3 * rate_of(w, "off", 1, 100)
    p = policy()
    run(w, p, 1, 300, random.Random(6))
    assert p.race.leader(1) not in (None, "off")
    _, played = run(w, p, 32, 150, random.Random(7))
    late, tail = run(w, p, 32, 60, random.Random(8))
    assert p.race.leader(32) in ("off", "adaptive"), p.race.estimates(32)
    assert late >= 0.97 * off32, (late, off32)           # never below no speculation
    assert max(k for _, k in tail) <= 3, tail            # short blocks or none
    # drained: bucket 1 still knows its leader and speculates long blocks at once
    _, played = run(w, p, 1, 30, random.Random(9))
    assert sum(k >= 7 for _, k in played) >= 24, played


def test_acceptance_drop_moves_the_leader_to_no_speculation():
    good, bad = World(r=0.9, draft=0.010), World(r=0.02, draft=0.010)
    p = policy(("off", "fixed"))
    run(good, p, 1, 300, random.Random(9))
    assert p.race.leader(1) == "fixed"
    _, played = run(bad, p, 1, 400, random.Random(10))
    assert p.race.leader(1) == "off"
    arms = [a for a, _ in played]
    first_off_run = next(i for i in range(len(arms) - 20) if arms[i:i + 20].count("off") == 20)
    assert first_off_run < 150, first_off_run      # within a bounded number of steps


def test_race_schedule_blocks_and_elimination():
    r = ModeRace(["a", "b", "c"], block_rows=4, min_block_steps=2, first_look=0.8, max_blocks=2)
    rates = {"a": 10.0, "b": 5.0, "c": 9.5}
    seen = []
    for _ in range(40):
        arm, _ = r.pick(1, ["a", "b", "c"])
        seen.append(arm)
        r.observe(1, arm, rates[arm], 1.0, 1)
    # blocks of 4 consecutive steps, each other arm's between two of the reference's (the
    # first arm), each once before any twice
    assert seen[:20] == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["c"] * 4 + ["a"] * 4
    assert r.leader(1) == "a"
    assert "b" not in seen[12:]                     # out after its first look
    assert r.relative(1) == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.95})


def test_race_arms_are_checked():
    with pytest.raises(ValueError, match="race_arms"):
        SpeculationPolicy("adaptive", race=True, race_arms=("adaptive", "sometimes"))
    with pytest.raises(ValueError, match="race_arms"):
        split_arm("tree")
    assert split_arm("hybrid:7") == ("hybrid", 7)
    with pytest.raises(ValueError, match="race_arms"):
        ModeRace([])
    # without trees the tree arms of the default list drop out
    p = SpeculationPolicy("adaptive", tree_budgets=(), race=True, race_arms=DEFAULT_RACE_ARMS)
    assert p.race is not None and all(":" not in a for a in p.race.order)


def test_block_noise_pair_samples_and_the_leaders_level():
    # a block's noise: its steps' spread around its rate, shrunk towards the prior
    steady, noisy = OpenBlock(), OpenBlock()
    for i in range(12):
        steady.add(2.0, 0.1, 1)
        noisy.add(2.0 + (1.0 if i % 2 else -1.0), 0.1, 1)
    quiet, loud = steady.close(), noisy.close()
    assert quiet.rate() == pytest.approx(20.0) and loud.rate() == pytest.approx(20.0)
    assert quiet.var == pytest.approx(PRIOR_STEPS * ONE_BLOCK_NOISE ** 2 / (PRIOR_STEPS + 11))
    assert loud.var > 10 * quiet.var
    # a sample: the block's rate over the reference's around it; a move between the two
    # reference blocks (the text changed) widens it by half the move
    before, after = Block(20.0, 1.0, 0.01), Block(10.0, 1.0, 0.01)
    x, var = pair_sample(Block(12.0, 1.0, 0.01), before, after)
    assert x == pytest.approx(math.log(12.0 / 15.0))
    assert var == pytest.approx(0.01 + 0.02 / 4 + (math.log(0.5) / 2) ** 2)
    _, flat = pair_sample(Block(12.0, 1.0, 0.01), before, Block(20.0, 1.0, 0.01))
    assert flat == pytest.approx(0.015)
    # the leader's level: once it has seen its usual swing, a block within it is no drop; one
    # three swings below is, once (the level moves down to it)
    lv = LeaderLevel()
    rng = random.Random(1)
    for _ in range(96):
        x = math.log(20.0) + rng.gauss(0.0, 0.2)
        lv.dropped(x, x)
    assert lv.level == pytest.approx(math.log(20.0), abs=0.1)
    assert math.sqrt(lv.swing) == pytest.approx(0.2, rel=0.35)
    mild = math.log(20.0) - 0.1
    assert not lv.dropped(mild, mild)
    low = math.log(20.0) - 0.6
    assert lv.dropped(low, low)
    assert not lv.dropped(low, low)
