"""Reduced draft vocabulary (dflash.core.draft_vocab): cheaper drafter LM head, output unchanged."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash.core.draft_vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab
from dflash.core.proposer import ProposalRequest
from dflash.core.sampling import Sampling, position_noise, probs_from_logits
from drafter_svc.engine import DrafterEngine

from helpers import PROMPTS, assert_same_tokens, generate_ids, reference, spec


def test_build_ranks_by_count_then_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 9])
    assert build_draft_vocab(counts, 4).tolist() == [5, 1, 3, 2]
    assert build_draft_vocab(counts, 10).tolist() == [5, 1, 3, 2, 0, 4]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 0)


def test_build_keeps_a_prior_vocabulary_after_the_seen_ids():
    """Warm start: ids of the earlier drafter's list follow the ids seen in the new data, in the
    earlier list's order, before ids neither has seen."""
    counts = torch.tensor([0, 5, 0, 0, 0, 9, 0])
    prior = torch.tensor([4, 1, 6])
    assert build_draft_vocab(counts, 7, prior).tolist() == [5, 1, 4, 6, 0, 2, 3]
    assert build_draft_vocab(counts, 3, prior).tolist() == [5, 1, 4]


def test_load_validates_the_file(tmp_path):
    assert load_draft_vocab(tmp_path, 10) is None                      # no file: full vocab
    save_draft_vocab(tmp_path, torch.tensor([3, 1, 7]))
    assert load_draft_vocab(tmp_path, 10).tolist() == [3, 1, 7]
    assert load_draft_vocab(tmp_path, 10, size=2).tolist() == [3, 1]
    assert load_draft_vocab(tmp_path, 10, size=0) is None
    with pytest.raises(ValueError, match="draft_vocab_size"):
        load_draft_vocab(tmp_path, 10, size=4)
    with pytest.raises(ValueError, match="outside"):
        load_draft_vocab(tmp_path, 5)
    save_draft_vocab(tmp_path, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="repeated"):
        load_draft_vocab(tmp_path, 10)


def _engines(make_drafter, tiny_target, tmp_path, n_ids):
    d = make_drafter(block_size=8)
    full = DrafterEngine.from_pretrained(d, tiny_target)
    ids = torch.randperm(full.cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:n_ids]
    sub_dir = shutil.copytree(d, tmp_path / "with_vocab")
    save_draft_vocab(sub_dir, ids)
    return full, DrafterEngine.from_pretrained(sub_dir, tiny_target), ids


def _req(ctx, sampling, sid="s"):
    return ProposalRequest(session_id=sid, context_start=0, context=ctx, anchor_token=7,
                           block_size=8, sampling=sampling)


def test_drafts_are_the_argmax_over_the_draft_vocab(make_drafter, tiny_target, tmp_path):
    full, sub, ids = _engines(make_drafter, tiny_target, tmp_path, 40)
    assert sub.draft_vocab.tolist() == ids.tolist() and full.draft_vocab is None
    ctx = torch.randn(6, full.cfg.context_size, generator=torch.Generator().manual_seed(1))
    got = sub.propose([_req(ctx, Sampling())])[0].tokens
    full.propose([_req(ctx, Sampling(), "g")])          # same context in the full engine
    with torch.inference_mode():                         # its full-vocabulary logits, restricted
        lg = full._draft_blocks([(_req(ctx, Sampling()), full._sessions["g"])])[0]
    assert got.tolist() == ids[lg[:, ids].argmax(-1)].tolist()
    assert set(got.tolist()) <= set(ids.tolist())


def test_sampled_drafts_carry_a_full_vocabulary_q_zero_outside(make_drafter, tiny_target, tmp_path):
    _, sub, ids = _engines(make_drafter, tiny_target, tmp_path, 40)
    ctx = torch.randn(6, sub.cfg.context_size, generator=torch.Generator().manual_seed(2))
    p = sub.propose([_req(ctx, Sampling(temperature=1.0))])[0]      # unseeded: q is sent
    assert p.probs.shape == (7, sub.cfg.vocab_size)
    outside = torch.ones(sub.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert float(p.probs[:, outside].abs().max()) == 0.0
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(7))
    assert all(float(p.probs[i, t]) > 0 for i, t in enumerate(p.tokens.tolist()))


def test_greedy_output_unchanged_with_a_draft_vocab(stack, make_drafter, tiny_target, hf_target,
                                                    tmp_path):
    """Half the vocabulary draftable: acceptance may drop, the output may not change."""
    _, sub, _ = _engines(make_drafter, tiny_target, tmp_path, 128)
    addr = stack.add_drafter(sub)
    v = stack.verifier_stub()
    for prompt in PROMPTS:
        got, last = generate_ids(v, prompt, max_tokens=24, speculation=spec(addr))
        assert_same_tokens(hf_target, prompt, got, reference(hf_target, prompt, 24))
        assert last.stats.drafts > 0


def test_seeded_drafts_race_the_verifiers_noise_over_the_draft_vocab(make_drafter, tiny_target,
                                                                      tmp_path):
    """A seeded draft at sequence index t is argmax(q_t / position_noise(seed, t)) over the draft
    vocabulary (the verifier's noise restricted to its ids), with the anchor at index 6 after
    6 context rows; no q is sent."""
    _, sub, ids = _engines(make_drafter, tiny_target, tmp_path, 40)
    ctx = torch.randn(6, sub.cfg.context_size, generator=torch.Generator().manual_seed(2))
    s = Sampling(temperature=1.0, seed=3)
    p = sub.propose([_req(ctx, s, "seeded")])[0]
    assert p.probs is None
    with torch.inference_mode():
        lg = sub._draft_blocks([(_req(ctx, s), sub._sessions["seeded"])])[0]     # [7, |ids|]
    noise = position_noise(3, range(7, 14), sub.cfg.vocab_size)[:, ids]
    want = ids[(probs_from_logits(lg, s) / noise).argmax(-1)]
    assert p.tokens.tolist() == want.tolist()
