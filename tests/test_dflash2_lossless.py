"""Speculation with a DFlash2 drafter is lossless in every mode.

Greedy: the real tiny target with a random DFlash2 drafter (every conv and selector tensor
random, so each acts), in each speculation mode, gives the target's own greedy tokens.
Sampled: the Markov target of ``tests/test_sampling_lossless.py`` (exact transition
probabilities known) with a real DFlash2 ``DrafterEngine`` over its 4-token vocabulary, the
selector keeping the top 3 candidates (so q is zero on one token of every row): unseeded
(rejection) chains and seeded (coupled) DDTree trees, Pearson chi-square against
the exact distribution at the same level and sample size as there.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dflash.core.config import DrafterConfig
from dflash.core.dflash2 import DFlash2Drafter
from dflash.core.modeling import TargetHead
from dflash.core.sampling import Sampling
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine

from helpers import MAX_NEW, PROMPTS, assert_same_tokens, fixed_os_randomness, reference
from test_sampling_lossless import (
    ALPHA,
    N_TRANSITIONS,
    PROMPT,
    SETTINGS,
    TOKENS_PER_REQUEST,
    MarkovTarget,
    exact_transition_probs,
    goodness_of_fit,
    required_samples,
    transition_counts,
)


@pytest.fixture(scope="module")
def dflash2_engine(tiny_target, tmp_path_factory):
    from dflash_app.testing import make_tiny_drafter

    d = make_tiny_drafter(tmp_path_factory.mktemp("dflash2"), tiny_target, block_size=8,
                          dflash2=True)
    eng = DrafterEngine.from_pretrained(d, tiny_target, context_threads=0)
    assert isinstance(eng.drafter, DFlash2Drafter)
    yield eng
    eng.close()


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "tree", "hybrid", "suffix"])
def test_greedy_identical_in_every_mode(target_model, hf_target, dflash2_engine, mode):
    engine = VerifierEngine(target_model, spec_mode=mode)
    try:
        drafted = 0
        for i, prompt in enumerate(PROMPTS):
            req = Request(request_id=f"{mode}{i}", prompt=list(prompt), max_tokens=MAX_NEW,
                          proposer=dflash2_engine, spec_mode=mode)
            got = []
            for ev in engine.generate(req):
                got += ev.tokens
                drafted += ev.drafted
            assert_same_tokens(hf_target, prompt, got, reference(hf_target, prompt))
        assert drafted > 0
    finally:
        engine.close()


def markov_dflash2() -> DrafterEngine:
    """A DFlash2 drafter for the 4-token Markov target (hidden 8, taps of its 2 layers)."""
    cfg = DrafterConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=4,
                        block_size=8, mask_token_id=3, target_layer_ids=(0, 1),
                        architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=4,
                        selector_rank=4, selector_top_k=3, final_logit_softcapping=3.0)
    torch.manual_seed(11)
    m = DFlash2Drafter(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("base_kernel"):
                p.normal_(0.0, 0.3)
                p[:, 0] += 1.0
            elif p.dim() == 2:
                p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
    return DrafterEngine(m.eval(), head, context_threads=0)


@functools.cache
def run(mode: str, seeded: bool) -> tuple[np.ndarray, dict]:
    sampling = SETTINGS[1]
    engine = VerifierEngine(MarkovTarget(), spec_mode=mode, tree_budget=8)
    drafter = markov_dflash2()
    seqs, info = [], {"drafted": 0, "accepted": 0, "rejected_steps": 0}
    try:
        with fixed_os_randomness(9_000_000):
            for i in range(-(-N_TRANSITIONS // TOKENS_PER_REQUEST)):
                req = Request(request_id=f"m{i}", prompt=list(PROMPT), max_tokens=TOKENS_PER_REQUEST,
                              sampling=Sampling(temperature=sampling.temperature,
                                                seed=9000 + i if seeded else None),
                              proposer=drafter, spec_mode=mode)
                out = []
                for ev in engine.generate(req):
                    out += ev.tokens
                    info["drafted"] += ev.drafted
                    info["accepted"] += ev.accepted
                    info["rejected_steps"] += bool(ev.drafted) and ev.accepted < ev.drafted
                assert len(out) == TOKENS_PER_REQUEST
                seqs.append(PROMPT + out)
    finally:
        engine.close()
        drafter.close()
    return transition_counts(seqs), info


@pytest.mark.slow   # statistical: 21,000 transitions per case, ~1-2 min each on 2 busy cores
@pytest.mark.parametrize("mode,seeded", [("fixed", False), ("tree", True)])
def test_sampled_with_dflash2_matches_target_distribution(mode, seeded):
    p = exact_transition_probs(SETTINGS[1])
    need, df_need = required_samples(p)
    assert N_TRANSITIONS >= need
    counts, info = run(mode, seeded)
    assert counts.sum() >= N_TRANSITIONS
    # drafts were accepted and rejected, so both verification paths ran
    assert info["accepted"] > 1000 and info["rejected_steps"] > 1000
    stat, df, pval = goodness_of_fit(counts, p)
    assert df == df_need
    assert pval > ALPHA, f"DFlash2 {mode} sampling is biased: chi2={stat:.1f} df={df} p={pval:.2e}"


def test_offline_evaluation_loop_with_dflash2_is_the_targets_greedy(hf_target, tiny_target,
                                                                   dflash2_engine):
    """``dflash.train.evaluate.dflash_greedy`` (what the held-out gate and the accelerator
    run measure with) drafts the selector's path and commits the target's greedy tokens."""
    from dflash.core.checkpoint import load_target_head
    from dflash.train.evaluate import dflash_greedy

    head = load_target_head(tiny_target)
    for prompt in PROMPTS:
        got = dflash_greedy(hf_target, dflash2_engine.drafter, head, list(prompt), MAX_NEW, set())
        assert got.tokens[:MAX_NEW] == reference(hf_target, prompt, ignore_eos=True)[:len(got.tokens)]
        assert len(got.tokens) >= MAX_NEW
