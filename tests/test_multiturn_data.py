"""Second-turn training data (source ``chat2``) and bf16 generation that writes ids only."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.core.config import default_target_layer_ids
from dflash.train import chat_prompts, featcache, multiturn
from dflash.train.data import load_target
from dflash.train.tokdata import TokenStore
from dflash_app.testing import make_tiny_target

LAYERS = tuple(default_target_layer_ids(6, 2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    model, tok = load_target(str(target))
    return model, tok, root


def _chat(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def _first_turn(tok, user: str, answer: str) -> list[int]:
    return _chat(tok, [{"role": "user", "content": user}]) + \
        tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_second_turn_prompt_is_the_chat_template(tiny):
    """Generated first-turn ids + separators == the template rendering of the whole conversation."""
    _, tok, _ = tiny
    user_head, asst_head, eos = multiturn.turn_separators(tok)
    assert eos == tok.eos_token
    first = _first_turn(tok, "name three colours", "red green blue")
    got = multiturn.second_turn_prompt(first, tok("now repeat them", add_special_tokens=False)["input_ids"],
                                       user_head, asst_head)
    want = _chat(tok, [{"role": "user", "content": "name three colours"},
                       {"role": "assistant", "content": "red green blue"},
                       {"role": "user", "content": "now repeat them"}])
    assert got == want


def test_follow_ups_are_deterministic_mixed_and_never_eval():
    a = multiturn.follow_up_plan(200, seed=3)
    assert a == multiturn.follow_up_plan(200, seed=3) != multiturn.follow_up_plan(200, seed=4)
    own = sum(f is None for f in a)
    assert 60 < own < 140                      # about half written by the target
    assert all(f in multiturn.FOLLOW_UPS for f in a if f is not None)
    assert not any(chat_prompts.is_eval_prompt(f) for f in multiturn.FOLLOW_UPS)


def test_second_turns_continue_the_magpie_shard(tiny, tmp_path):
    """chat2 batch k continues shard_magpie_s<seed>_<k>: every conversation (one cut at the cap
    ends its turn there), each prompt starts with the conversation's ids and ends with the
    assistant header; seeded."""
    from dflash.train.datagen import second_turns

    model, tok, _ = tiny
    store = TokenStore(tmp_path / "data", fingerprint="sha256:test")
    firsts = [_first_turn(tok, f"question {i}", f"answer number {i}") for i in range(5)]
    cut = _chat(tok, [{"role": "user", "content": "cut off"}]) + [5, 6, 7]        # no end of turn
    firsts_closed = firsts + [cut + [tok.eos_token_id]]
    seqs = [featcache.as_numpy_seq(f, 3) for f in firsts + [cut]]
    assert second_turns(model, tok, store, seed=0, k=0) == []                    # nothing to continue
    store.add("shard_magpie_s0_0000.npz", seqs, source="magpie", vocab_size=model.config.vocab_size)
    got = second_turns(model, tok, store, seed=0, k=0)
    assert got == second_turns(model, tok, store, seed=0, k=0)
    assert len(got) == 6 and [len(p) for p in got] == sorted(len(p) for p in got)
    _, asst_head, _ = multiturn.turn_separators(tok)
    for p in got:
        first = next(f for f in firsts_closed if p[:len(f)] == f)
        assert len(p) > len(first) + len(asst_head) and p[-len(asst_head):] == asst_head
    assert second_turns(model, tok, store, seed=0, k=1) == []


def test_bf16_generation_writes_ids_and_the_trainer_recomputes_float32_features(tiny, tmp_path, monkeypatch):
    from dflash.train import datagen

    model, tok, root = tiny
    monkeypatch.setattr(datagen, "source_prompts", lambda src, n, seed: [f"{src} prompt {i}" for i in range(n)])
    monkeypatch.setattr(datagen, "source_size", lambda src: 1000)
    cfg = datagen.GenConfig(data_dir=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                            target_dir=str(root / "target"), layer_ids=LAYERS, mix={"code": 1},
                            batch_size=2, max_new_tokens=4, topk=3, dtype="bfloat16")
    datagen.generate(cfg)
    store = TokenStore(tmp_path / "data")
    (entry,) = store.shards()
    assert entry["dtype"] == "bfloat16"
    path = featcache.cache_path(tmp_path / "cache", store.fingerprint, entry["name"])
    assert not path.exists()                          # bf16 taps are not the served target's
    seqs, feats = featcache.ensure_features(store, entry, tmp_path / "cache", lambda: model, LAYERS, 3)
    ref = featcache.compute_features(model, seqs, LAYERS, 3)
    assert all(np.array_equal(f["taps"].float().numpy(), r["taps"].float().numpy()) for f, r in zip(feats, ref))
    with pytest.raises(ValueError, match="dtype"):
        datagen.generate(datagen.GenConfig(**{**cfg.__dict__, "dtype": "int8"}))


def test_chat2_is_a_mix_source():
    from dflash.train.__main__ import _mix

    assert _mix("magpie=2,chat2=2") == {"magpie": 2, "chat2": 2}
