"""Greedy output under the mode race is the target's alone, token for token, whatever arm each
step plays: switching arms changes which shapes are verified, never what is committed."""

from __future__ import annotations

import threading

from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.mode_race import ModeRace

from doubles import ReferenceDrafter
from helpers import PROMPTS, reference

ALL_ARMS = ["adaptive", "off", "fixed", "tree:3", "tree:7", "hybrid:7", "suffix"]
N = 36


def switching_engine(target_model, played: list[str]) -> VerifierEngine:
    """An engine whose race plays a different available arm at every step (in turn)."""
    engine = VerifierEngine(target_model, spec_mode="adaptive", tree_budgets=(3, 7), mode_race=True)
    race = ModeRace(ALL_ARMS)
    real = race.pick

    def pick(b, available):
        real(b, available)                        # the race's own bookkeeping still runs
        arm = list(available)[len(played) % len(available)]
        played.append(arm)
        return arm, True

    race.pick = pick  # type: ignore[method-assign]
    engine.policy.race = race
    return engine


def drafter(target_model, refs):
    # the reference at rank 0, 1 or 2 by position: chains accept some, trees more
    return ReferenceDrafter(target_model, refs, block_size=8, ranks=lambda sid, pos: pos % 3)


def test_greedy_identical_under_every_arm_switch_batch_one(target_model, hf_target):
    refs = {f"s{i}": p + reference(hf_target, p, N, ignore_eos=True) for i, p in enumerate(PROMPTS)}
    played: list[str] = []
    engine = switching_engine(target_model, played)
    oracle = drafter(target_model, refs)
    try:
        for i, p in enumerate(PROMPTS):
            evs = list(engine.generate(Request(request_id=f"r{i}", session_id=f"s{i}", prompt=p,
                                               max_tokens=N, ignore_eos=True, proposer=oracle)))
            assert [t for ev in evs for t in ev.tokens] == refs[f"s{i}"][len(p):]
    finally:
        engine.close()
    assert set(played) == set(ALL_ARMS), set(ALL_ARMS) - set(played)


def test_greedy_identical_under_every_arm_switch_batched(target_model, hf_target):
    refs = {f"b{i}": p + reference(hf_target, p, N, ignore_eos=True) for i, p in enumerate(PROMPTS)}
    played: list[str] = []
    engine = switching_engine(target_model, played)
    oracle = drafter(target_model, refs)
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(sid, prompt):
        try:
            got[sid] = [t for ev in engine.generate(Request(
                request_id=sid, session_id=sid, prompt=prompt, max_tokens=N, ignore_eos=True,
                proposer=oracle)) for t in ev.tokens]
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f"b{i}", p)) for i, p in enumerate(PROMPTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.close()
    if errors:
        raise errors[0]
    for i, p in enumerate(PROMPTS):
        assert got[f"b{i}"] == refs[f"b{i}"][len(p):]
    assert {"off", "fixed", "hybrid:7", "adaptive"} <= set(played)
