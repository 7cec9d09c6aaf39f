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


def test_session_cache_appends_in_place_and_matches_a_concatenating_cache(target_model):
    """A session's cache writes each step into spare room of one buffer (no copy of the whole
    cache per layer and step); decode, a rejected block cropped away, a block verify and a
    batched step give exactly the logits of transformers' concatenating DynamicCache."""
    from transformers import DynamicCache

    t = target_model
    ours, ref = t.new_cache(), DynamicCache(config=t.config)
    prompt = list(range(10, 40))
    torch.testing.assert_close(t.forward(prompt, ours, None)[0], t.forward(prompt, ref, None)[0],
                               rtol=0, atol=0)
    layer = ours.layers[0]
    buf = layer.keys.data_ptr()

    def both(tokens, crop_to=None):
        a, b = t.forward(tokens, ours, None)[0], t.forward(tokens, ref, None)[0]
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        if crop_to is not None:
            t.crop(ours, crop_to)
            t.crop(ref, crop_to)

    for tok in (7, 8, 9):
        both([tok])
    both([1, 2, 3, 4], crop_to=len(prompt) + 3 + 2)          # two drafts rejected
    both([5])                                              # overwrites the rejected positions
    assert layer.keys.data_ptr() == buf                    # still the same buffer
    assert ours.get_seq_length() == ref.get_seq_length() == len(prompt) + 3 + 2 + 1
    assert layer._kbuf.shape[-2] > ours.get_seq_length()   # room left for the next steps

    other = t.new_cache()
    t.forward(list(range(50, 60)), other, None)
    (a, _), _ = t.forward_batch([[11, 12], [13]], [ours, other], [(), ()])
    b, _ = t.forward([11, 12], ref, None)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # batched: padded shapes
    t.own(ours)                                            # owned copy, room released
    assert layer._kbuf is None
    a, b = t.forward([6], ours, None)[0], t.forward([6], ref, None)[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # K/V of [11, 12] came from the batch
    assert layer._kbuf is not None and layer.keys.data_ptr() == layer._kbuf.data_ptr()
