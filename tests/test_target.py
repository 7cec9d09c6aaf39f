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
    """Sessions' K/V live in the batch KV pool (``dflash.core.kv_pool``): decode, a rejected block
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


def _tiny_mistral(path, window):
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                        max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_sliding_window_target_matches_transformers_through_the_pool(tmp_path):
    """A Mistral-style config (a ``sliding_window`` and no ``layer_types``) slides on every
    layer: the pool's mask keeps each query within the window, single and batched, with rows
    of different lengths; logits equal transformers' own forward of each whole sequence."""
    from transformers import AutoModelForCausalLM

    from verifier_svc.target import TargetModel

    path = _tiny_mistral(tmp_path / "mistral", window=5)
    t = TargetModel(path)
    assert (t.attention.kind, t.attention.sliding_window) == ("sliding_attention", 5)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 14, 20)]
    caches = [t.new_cache() for _ in seqs]
    for s, c in zip(seqs, caches):
        t.forward(s[:-4], c, None)
    outs = t.forward_batch([s[-4:] for s in seqs[:2]] + [seqs[2][-4:-2]], caches, [()] * 3)
    for s, (logits, _) in zip(seqs, outs):
        m = logits.shape[0]
        with torch.no_grad():
            want = hf(torch.tensor([s[:len(s) - 4 + m]])).logits[0, -m:]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
    full = AutoModelForCausalLM.from_pretrained(path, sliding_window=None).eval()
    with torch.no_grad():   # the window matters: without it the same weights give other logits
        unwindowed = full(torch.tensor([seqs[1]])).logits[0, -4:]
    assert (unwindowed - outs[1][0]).abs().max() > 1e-3


def test_attention_layouts_the_pool_cannot_express_are_refused():
    """Eager attention (which would add a boolean mask), chunked attention and unknown layer
    types are refused naming the field; the layouts the pool serves are recognised."""
    from dataclasses import astuple

    import pytest

    from verifier_svc.target_layout import attention_layout

    def layout(impl="sdpa", **fields):
        return astuple(attention_layout(fields, impl))

    assert layout() == ("full_attention", None)
    assert layout(sliding_window=8) == ("sliding_attention", 8)
    assert layout(sliding_window=8, use_sliding_window=False) == ("full_attention", None)
    assert layout(sliding_window=8, layer_types=["full_attention", "sliding_attention"]) == ("mixed", 8)
    for bad, field in ((dict(impl="eager"), "attn_implementation"),
                       (dict(attention_chunk_size=64), "attention_chunk_size"),
                       (dict(layer_types=["linear_attention"]), "layer_types"),
                       (dict(layer_types=["sliding_attention"]), "sliding_window")):
        with pytest.raises(ValueError, match=field):
            layout(**bad)


def test_a_recurrent_target_is_refused_naming_the_model_type(tmp_path):
    """A state-space model (Mamba) keeps a recurrent state the batch KV pool has no room for:
    loading it fails naming ``model_type``, before any layout field is read."""
    import pytest
    from transformers import AutoModelForCausalLM, MambaConfig

    from verifier_svc.target import TargetModel

    cfg = MambaConfig(vocab_size=96, hidden_size=32, state_size=4, num_hidden_layers=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mamba")
    with pytest.raises(ValueError, match="model_type: 'mamba'"):
        TargetModel(tmp_path / "mamba")
