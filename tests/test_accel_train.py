"""The accelerator run (scripts/accel_train.sh, issue 21) without an accelerator.

1. The GGUF part logic (dflash_app.gguf_parts): parts named with their digests, missing parts
   named, a damaged part or a wrong joined digest refused; target_setup refuses a GGUF whose
   sha256 is not the pinned one before loading anything.
2. Every train-path function the device run calls creates no tensor on an implicit device: run
   with torch's default device set to ``meta`` (as tests/test_device_agnostic.py does for the
   step path) while the models live on the CPU given explicitly, it must give the same result.
   A tensor made without naming its device would be a meta tensor and fail at its first use
   with the model's, which on a GPU is the CPU/CUDA mix-up this guards against.
3. The dry run, three times as on the device (one GGUF part a run): the first two name the
   missing parts and exit 0; the third runs every stage and returns at most 8 files under 16
   MiB that re-join into a loadable drafter and a valid token store.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.core.config import default_target_layer_ids
from dflash_app import gguf_parts
from dflash_app.testing import make_tiny_target

ROOT = Path(__file__).resolve().parents[1]
LAYERS = tuple(default_target_layer_ids(6, 2))


def _fake(path: Path, n: int = 3000) -> tuple[Path, str]:
    data = random.Random(0).randbytes(n)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ 1. GGUF parts
def test_parts_are_stored_named_when_missing_and_joined_with_the_digest(tmp_path):
    src, sha = _fake(tmp_path / "f.gguf")
    parts = gguf_parts.split(src, tmp_path / "parts", 1024)
    assert [gguf_parts.parse(p.name)[:2] for p in parts] == [(1, 3), (2, 3), (3, 3)]
    store = tmp_path / "store"
    assert gguf_parts.missing(store) == (None, [])
    with pytest.raises(gguf_parts.MissingParts, match="all"):
        gguf_parts.join(store, tmp_path / "out", sha)
    gguf_parts.store([parts[1]], store)
    assert gguf_parts.missing(store) == (3, [1, 3])
    with pytest.raises(gguf_parts.MissingParts, match=r"missing parts: 1, 3 \(of 3\)") as e:
        gguf_parts.join(store, tmp_path / "out", sha)
    assert e.value.missing == [1, 3]
    assert gguf_parts.store([tmp_path / "parts"], store) == [store / parts[0].name, store / parts[2].name]
    out = gguf_parts.join(store, tmp_path / "out", sha)
    assert out.read_bytes() == src.read_bytes()


def test_a_wrong_digest_or_a_damaged_part_is_refused(tmp_path, capsys):
    src, sha = _fake(tmp_path / "f.gguf")
    parts = gguf_parts.split(src, tmp_path / "parts", 1024)
    store = tmp_path / "store"
    gguf_parts.store(parts, store)
    with pytest.raises(gguf_parts.PartError, match=f"sha256 {sha} != expected {'0' * 64}"):
        gguf_parts.join(store, tmp_path / "out", "0" * 64)
    assert not (tmp_path / "out").exists()
    assert gguf_parts.main(["join", "--store", str(store), "--out", str(tmp_path / "o"),
                            "--sha256", "0" * 64]) == 1
    assert "error: joined 3 parts" in capsys.readouterr().err
    bad = tmp_path / "bad" / parts[0].name
    bad.parent.mkdir()
    bad.write_bytes(b"x" + parts[0].read_bytes()[1:])
    with pytest.raises(gguf_parts.PartError, match="damaged in transit"):
        gguf_parts.store([bad], tmp_path / "store2")
    other = gguf_parts.split(src, tmp_path / "parts2", 2000)          # another split: 2 parts
    gguf_parts.store(other[:1], store)
    with pytest.raises(gguf_parts.PartError, match=r"splits into \[2, 3\] parts"):
        gguf_parts.missing(store)


def test_target_setup_refuses_a_gguf_that_is_not_the_pinned_one(tmp_path):
    from dflash.train.target_setup import setup_target

    src, _ = _fake(tmp_path / "f.gguf")
    with pytest.raises(RuntimeError, match=r"--gguf .*f\.gguf: sha256 [0-9a-f]{64} != expected"):
        setup_target(tmp_path / "cache", gguf=src)
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


# ------------------------------------------------------------------ 2. no implicit device
@contextmanager
def _meta_default():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash.train.data import load_target

    root = tmp_path_factory.mktemp("accel")
    target = make_tiny_target(root / "target", num_layers=6, hidden=64)
    model, tok = load_target(str(target), device="cpu")
    return model, tok, root


def test_datagen_paths_create_no_tensor_on_an_implicit_device(tiny, tmp_path):
    from dflash.train import featcache
    from dflash.train.datagen import decode_batch, generator_for, magpie_instructions, second_turns
    from dflash.train.tokdata import TokenStore

    model, tok, _ = tiny
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for t in ("hi", "a longer one")]
    kw = dict(max_new_tokens=8, stop_ids={tok.eos_token_id}, pad_id=tok.pad_token_id)

    def run():
        greedy = decode_batch(model, prompts, layer_ids=LAYERS, topk=3, **kw)
        sampled = decode_batch(model, prompts, temperature=1.0, top_p=0.9, generator=generator_for(model, 3), **kw)
        return greedy, sampled, magpie_instructions(model, tok, 4, seed=1, max_tokens=8)

    want = run()
    with _meta_default():
        got = run()
    assert [a.response for a in got[0]] == [a.response for a in want[0]]
    assert all(torch.equal(a.taps, b.taps) and a.taps.device.type == "cpu" for a, b in zip(got[0], want[0]))
    assert all(torch.equal(a.topk_ids, b.topk_ids) for a, b in zip(got[0], want[0]))
    assert [a.response for a in got[1]] == [a.response for a in want[1]] and got[2] == want[2]

    store = TokenStore(tmp_path / "data", fingerprint="sha256:test")
    seqs = [featcache.as_numpy_seq(p + a.response, len(p)) for p, a in zip(prompts, want[0])]
    store.add("shard_magpie_s0_0000.npz", seqs, source="magpie", vocab_size=model.config.vocab_size)
    turns = second_turns(model, tok, store, seed=0, k=0)
    feats = featcache.compute_features(model, seqs, LAYERS, 3)
    with _meta_default():
        assert second_turns(model, tok, store, seed=0, k=0) == turns
        again = featcache.compute_features(model, seqs, LAYERS, 3)
    for f, g in zip(feats, again):
        assert all(torch.equal(f[k], g[k]) and g[k].device.type == "cpu" for k in f)


def test_trainer_and_evaluate_create_no_tensor_on_an_implicit_device(tiny, tmp_path):
    """Training steps (vocabulary subset, then full; distillation), the held-out evaluation,
    checkpoints, the final save with a warm-start vocabulary, and the greedy DFlash loop."""
    from dflash.core.checkpoint import load_drafter, load_target_head
    from dflash.recipe import ckpt
    from dflash.train.evaluate import dflash_greedy
    from dflash.train.featcache import as_numpy_seq
    from dflash.train.tokdata import TokenStore
    from dflash.train.trainer import TrainConfig, Trainer, drafter_config

    model, tok, root = tiny
    tcfg = json.loads((root / "target" / "config.json").read_text())
    fp = drafter_config(TrainConfig(data_dir="", target_dir="", run_dir=""), tcfg,
                        load_target_head(root / "target")).target_fingerprint
    rng = random.Random(0)
    seqs = [as_numpy_seq([rng.randrange(256) for _ in range(5)] + [97 + j % 5 for j in range(20 + i)], 5)
            for i in range(8)]
    TokenStore(tmp_path / "data", fingerprint=fp).add("shard_t_s0_0000.npz", seqs, source="t", vocab_size=260)

    def cfg(run, **kw):
        return TrainConfig(**{**dict(
            data_dir=str(tmp_path / "data"), target_dir=str(root / "target"), run_dir=str(tmp_path / run),
            cache_dir=str(tmp_path / "featcache"), block_size=4, num_layers=1, intermediate_size=128,
            num_heads=4, num_kv_heads=2, head_dim=16, num_taps=2, mask_token_id=259, lr=5e-3,
            max_steps=6, seqs_per_step=2, anchors_per_seq=3, log_every=2, kl_weight=0.5, topk=4,
            full_vocab_after=0.5, heldout_every=3, heldout_batch=2, draft_vocab_size=32,
            device="cpu"), **kw})

    Trainer(cfg("base", out_dir=str(tmp_path / "base"))).train()
    results = []
    for run, meta in (("plain", False), ("meta", True)):
        tr = Trainer(cfg(run, init_from=str(tmp_path / "base"), out_dir=str(tmp_path / f"{run}_out")))
        if meta:
            with _meta_default():
                results.append(tr.train())
        else:
            results.append(tr.train())
    assert results[0]["heldout"] == results[1]["heldout"]
    for name, v in ckpt.load(tmp_path / "plain")[1].items():
        torch.testing.assert_close(ckpt.load(tmp_path / "meta")[1][name], v, msg=name)
    drafter = load_drafter(tmp_path / "meta_out", dtype=torch.float32)
    head = load_target_head(root / "target")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    want = dflash_greedy(model, drafter, head, prompt, 12, {tok.eos_token_id})
    with _meta_default():
        got = dflash_greedy(model, drafter, head, prompt, 12, {tok.eos_token_id})
    assert (got.tokens, got.accept_lengths) == (want.tokens, want.accept_lengths)


# ------------------------------------------------------------------ 3. the dry run
def _run(tmp_path: Path, i: int, sha: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"out{i}"
    env = {**os.environ, "OUT": str(out), "DFLASH_ACCEL_HOME": str(tmp_path / "home"),
           "DFLASH_ACCEL_CARRY": str(tmp_path / "carry" / f"run{i}"), "DFLASH_ACCEL_GGUF_SHA256": sha,
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "accel_train.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return proc, json.loads((out / "results.json").read_text())


def _git_status(*paths: str) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.slow
def test_the_dry_run_waits_for_parts_then_returns_a_drafter_and_shards(tmp_path):
    from dflash.core.checkpoint import load_drafter
    from dflash.train.tokdata import TokenStore

    before = _git_status("data/train", "models")
    src, sha = _fake(tmp_path / "fake.gguf")
    for i, part in enumerate(gguf_parts.split(src, tmp_path / "parts", 1024), 1):
        (tmp_path / "carry" / f"run{i}").mkdir(parents=True)
        part.rename(tmp_path / "carry" / f"run{i}" / part.name)
    for i, gaps in ((1, [2, 3]), (2, [3])):
        proc, res = _run(tmp_path, i, sha)
        assert f"missing parts: {', '.join(map(str, gaps))}" in proc.stdout
        assert res["status"] == "waiting for parts" and res["gguf"]["missing"] == gaps
        assert list(res["stages"]) == ["gguf"]

    _, res = _run(tmp_path, 3, sha)
    out = tmp_path / "out3"
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() and p.stat().st_size < 16 << 20 for p in out.iterdir()) and len(files) <= 8
    pieces = [f for f in files if f.startswith("drafter.tar.part")]
    assert len(pieces) >= 2                       # the dry run cuts its small drafter too
    assert set(files) - set(pieces) == {"accel.log", "details.tar.gz", "results.json", "shards.tar.gz"}
    assert res["status"] == "ok" and res["gguf"] == {"parts": 3, "missing": [], "joined": True}
    assert {k: v["status"] for k, v in res["stages"].items()} == {
        s: "ok" for s in ("gguf", "target", "base-data", "base-drafter", "datagen", "features", "train",
                          "eval-base", "eval-new")}
    assert res["train"]["heldout_tau_before"] > 0 and res["train"]["heldout_tau_after"] > 0
    assert res["train"]["config"]["device"] == "cpu" and res["train"]["config"]["kl_weight"] == 0.5
    assert {w: set(r) for w, r in res["eval"].items()} == {"base": {"humaneval", "chat"}, "new": {"humaneval", "chat"}}
    seed = res["data"]["prompt_seed"]
    assert seed >= 1000 and res["data"]["new"] and res["data"]["committed"]

    joined = tmp_path / "joined"
    joined.mkdir()
    with open(tmp_path / "drafter.tar", "wb") as f:
        for p in pieces:
            f.write((out / p).read_bytes())
    with tarfile.open(tmp_path / "drafter.tar") as tar:
        tar.extractall(joined, filter="data")
    drafter = load_drafter(joined / "drafter")
    assert drafter.cfg.version == "accel-1" and (joined / "drafter" / "README.md").is_file()

    store_dir = tmp_path / "store"                # the committed store + the returned tar
    committed = tmp_path / "home" / "work" / "data"
    store_dir.mkdir()
    for p in committed.glob("shard_*.npz"):
        if f"_s{seed}_" not in p.name:
            (store_dir / p.name).write_bytes(p.read_bytes())
    with tarfile.open(out / "shards.tar.gz") as tar:
        tar.extractall(store_dir, filter="data")
    store = TokenStore(store_dir)
    new = [e for e in store.shards() if e["seed"] == seed]
    assert sorted(e["name"] for e in new) == sorted(res["data"]["new_shards"])
    for e in store.shards():
        assert all(len(s.ids) == len(s.loss_mask) and np.any(s.loss_mask) for s in store.read(e))
    assert all(e["dtype"] == "bfloat16" for e in new)
    assert _git_status("data/train", "models") == before       # the repository's data untouched
