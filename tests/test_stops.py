"""Exact stopping: stop ids / EOS and stop strings inside an accepted block; exact max_tokens."""

from __future__ import annotations

import pytest

from dflash.v1 import gateway_pb2, verifier_pb2

from doubles import ReferenceDrafter
from helpers import generate_ids, reference

B = 8
PROMPT = [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12]


@pytest.fixture
def oracle_stack(stack, target_model, hf_target, tokenizer):
    ref = PROMPT + reference(hf_target, PROMPT, 1 + 3 * B)
    text_prompt = "Hi"
    tp = tokenizer.encode(text_prompt)
    tref = tp + reference(hf_target, tp, 1 + 3 * B)
    oracle = ReferenceDrafter(target_model, {"s": ref, "t": tref}, block_size=B)
    addr = stack.add_drafter(oracle, label="oracle@1", default=True)
    return stack, addr, ref[len(PROMPT):], tref[len(tp):]


@pytest.mark.parametrize("offset", range(1, B))
def test_stop_token_at_each_offset_of_accepted_block(oracle_stack, offset):
    stack, addr, out, _ = oracle_stack
    # Generated token 0 comes from prefill; tokens 1..B-1 are the first block's accepted drafts.
    stop = out[offset]
    want = out[:out.index(stop) + 1]
    got, last = generate_ids(stack.verifier_stub(), PROMPT, max_tokens=len(out), session_id="s",
                             stop_token_ids=[stop], ignore_eos=True,
                             speculation=verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr))
    assert got == want
    assert last.finish_reason == 2  # STOP
    # Accepted tokens after the stop are not counted: every emitted token but the prefill one
    # was an accepted draft here.
    assert last.stats.accepted_tokens == len(want) - 1
    assert last.stats.mean_acceptance_length == pytest.approx(len(want))


@pytest.mark.parametrize("offset", range(2, B))
def test_stop_string_at_each_offset(oracle_stack, tokenizer, offset):
    stack, _, _, tout = oracle_stack
    full = tokenizer.decode(tout, skip_special_tokens=True)
    stop_text = tokenizer.decode(tout[offset:offset + 2])
    cut = full.find(stop_text)
    req = gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=len(tout), stop=[stop_text],
                                      session_id="t")
    resps = list(stack.gateway_stub().Generate(req))
    text = "".join(r.text for r in resps)
    assert text == full[:cut]
    assert resps[-1].finish_reason == 2


@pytest.mark.parametrize("max_tokens", [5, 7, 9])
def test_max_tokens_exact_with_block_8(oracle_stack, max_tokens):
    stack, addr, out, tout = oracle_stack
    got, last = generate_ids(stack.verifier_stub(), PROMPT, max_tokens=max_tokens, session_id="s",
                             ignore_eos=True,
                             speculation=verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr))
    assert got == out[:max_tokens]
    assert last.finish_reason == 1  # LENGTH
    req = gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=max_tokens, session_id="t")
    resps = list(stack.gateway_stub().Generate(req))
    ids = [t for r in resps for t in r.token_ids]
    assert ids == tout[:max_tokens]
    assert resps[-1].usage.completion_tokens == len(ids)
