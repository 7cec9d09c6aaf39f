"""Greedy speculation is token-identical to the target alone, through the real services."""

from __future__ import annotations

import pytest

from drafter_svc.engine import DrafterEngine

from doubles import ReferenceDrafter
from helpers import MAX_NEW, PROMPTS, assert_same_tokens, generate_ids, reference, spec


@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
def test_greedy_dflash_identical_to_generate(stack, make_drafter, tiny_target, hf_target, block_size):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=block_size), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    for prompt in PROMPTS:
        want = reference(hf_target, prompt)
        got, last = generate_ids(v, prompt, max_tokens=MAX_NEW, speculation=spec(addr))
        assert_same_tokens(hf_target, prompt, got, want)
        assert last.stats.drafts > 0 or block_size == 1
        base, _ = generate_ids(v, prompt, max_tokens=MAX_NEW)  # speculation off, same loop
        assert_same_tokens(hf_target, prompt, base, want)


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_oracle_drafter_tau_equals_block_size(stack, target_model, hf_target, block_size):
    steps = 3
    n = 1 + steps * block_size  # first token from prefill, then full blocks only
    refs = {f"o{i}": p + reference(hf_target, p, n) for i, p in enumerate(PROMPTS)}
    oracle = ReferenceDrafter(target_model, refs, block_size=block_size)
    addr = stack.add_drafter(oracle, label=f"oracle@{block_size}")
    v = stack.verifier_stub()
    for i, p in enumerate(PROMPTS):
        got, last = generate_ids(v, p, max_tokens=n, session_id=f"o{i}", ignore_eos=True,
                                 speculation=spec(addr))
        assert got == refs[f"o{i}"][len(p):]
        st = last.stats
        assert st.drafts == steps
        assert st.mean_acceptance_length == pytest.approx(block_size)
        assert list(st.accepted_per_position) == [steps] * (block_size - 1)


def test_adversarial_drafter_tau_one_output_identical(stack, target_model, hf_target):
    refs = {f"a{i}": p + reference(hf_target, p) for i, p in enumerate(PROMPTS)}
    bad = ReferenceDrafter(target_model, refs, block_size=8, adversarial=True, name="adversarial")
    addr = stack.add_drafter(bad, label="adversarial@1")
    v = stack.verifier_stub()
    for i, p in enumerate(PROMPTS):
        got, last = generate_ids(v, p, max_tokens=MAX_NEW, session_id=f"a{i}", speculation=spec(addr))
        assert_same_tokens(hf_target, p, got, refs[f"a{i}"][len(p):])
        assert last.stats.drafts > 0
        assert last.stats.accepted_tokens == 0
        assert last.stats.mean_acceptance_length == 1.0


def test_shorter_block_per_request(stack, make_drafter, tiny_target, hf_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=16), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    p = PROMPTS[1]
    got, last = generate_ids(v, p, max_tokens=MAX_NEW, speculation=spec(addr, block_size=4))
    assert_same_tokens(hf_target, p, got, reference(hf_target, p))
    assert last.stats.draft_tokens <= 3 * last.stats.drafts
