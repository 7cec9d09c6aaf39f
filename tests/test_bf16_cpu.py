"""bfloat16 on the CPU, device given explicitly: greedy speculation equals plain decoding.

The GPU default is bf16 (``--dtype auto`` takes the checkpoint's dtype there); these tests run the
same bf16 arithmetic on the CPU, through the real services (verifier + drafter over gRPC on
loopback), with ``device="cpu"`` passed explicitly. The comparison is bf16 against bf16: the
verifier with speculation off is the reference (a float32 ``generate()`` is a different model).
"""

from __future__ import annotations

import pytest
import torch

from dflash.core import wire
from drafter_svc.engine import DrafterEngine

from conftest import Stack, generate_ids
from doubles import ReferenceDrafter
from helpers import PROMPTS, spec

N = 33      # 1 token from prefill, then 2 full blocks of 16


@pytest.fixture(scope="module")
def bf16_target(tiny_target):
    from verifier_svc.target import TargetModel

    return TargetModel(tiny_target, dtype="bfloat16", device="cpu")


@pytest.fixture
def bf16_stack(bf16_target, tokenizer):
    s = Stack(bf16_target, tokenizer)
    yield s
    s.close()


def test_bf16_target_and_drafter_live_where_asked(bf16_target, make_drafter, tiny_target):
    d = DrafterEngine.from_pretrained(make_drafter(block_size=16), tiny_target, dtype="bfloat16",
                                      device="cpu")
    assert bf16_target.device == torch.device("cpu") and bf16_target.dtype == torch.bfloat16
    assert next(bf16_target.model.parameters()).dtype == torch.bfloat16
    assert bf16_target.pool.dtype == torch.bfloat16
    assert d.device == torch.device("cpu") and d.card.dtype == "bfloat16"
    assert d.head.embed.dtype == torch.bfloat16 and d.pool.dtype == torch.bfloat16


def test_bf16_greedy_speculation_equals_speculation_off(bf16_stack, bf16_target, make_drafter,
                                                        tiny_target):
    """A real bf16 DFlash drafter and the oracle (every draft accepted: each step verifies a
    whole block of 16 in one forward) both give the tokens of bf16 decoding without speculation."""
    v = bf16_stack.verifier_stub()
    off = {i: generate_ids(v, p, max_tokens=N, ignore_eos=True)[0] for i, p in enumerate(PROMPTS)}
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=16), tiny_target,
                                           dtype="bfloat16", device="cpu")
    dflash_addr = bf16_stack.add_drafter(engine, label="bf16")
    refs = {f"o{i}": p + off[i] for i, p in enumerate(PROMPTS)}
    oracle = ReferenceDrafter(bf16_target, refs, block_size=16)
    oracle_addr = bf16_stack.add_drafter(oracle, label="oracle@16")
    for i, p in enumerate(PROMPTS):
        got, last = generate_ids(v, p, max_tokens=N, ignore_eos=True, speculation=spec(dflash_addr))
        assert got == off[i], f"prompt {i}: bf16 DFlash speculation diverged from bf16 decoding"
        assert last.stats.drafts > 0
        got, last = generate_ids(v, p, max_tokens=N, session_id=f"o{i}", ignore_eos=True,
                                 speculation=spec(oracle_addr))
        assert got == off[i], f"prompt {i}: bf16 oracle speculation diverged from bf16 decoding"
        assert last.stats.mean_acceptance_length == pytest.approx(16)


def test_bf16_taps_travel_as_bf16_by_default(bf16_target):
    """``--wire-dtype`` unset: a bf16 target's taps go to the drafter as raw bf16 words (the
    drafter client's request items, built from the session's tap rows)."""
    from dflash.core.proposer import DrafterCard, ProposalRequest
    from dflash.core.sampling import Sampling
    from verifier_svc.drafter_client import RemoteProposer
    from verifier_svc.drafter_sync import DrafterState

    st = DrafterState(tap_ids=(1,))
    _, taps = bf16_target.forward(list(range(5, 12)), bf16_target.new_cache(), (1,))
    st.taps.append(taps)
    card = DrafterCard(name="d", version="1", block_size=4, mask_token_id=0,
                       target_layer_ids=(1,), hidden_size=bf16_target.hidden_size,
                       vocab_size=bf16_target.vocab_size, dtype="bfloat16")
    client = RemoteProposer("127.0.0.1:9", card)      # never connects: only builds the items
    try:
        (item,) = client._items([ProposalRequest(session_id="s", context_start=0,
                                                 context=st.taps.rows(0), anchor_token=1,
                                                 block_size=4, sampling=Sampling())])
    finally:
        client._channel.close()
    assert item.context.dtype == "bfloat16" and len(item.context.data) == 2 * taps.numel()
    assert torch.equal(wire.from_proto(item.context), taps)
