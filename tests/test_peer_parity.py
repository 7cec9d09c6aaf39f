"""Parity with the peer implementation: transformers' DFlash drafter (MuseGlimmerAssistantModel).

The same z-lab weights loaded into transformers' drafter give the same draft logits and tokens as
ours, and transformers' own ``generate(..., speculation_type="dflash")`` accepts the same number
of drafts at every step as our loop, so tau matches.
"""

from __future__ import annotations

import pytest
import torch

from dflash.core.checkpoint import load_target_head
from dflash.core.taps import tap_features
from dflash_app.hf_peer import load_peer_drafter
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine

from helpers import PROMPTS


@pytest.fixture(scope="module")
def drafter_dir(make_drafter):
    return make_drafter(block_size=8, num_layers=2, target_layer_ids=[0, 1, 2])


def test_draft_logits_and_tokens_match_transformers(drafter_dir, tiny_target, hf_target):
    ours = DrafterEngine.from_pretrained(drafter_dir, tiny_target)
    peer = load_peer_drafter(drafter_dir)
    head = load_target_head(tiny_target)
    cfg = ours.cfg
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            feats = tap_features(hf_target(ids, output_hidden_states=True).hidden_states,
                                 cfg.target_layer_ids)
            n = feats.shape[1]
            block = torch.tensor([[prompt[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1)])
            emb = head.embed_tokens(block)
            # ours, in two context chunks (as the service receives them) ...
            kv = ours.drafter.context_kv(feats[:, :n // 2], torch.arange(n // 2)[None])
            kv2 = ours.drafter.context_kv(feats[:, n // 2:], torch.arange(n // 2, n)[None])
            kv = [(torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2)) for a, b in zip(kv, kv2)]
            ours_logits = head.logits(ours.drafter(emb, torch.arange(n, n + cfg.block_size)[None], kv))
            # ... and transformers' drafter on the whole context at once.
            h = peer(noise_embeds=emb, context_hidden_states=feats,
                     position_ids=torch.arange(n + cfg.block_size)[None]).last_hidden_state
            peer_logits = head.logits(h)
        torch.testing.assert_close(ours_logits, peer_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours_logits[0, 1:].argmax(-1), peer_logits[0, 1:].argmax(-1))


def test_tau_matches_transformers_dflash_generate(drafter_dir, tiny_target, hf_target, target_model):
    from dflash_app.hf_peer import record_acceptance

    peer = load_peer_drafter(drafter_dir)
    engine = VerifierEngine(target_model)
    proposer = DrafterEngine.from_pretrained(drafter_dir, tiny_target)
    n_new = 48
    for prompt in PROMPTS:
        with record_acceptance() as hf_matches:
            out = hf_target.generate(torch.tensor([prompt]), assistant_model=peer,
                                     speculation_type="dflash", do_sample=False, max_new_tokens=n_new)
        plain = hf_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n_new)
        assert torch.equal(out, plain)
        events = list(engine.generate(Request(request_id="p", prompt=prompt, max_tokens=n_new,
                                              proposer=proposer)))
        ours = [e.accepted for e in events if e.drafted == proposer.card.block_size - 1]
        got = [t for e in events for t in e.tokens]
        assert got == out[0, len(prompt):].tolist()
        # Every full-block step we took, transformers took too, with the same acceptance
        # (transformers' last steps may be clipped by max_length differently).
        k = min(len(ours), len(hf_matches))
        assert k >= 3
        assert ours[:k] == hf_matches[:k]
        tau_ours = 1 + sum(ours[:k]) / k
        tau_hf = 1 + sum(hf_matches[:k]) / k
        assert tau_ours == tau_hf
