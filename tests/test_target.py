"""verifier_svc.target.TargetModel: the forward the verifier's prefill and verify use."""

from __future__ import annotations

import torch


def test_logits_to_keep_gives_the_last_rows_only(target_model):
    """Prefill asks for the last row only; it equals the last row of an all-rows forward (the
    hidden states are the same; only the LM head's row count differs)."""
    prompt = list(range(10, 40))
    full_cache, last_cache = target_model.new_cache(), target_model.new_cache()
    full, taps_full = target_model.forward(prompt, full_cache, (1,))
    last, taps_last = target_model.forward(prompt, last_cache, (1,), logits_to_keep=1)
    assert full.shape[0] == len(prompt) and last.shape[0] == 1
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-5)
    assert int(last[0].argmax()) == int(full[-1].argmax())
    torch.testing.assert_close(taps_last, taps_full)              # taps cover every position
    assert full_cache.get_seq_length() == last_cache.get_seq_length() == len(prompt)
