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


def test_pool_cache_writes_in_place_and_matches_a_concatenating_cache(target_model):
    """Sessions' K/V live in the batch KV pool (``dflash.kv_pool``): decode, a rejected block
    cropped away (a length moves), a block verify and a batched step write in place, with no
    reallocation, and give the logits of transformers' own concatenating DynamicCache; an idle
    session spilled out of the pool comes back with its K/V."""
    from transformers import DynamicCache

    t = target_model
    ours, ref = t.new_cache(), DynamicCache(config=t.config)

    def hf(tokens):
        with torch.inference_mode():
            return t.model(input_ids=torch.tensor([tokens]), cache=ref, use_cache=True).logits[0].float()

    prompt = list(range(10, 40))
    torch.testing.assert_close(t.forward(prompt, ours, None)[0], hf(prompt), rtol=1e-5, atol=1e-5)
    pool = t.pool
    buf, grown = pool.k[0].data_ptr(), pool.grown

    def both(tokens, crop_to=None):
        torch.testing.assert_close(t.forward(tokens, ours, None)[0], hf(tokens), rtol=1e-5, atol=1e-5)
        if crop_to is not None:
            t.crop(ours, crop_to)
            ref.crop(crop_to - ref.get_seq_length())

    for tok in (7, 8, 9):
        both([tok])
    both([1, 2, 3, 4], crop_to=len(prompt) + 3 + 2)          # two drafts rejected
    both([5])                                              # overwrites the rejected positions
    assert pool.k[0].data_ptr() == buf and pool.grown == grown   # written in place
    assert ours.get_seq_length() == ref.get_seq_length() == len(prompt) + 3 + 2 + 1
    assert pool.capacity > ours.get_seq_length()           # room left for the next steps

    other = t.new_cache()
    t.forward(list(range(50, 60)), other, None)
    (a, _), _ = t.forward_batch([[11, 12], [13]], [ours, other], [(), ()])
    torch.testing.assert_close(a, hf([11, 12]), rtol=1e-5, atol=1e-5)   # batched: padded block
    assert ours.row == 0 and other.row == 1                # arranged onto the batch's rows
    held = pool.resident
    t.own(ours)                                            # spilled: its row is free
    assert not ours.resident and pool.resident == held - 1
    torch.testing.assert_close(t.forward([6], ours, None)[0], hf([6]), rtol=1e-5, atol=1e-5)
    assert ours.resident and pool.resident == held
