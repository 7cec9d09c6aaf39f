"""The mode race (``verifier_svc/mode_race.py``) where the text, not the mode, moves the rates:
each prompt has a difficulty factor shared by every arm (acceptance depends on the text), so
the arms' tokens per second swing by large factors from prompt to prompt while their ratios
stay put. No model and no clock: a step's tokens and seconds come from the world below, from a
seeded generator. The race must neither take such a swing for a change of the best mode (a
reopened race, or a recheck judged against the leader's rate on other text) nor miss a real
change that happens amid the swings."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest

from verifier_svc.mode_race import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_FIRST_LOOK,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_RECHECK_BLOCKS,
    DEFAULT_RECHECK_BLOCKS,
    ModeRace,
)

ARMS = ("adaptive", "off", "suffix", "hybrid:15", "fixed")
#: Each arm's tokens per second relative to the best, on any text.
REL = {"hybrid:15": 1.0, "adaptive": 0.97, "suffix": 0.88, "tree:15": 0.8, "fixed": 0.63, "off": 0.55}


@dataclasses.dataclass
class TextWorld:
    """Batch-1 steps of ``step_seconds``; arm ``a`` commits ``per_step * rel[a] * d`` tokens a
    step times ``1 + noise * N(0, 1)``, where ``d`` is the prompt's difficulty factor
    (lognormal, log-sd ``sigma``); a prompt ends after ``prompt_tokens`` tokens (about 60 steps
    of the best arm at ``d = 1``)."""

    sigma: float = 0.35
    rel: dict = dataclasses.field(default_factory=lambda: dict(REL))
    per_step: float = 2.2
    noise: float = 0.10
    prompt_tokens: float = 128.0
    step_seconds: float = 0.025


@dataclasses.dataclass
class Run:
    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0
    best_seconds: float = 0.0          # the best arm pinned, on the same prompts (noise-free)
    racing_steps: int = 0              # steps while the race was open
    played: list = dataclasses.field(default_factory=list)

    @property
    def regret(self) -> float:
        return 1.0 - self.best_seconds / self.seconds


def play(race: ModeRace, w: TextWorld, steps: int, rng: random.Random, arms=ARMS) -> Run:
    """``steps`` steps of a stream of prompts (the last one cut where the steps end)."""
    out = Run()
    best = max(w.rel[a] for a in arms)
    while out.steps < steps:
        d = math.exp(rng.gauss(0.0, w.sigma))
        done = 0.0
        while done < w.prompt_tokens and out.steps < steps:
            arm, explored = race.pick(1, arms)
            t = w.per_step * w.rel[arm] * d * max(0.05, 1.0 + w.noise * rng.gauss(0.0, 1.0))
            race.observe(1, arm, t, w.step_seconds, 1, explored)
            done += t
            out.steps += 1
            out.tokens += t
            out.seconds += w.step_seconds
            out.best_seconds += t / (w.per_step * best * d / w.step_seconds)
            out.racing_steps += race.leader(1) is None
            out.played.append(arm)
    return out


def runner_up_gap(rel: dict, arms=ARMS) -> float:
    """What pinning the second best arm loses against the best (a share of the best's rate)."""
    ranked = sorted((rel[a] for a in arms), reverse=True)
    return 1.0 - ranked[1] / ranked[0]


@pytest.mark.parametrize("seed", range(6))
def test_text_swings_cost_little_once_the_race_is_run(seed):
    race = ModeRace(ARMS)
    gap = runner_up_gap(REL)
    first = play(race, TextWorld(), 1000, random.Random(seed))
    assert race.leader(1) == "hybrid:15", (race.estimates(1), race.relative(1))
    # the first race (one block of each far arm, up to 3 samples of the close ones, the
    # reference's blocks between them) costs less than pinning the runner-up
    assert first.regret < gap, first.regret
    s = race.stats
    steps, explored = s.total_steps, s.explored_steps
    later = play(race, TextWorld(), 2000, random.Random(100 + seed))
    assert race.leader(1) == "hybrid:15"
    # rechecks at gaps of at least 16 leader blocks by now, one block each, and the drift
    # rule's on hard prompts
    assert s.explored_steps - explored < (s.total_steps - steps) / (2 * DEFAULT_RECHECK_BLOCKS), s
    assert later.regret < gap / 2, later.regret


@pytest.mark.parametrize("seed", range(4))
def test_a_hard_prompt_costs_one_recheck_not_a_race(seed):
    race = ModeRace(ARMS)
    rng = random.Random(seed)
    w = TextWorld()
    play(race, w, 1500, rng)
    assert race.leader(1) == "hybrid:15"
    explored = race.stats.explored_steps
    # three prompts three swings below the usual text: every arm slower by the same factor
    hard = dataclasses.replace(w, sigma=0.0, per_step=w.per_step * math.exp(-3 * w.sigma))
    run = play(race, hard, 3 * round(hard.prompt_tokens / hard.per_step), rng)
    assert run.racing_steps == 0
    assert race.leader(1) == "hybrid:15"
    # the drift rule's recheck of the best challenger, on this text, and at most the one
    # scheduled recheck that falls due
    assert race.stats.explored_steps - explored <= 2 * DEFAULT_BLOCK_ROWS, race.stats


@pytest.mark.parametrize("sigma", [0.35, 0.5])
def test_paired_race_beats_pinning_the_runner_up(sigma):
    # comparing arms' absolute rates measured on different prompts lost more than pinning the
    # runner-up in this world (docs/batching.md, "The mode race"): text swings read as a
    # change of the best arm, a race reopened at each hard prompt
    gap = runner_up_gap(REL)
    regrets = [play(ModeRace(ARMS), TextWorld(sigma=sigma), 3000, random.Random(seed)).regret
               for seed in range(6)]
    assert statistics.mean(regrets) < gap / 2, regrets
    assert max(regrets) < gap, regrets


def test_ratios_are_measured_on_the_same_text():
    race = ModeRace(ARMS)
    play(race, TextWorld(sigma=0.5), 3000, random.Random(7))
    rel = race.relative(1)
    assert set(rel) == set(ARMS)
    for arm, ratio in rel.items():
        if REL[arm] >= DEFAULT_FIRST_LOOK:     # the close arms: sampled again and again
            assert abs(ratio / REL[arm] - 1.0) < 0.05, rel
        else:                                  # the far ones: out after a sample or two
            assert ratio < DEFAULT_FIRST_LOOK, rel


def detect(seed: int, sigma: float = 0.35) -> tuple[str | None, int | None]:
    """Hybrid's own acceptance collapses (its drafter degraded) after the race has run, the
    text swinging on: (the leader after 1500 steps, the first step from which adaptive, now
    the best, plays 55 of 60 steps)."""
    race = ModeRace(ARMS)
    rng = random.Random(seed)
    play(race, TextWorld(sigma=sigma), 1000, rng)
    assert race.leader(1) == "hybrid:15"
    run = play(race, TextWorld(sigma=sigma, rel={**REL, "hybrid:15": 0.45}), 1500, rng)
    window = [i for i in range(len(run.played) - 60) if run.played[i:i + 60].count("adaptive") >= 55]
    return race.leader(1), window[0] if window else None


#: A drop is found at the latest by the next scheduled recheck (at most the longest gap of
#: leader blocks away), and then raced (the reference's blocks between the others').
SCHEDULED = (DEFAULT_MAX_RECHECK_BLOCKS + 2 * DEFAULT_MAX_BLOCKS + 2) * DEFAULT_BLOCK_ROWS


@pytest.mark.parametrize("seed", range(4))
def test_a_real_drop_amid_text_swings_moves_the_leader(seed):
    leader, first = detect(seed)
    assert leader == "adaptive"
    assert first is not None and first < SCHEDULED, first


def test_the_drift_rule_finds_most_drops_before_the_schedule_would():
    firsts = [detect(seed)[1] for seed in range(8)]
    assert all(f is not None for f in firsts), firsts
    assert statistics.median(firsts) < SCHEDULED / 2, firsts
