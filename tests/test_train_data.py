"""Training data kept as token ids: generation loop, shards + manifest, feature cache, prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.core.config import default_target_layer_ids
from dflash.train import chat_prompts, featcache
from dflash.train.data import load_target
from dflash.train.datagen import decode_batch, magpie_instructions, user_header
from dflash.train.tokdata import DataError, TokenSeq, TokenStore, read_shard
from dflash_app.testing import make_tiny_target

LAYERS = tuple(default_target_layer_ids(6, 2))
K = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokdata")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    model, tok = load_target(str(target))
    return model, tok, root


def _prompts(tok):
    texts = ["hello there", "a much longer prompt about lists and numbers", "x"]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for t in texts]


def test_decode_loop_is_greedy_generate(tiny):
    """The batched loop (left padding, rows leaving the batch) answers as HF generate does, one
    prompt at a time."""
    model, tok, _ = tiny
    prompts = _prompts(tok)
    answers = decode_batch(model, prompts, max_new_tokens=12, stop_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, layer_ids=LAYERS, topk=K)
    for p, a in zip(prompts, answers):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert a.response == ref
        assert a.taps.shape == (len(p) + len(a.response), 2 * 64) and a.taps.dtype == torch.bfloat16
        assert a.topk_ids.shape == (len(a.response), K)
        assert (a.topk_ids[:, 0] == torch.tensor(a.response)).all()     # greedy: top-1 is the token


def test_token_ids_round_trip_to_features(tiny, tmp_path):
    """ids written -> features recomputed by one forward equal (to bf16 rounding) the taps and
    distributions taken during generation."""
    model, tok, _ = tiny
    prompts = _prompts(tok)
    answers = decode_batch(model, prompts, max_new_tokens=10, stop_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, layer_ids=LAYERS, topk=K)
    store = TokenStore(tmp_path / "data", fingerprint="sha256:test")
    seqs = [featcache.as_numpy_seq(p + a.response, len(p)) for p, a in zip(prompts, answers)]
    entry = store.add("shard_x_s0_0000.npz", seqs, source="x", vocab_size=model.config.vocab_size)
    again = TokenStore(tmp_path / "data", fingerprint="sha256:test")
    back = again.read(again.shards()[0])
    for s, b in zip(seqs, back):
        assert np.array_equal(s.ids, b.ids) and np.array_equal(s.loss_mask, b.loss_mask)
    rec = featcache.compute_features(model, back, LAYERS, K)
    for p, a, r in zip(prompts, answers, rec):
        torch.testing.assert_close(r["taps"].float(), a.taps.float(), rtol=2 ** -7, atol=1e-3)
        assert torch.equal(r["topk_ids"][len(p):], a.topk_ids)
        torch.testing.assert_close(r["topk_logp"][len(p):].float(), a.topk_logp.float(), rtol=2e-3, atol=2e-3)
        assert not r["topk_ids"][:len(p)].any()
    # the trainer's path: a cache entry is written once, then read back for the same shard
    calls = []
    got_seqs, feats = featcache.ensure_features(again, entry, tmp_path / "cache",
                                                lambda: calls.append(1) or model, LAYERS, K)
    featcache.ensure_features(again, entry, tmp_path / "cache", lambda: calls.append(1) or model, LAYERS, K)
    assert len(calls) == 1 and torch.equal(feats[0]["taps"], rec[0]["taps"])
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["totals"]["x"]["sequences"] == 3


def test_truncated_and_foreign_shards_are_refused(tmp_path):
    seqs = [TokenSeq(np.array([1, 2, 3, 4]), np.array([0, 0, 1, 1], dtype=np.uint8))]
    store = TokenStore(tmp_path, fingerprint="sha256:aaaa")
    entry = store.add("shard_a_s0_0000.npz", seqs, source="a", vocab_size=10)
    path = tmp_path / entry["name"]
    assert store.read(entry)[0].ids.tolist() == [1, 2, 3, 4]
    with pytest.raises(DataError, match="another target"):
        TokenStore(tmp_path, fingerprint="sha256:bbbb")
    with pytest.raises(DataError, match="another target"):
        read_shard(path, fingerprint="sha256:bbbb")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="truncated"):
        store.read(entry)
    with pytest.raises(DataError, match="not a readable token shard"):
        read_shard(path)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.npz"):
        read_shard(tmp_path / "junk.npz")
    with pytest.raises(DataError, match="outside"):
        store.add("shard_a_s0_0001.npz", [TokenSeq(np.array([1, 99]), np.array([0, 1], np.uint8))],
                  source="a", vocab_size=10)


def test_passage_prompts_deterministic_and_never_eval(tmp_path):
    from dflash.train.eval_sets import CHAT_EVAL

    site = tmp_path / "site"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    paras = [f"Paragraph number {i} explains how the library stores its settings. It keeps them "
             f"in a small file. Users can change them at any time without restarting anything at all, "
             f"and the changes are kept when the program starts again."
             for i in range(6)]
    leaked = CHAT_EVAL[3].split(": ", 1)[1]           # an evaluation passage planted in a source
    body = "\n\n".join(paras + [leaked, "```python\nprint('code is not prose')\n```"])
    (site / "pkg-1.0.dist-info" / "METADATA").write_text(f"Name: pkg\nVersion: 1.0\n\n{body}\n")
    roots = (site,)
    pool = chat_prompts.passages(roots)
    assert leaked in pool and len(pool) == 7           # found, code block skipped ...
    a = chat_prompts.passage_prompts(6, seed=3, roots=roots)
    assert a == chat_prompts.passage_prompts(6, seed=3, roots=roots)
    assert a != chat_prompts.passage_prompts(6, seed=4, roots=roots)
    assert not any(leaked in p for p in a)             # ... but never put to the target
    with pytest.raises(ValueError, match="num_prompts"):
        chat_prompts.passage_prompts(7, seed=3, roots=roots)


def test_filters_drop_eval_prompts_and_duplicates():
    from dflash.train.eval_sets import CHAT_EVAL, load_problems

    assert chat_prompts.clean_instruction(CHAT_EVAL[0]) is None
    assert chat_prompts.clean_instruction(CHAT_EVAL[5].upper() + "!") is None
    assert chat_prompts.is_eval_prompt("Complete this:\n" + load_problems(1)[0][1])
    assert chat_prompts.clean_instruction("How do I keep basil alive on a windowsill?")
    assert chat_prompts.clean_instruction("<|im_start|>user hi there friend") is None
    assert chat_prompts.dedupe(["Hi, there!", "hi there", "other"]) == ["Hi, there!", "other"]


def test_code_sources_are_deterministic_and_never_humaneval():
    from dflash.train.datagen import source_prompts
    from dflash.train.eval_sets import load_problems

    a = source_prompts("template", 20, seed=5)
    assert a == source_prompts("template", 20, seed=5) and a != source_prompts("template", 20, seed=6)
    problems = {p for _, p in load_problems()}
    assert not any(p in t for t in a for p in problems)
    with pytest.raises(ValueError, match="source"):
        source_prompts("nope", 1, seed=0)


def test_magpie_instructions_seeded(tiny):
    model, tok, _ = tiny
    head = user_header(tok)
    assert tok.decode(head).endswith("user\n")
    a = magpie_instructions(model, tok, 6, seed=1, max_tokens=20)
    assert a == magpie_instructions(model, tok, 6, seed=1, max_tokens=20)
    assert all(chat_prompts.clean_instruction(t) == t for t in a)


def test_generate_resumes_from_the_manifest(tiny, tmp_path, monkeypatch):
    """A second run skips the batches the manifest lists; the feature cache gets every shard."""
    from dflash.train import datagen

    model, tok, root = tiny
    monkeypatch.setattr(datagen, "source_prompts",
                        lambda src, n, seed: [f"{src} prompt {i} seed {seed}" for i in range(n)])
    monkeypatch.setattr(datagen, "source_size", lambda src: 1000)
    cfg = datagen.GenConfig(data_dir=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                            target_dir=str(root / "target"), layer_ids=LAYERS,
                            mix={"code": 1, "passage": 1}, batch_size=2, max_new_tokens=4, topk=K)
    totals = datagen.generate(cfg)
    assert totals["code"]["sequences"] == 2 and totals["passage"]["sequences"] == 2
    store = TokenStore(tmp_path / "data")
    first = {e["name"]: e["sha256"] for e in store.shards()}
    more = datagen.GenConfig(**{**cfg.__dict__, "mix": {"code": 2, "passage": 1}})
    datagen.generate(more)
    store = TokenStore(tmp_path / "data")
    names = {e["name"]: e["sha256"] for e in store.shards()}
    assert set(names) == set(first) | {"shard_code_s0_0001.npz"}
    assert all(names[n] == h for n, h in first.items())
    fp = store.fingerprint
    for n in names:
        assert featcache.valid_entry(featcache.cache_path(tmp_path / "cache", fp, n), sha256=names[n],
                                     layer_ids=LAYERS, k=K)
    assert Path(store.root / "manifest.json").is_file()
