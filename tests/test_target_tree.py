"""Tree verification on the target (DDTree, arXiv 2604.12989): ``TargetModel.forward`` /
``forward_batch`` with ``parents`` (ancestor-only mask, position ids by depth) and
``TargetModel.keep`` (the accepted path's K/V compacted in place, ``KVPool.compact``).

The reference for every tree node is its root-to-node path run as a plain chain from the same
cache. Tolerance, measured: over 60 random trees of 1-33 entries after 1-80 cached positions on
the tiny Qwen3 and Llama targets (float32, one thread), the largest difference between a node's
logits and its path's chain logits was 2.7e-6 (taps 1.2e-6; logits are O(1)); it comes from the
different row counts of the two forwards (other GEMM blockings, ``kernels.skinny_linear`` for
2-8 rows), not from the mask. ``TOL = 1e-5`` is about 4x that; a wrong mask or position id
moves logits by 1e-2 or more (asserted below, so the comparison can fail).

Run as a script (``python tests/test_target_tree.py --ep-check MOE_DIR``) it is the
expert-parallel check that :func:`test_ep2_trees_match_one_rank` starts in its own process
(a process group must not live in pytest's).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5            # module docstring: measured bound 2.7e-6
LAYERS = (0, 2)       # taps compared too


# ---------------------------------------------------------------- helpers
def random_tree(rng: random.Random, m: int, spine: float = 0.5) -> list[int]:
    """Parents of an m-entry block: a spine (parent = previous entry, with probability
    ``spine``) with random branches, so trees are both deep and wide (block index far from
    depth)."""
    return [-1] + [j - 1 if rng.random() < spine else rng.randrange(j) for j in range(1, m)]


def path_to(parents: list[int], j: int) -> list[int]:
    """Block indices root -> j."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def leaves(parents: list[int]) -> list[int]:
    return sorted(set(range(len(parents))) - set(parents))


def depth_of(parents: list[int]) -> int:
    return max(len(path_to(parents, j)) for j in range(len(parents))) - 1


def prefilled(t, tokens: list[int]):
    c = t.new_cache()
    t.forward(tokens, c, None)
    return c


def kv(t, cache, length: int) -> list[torch.Tensor]:
    """Every layer's K and V [H, length, D] of a resident cache."""
    row = cache.row
    return [buf[row, :, :length].clone() for buf in t.pool.k + t.pool.v]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request, tmp_path_factory):
    from dflash_app.testing import make_tiny_target
    from verifier_svc.target import TargetModel

    return TargetModel(make_tiny_target(tmp_path_factory.mktemp(request.param), arch=request.param))


# ---------------------------------------------------------------- tree forward
def test_tree_logits_and_taps_equal_each_path_run_as_a_chain(target):
    """Every node's logits and taps equal those of its root-to-node path run as a chain from
    the same cache (each leaf's path covers its ancestors: chain row m = path node m)."""
    t = target
    assert t.supports_trees
    rng = random.Random(0)
    worst_logits = worst_taps = 0.0
    trees = 0
    for _ in range(24):
        n, m = rng.randint(1, 60), rng.randint(1, 33)
        prefix = [rng.randrange(256) for _ in range(n)]
        block = [rng.randrange(256) for _ in range(m)]
        parents = random_tree(rng, m)
        c = prefilled(t, prefix)
        logits, taps = t.forward(block, c, LAYERS, parents=[parents])
        assert logits.shape[0] == taps.shape[0] == m and c.get_seq_length() == n + m
        for leaf in leaves(parents):
            p = path_to(parents, leaf)
            t.crop(c, n)
            want, want_taps = t.forward([block[k] for k in p], c, LAYERS)
            worst_logits = max(worst_logits, max_diff(logits[p], want))
            worst_taps = max(worst_taps, max_diff(taps[p], want_taps))
        trees += depth_of(parents) < m - 1          # not itself a chain
    assert trees >= 12
    assert worst_logits < TOL and worst_taps < TOL, (worst_logits, worst_taps)


def test_tree_mask_matters_and_a_chain_shaped_tree_is_the_chain(target):
    """The tree forward is not the causal forward of the same block (siblings must not see
    each other: the comparisons above can fail), while a tree that is a chain, and
    ``parents=[None]``, compute exactly the chain forward (same mask, same positions)."""
    t = target
    prefix, block = list(range(30, 50)), [7, 8, 9, 10, 11]
    c = prefilled(t, prefix)
    chain, chain_taps = t.forward(block, c, LAYERS)
    for parents in ([[-1, 0, 1, 2, 3]], [None], None):
        t.crop(c, len(prefix))
        got, got_taps = t.forward(block, c, LAYERS, parents=parents)
        assert torch.equal(got, chain) and torch.equal(got_taps, chain_taps)
    t.crop(c, len(prefix))
    star, _ = t.forward(block, c, LAYERS, parents=[[-1, 0, 0, 0, 0]])
    assert torch.equal(star[:2], chain[:2])        # anchor and first child: the same paths
    assert max_diff(star[2:], chain[2:]) > 1e-2     # siblings saw each other in the chain


# ---------------------------------------------------------------- keep (compaction)
@pytest.mark.parametrize("where", ["resident", "spilled"])
def test_keep_leaves_the_cache_of_the_accepted_path_run_as_a_chain(target, where):
    """After a tree forward, ``keep`` of a root-to-node path: the cache's length and its K/V
    for every position equal those of a cache that ran the path as a chain, and a following
    chain forward gives the same logits. Resident rows compact in place (no reallocation);
    a spilled session compacts its own tensors."""
    t = target
    rng = random.Random(1 if where == "resident" else 2)
    for trial in range(8):
        n, m = rng.randint(5, 60), rng.randint(2, 24)
        prefix = [rng.randrange(256) for _ in range(n)]
        block = [rng.randrange(256) for _ in range(m)]
        parents = random_tree(rng, m)
        offsets = path_to(parents, rng.choice(leaves(parents)))
        offsets = offsets[:rng.randint(1, len(offsets))]          # accepted up to some depth
        c, ref = prefilled(t, prefix), prefilled(t, prefix)
        t.forward(block, c, None, parents=[parents])
        t.forward([block[k] for k in offsets], ref, None)
        buf, grown = t.pool.k[0].data_ptr(), t.pool.grown
        if where == "spilled":
            t.own(c)
        t.keep(c, n, offsets)
        assert c.get_seq_length() == ref.get_seq_length() == n + len(offsets)
        if where == "spilled":
            assert not c.resident
            with torch.inference_mode():     # the pool's buffers are inference tensors
                t.pool.ensure_resident(c)
        else:
            assert t.pool.k[0].data_ptr() == buf and t.pool.grown == grown
        L = n + len(offsets)
        worst = max(max_diff(a, b) for a, b in zip(kv(t, c, L), kv(t, ref, L)))
        assert worst < TOL, (trial, worst)
        nxt = [rng.randrange(256) for _ in range(3)]
        a, _ = t.forward(nxt, c, LAYERS)
        b, _ = t.forward(nxt, ref, LAYERS)
        assert max_diff(a, b) < TOL


def test_keep_of_the_leading_entries_moves_nothing(target):
    """``offsets == 0..n-1`` (the path straight down the block) only sets the length: the
    K/V are bit-for-bit what the forward wrote."""
    t = target
    c = prefilled(t, list(range(40, 60)))
    t.forward([1, 2, 3, 4, 5], c, None, parents=[[-1, 0, 1, 1, 3]])
    before = kv(t, c, 25)
    t.keep(c, 20, [0, 1])
    assert c.get_seq_length() == 22
    assert all(torch.equal(a[:, :22], b[:, :22]) for a, b in zip(kv(t, c, 22), before))


def test_kv_pool_compact_moves_entries_in_place():
    """``KVPool.compact`` on hand-written K/V: entries ``start + offsets[m]`` land at
    ``start + m`` in every layer (overlapping moves included), other rows untouched."""
    from dflash.core.kv_pool import KVPool

    pool = KVPool(2, kv_heads=2, head_dim=3, room=8)
    a, b = pool.new_seq(), pool.new_seq()
    for s in (a, b):
        pool.ensure_resident(s)
    pool.reserve(12)
    for layer in range(2):
        for buf, sign in ((pool.k[layer], 1.0), (pool.v[layer], -1.0)):
            buf.copy_(sign * torch.arange(buf.numel(), dtype=buf.dtype).reshape(buf.shape))
    pool.advance([a, b], [12, 12])
    before = [x.clone() for x in pool.k + pool.v]
    pool.compact(a, 4, [0, 2, 3, 7])
    assert a.get_seq_length() == 8 and b.get_seq_length() == 12
    src = [0, 1, 2, 3, 4, 6, 7, 11]
    for now, old in zip(pool.k + pool.v, before):
        assert torch.equal(now[a.row, :, :8], old[a.row, :, src])
        assert torch.equal(now[b.row], old[b.row])


# ---------------------------------------------------------------- batched
def test_batch_mixing_trees_and_chains_equals_each_row_alone(target):
    """One forward over tree rows and chain rows of different cached lengths and block
    lengths equals each row run alone (its logits and taps, and the K/V it leaves), then a
    keep per tree row leaves each row as its lone run's keep does."""
    t = target
    rng = random.Random(3)
    worst = 0.0
    for b in (2, 3, 5):
        prefixes = [[rng.randrange(256) for _ in range(rng.randint(1, 50))] for _ in range(b)]
        blocks = [[rng.randrange(256) for _ in range(rng.randint(1, 17))] for _ in range(b)]
        parents = [random_tree(rng, len(blk)) if i % 2 == 0 else None
                   for i, blk in enumerate(blocks)]
        batch = [prefilled(t, p) for p in prefixes]
        alone = [prefilled(t, p) for p in prefixes]
        outs = t.forward_batch(blocks, batch, [LAYERS] * b, parents=parents)
        for i in range(b):
            want, want_taps = t.forward(blocks[i], alone[i], LAYERS, parents=[parents[i]])
            worst = max(worst, max_diff(outs[i][0], want), max_diff(outs[i][1], want_taps))
            assert batch[i].get_seq_length() == alone[i].get_seq_length()
        for i in range(b):
            n = len(prefixes[i])
            if parents[i] is not None:
                offsets = path_to(parents[i], leaves(parents[i])[-1])
                t.keep(batch[i], n, offsets)
                t.keep(alone[i], n, offsets)
            L = batch[i].get_seq_length()
            worst = max(worst, max(max_diff(x, y) for x, y in zip(kv(t, batch[i], L),
                                                                  kv(t, alone[i], L))))
    assert worst < TOL, worst


# ---------------------------------------------------------------- sliding window
def _tiny_windowed(path: Path, kind: str, window: int) -> Path:
    """Mistral-style (a window on every layer, no ``layer_types``) or Qwen3 with one sliding
    and one full layer (the "mixed" mask dict)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                  max_position_embeddings=256)
    cfg = MistralConfig(**common) if kind == "mistral" else Qwen3Config(
        **common, head_dim=8, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["mistral", "mixed"])
def test_sliding_window_tree_equals_transformers_on_each_path(tmp_path, kind):
    """A sliding-window target with trees deeper than the window: every node's logits equal
    transformers' own forward of prefix + that node's path (the window counts position ids,
    i.e. depth, not cache slots), batched with a chain row too; without the window the same
    weights give other logits (so the window is exercised)."""
    from transformers import AutoModelForCausalLM

    from verifier_svc.target import TargetModel

    window = 5
    path = _tiny_windowed(tmp_path / kind, kind, window)
    t = TargetModel(path)
    assert t.attention.sliding_window == window
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    no_window = {"sliding_window": None} if kind == "mistral" else \
        {"sliding_window": None, "layer_types": ["full_attention"] * 2}
    unwindowed = AutoModelForCausalLM.from_pretrained(path, **no_window).eval()
    rng = random.Random(4)
    worst, window_effect, deepest = 0.0, 0.0, 0
    for _ in range(6):
        n, m = rng.randint(3, 20), rng.randint(8, 20)
        prefix = [rng.randrange(96) for _ in range(n)]
        block = [rng.randrange(96) for _ in range(m)]
        parents = random_tree(rng, m, spine=0.7)
        chain = [rng.randrange(96) for _ in range(4)]
        c, other = prefilled(t, prefix), prefilled(t, prefix[:-1])
        (logits, _), _ = t.forward_batch([block, chain], [c, other], [(), ()],
                                         parents=[parents, None])
        for j in range(m):
            seq = prefix + [block[k] for k in path_to(parents, j)]
            with torch.no_grad():
                want = hf(torch.tensor([seq])).logits[0, -1]
                full = unwindowed(torch.tensor([seq])).logits[0, -1]
            worst = max(worst, max_diff(logits[j], want))
            window_effect = max(window_effect, max_diff(logits[j], full))
        deepest = max(deepest, depth_of(parents))
    assert deepest >= window          # some paths reach past the window inside the tree
    assert worst < TOL, worst
    assert window_effect > 1e-2


# ---------------------------------------------------------------- bad arguments
def test_bad_parents_and_offsets_raise_value_error_naming_them(target):
    """Malformed ``parents`` / ``offsets`` / ``start`` raise ValueError naming the argument
    before anything runs: the cache keeps its length."""
    t = target
    c = prefilled(t, list(range(10, 20)))
    for parents in ([[-1, 0]],                   # wrong length
                    [[0, 0, 1]],                 # parents[0] != -1
                    [[-1, 1, 1]],                # parents[1] >= 1
                    [[-1, 0, -1]],               # parents[2] < 0
                    [[-1, 0, 2]],                # a self-loop
                    [[-1, 0.5, 0]],              # not ints
                    [-1, 0, 0],                  # the tree itself, not one entry per row
                    [[-1, 0, 1], None]):         # more entries than rows
        with pytest.raises(ValueError, match="parents"):
            t.forward([1, 2, 3], c, None, parents=parents)
        assert c.get_seq_length() == 10
    other = prefilled(t, [5, 6])
    with pytest.raises(ValueError, match="parents"):
        t.forward_batch([[1, 2], [3]], [c, other], [(), ()], parents=[[-1, 0]])
    with pytest.raises(ValueError, match=r"parents\[1\]"):
        t.forward_batch([[1, 2], [3]], [c, other], [(), ()], parents=[None, [-1, 0]])
    assert c.get_seq_length() == 10 and other.get_seq_length() == 2
    t.forward([1, 2, 3, 4], c, None, parents=[[-1, 0, 0, 1]])
    for start, offsets, field in ((10, [], "offsets"), (10, [1, 3], "offsets"),
                                  (10, [0, 3, 2], "offsets"), (10, [0, 1, 1], "offsets"),
                                  (10, [0, 4], "offsets"), (12, [0, 2], "offsets"),
                                  (-1, [0], "start"), (15, [0], "start"), (10, [0, 1.0], "offsets")):
        with pytest.raises(ValueError, match=field):
            t.keep(c, start, offsets)
        assert c.get_seq_length() == 14


# ---------------------------------------------------------------- expert parallel
def test_ep_worker_carries_parents_and_keep_to_its_shard():
    """A worker rank runs rank 0's op records: tree parents reach its shard's forward and
    forward_batch, and ``keep`` is an op like ``crop`` (the real 2-rank run is below)."""
    from verifier_svc.ep_worker import serve

    calls = []

    class Shard:
        def new_cache(self):
            return object()

        def forward(self, tokens, cache, layer_ids, logits_to_keep=0, parents=None):
            calls.append(("forward", tokens, parents))

        def forward_batch(self, blocks, caches, layer_ids, parents=None):
            calls.append(("forward_batch", blocks, parents))

        def keep(self, cache, start, offsets):
            calls.append(("keep", start, offsets))

    ops = iter([{"op": "forward", "cid": 1, "tokens": [1, 2], "layer_ids": None,
                 "parents": [[-1, 0]]},
                {"op": "forward", "cid": 1, "tokens": [3], "layer_ids": None},   # older rank 0
                {"op": "forward_batch", "cids": [1, 2], "blocks": [[1, 2, 3], [4]],
                 "layer_ids": [(), ()], "parents": [[-1, 0, 0], None]},
                {"op": "keep", "cid": 1, "start": 2, "offsets": [0, 2]},
                {"op": "exit"}])
    serve(Shard(), lambda: next(ops))
    assert calls == [("forward", [1, 2], [[-1, 0]]), ("forward", [3], None),
                     ("forward_batch", [[1, 2, 3], [4]], [[-1, 0, 0], None]),
                     ("keep", 2, [0, 2])]


@pytest.mark.slow
def test_ep2_trees_match_one_rank(tmp_path):
    """DistributedTarget (2 ranks, gloo) vs TargetModel on a sparse MoE: a tree forward, a
    batch of a tree and a chain row, ``keep`` and the next forward; bad ``parents`` and
    ``offsets`` raise ValueError on rank 0 without failing the group."""
    from dflash_app.testing import make_tiny_moe_target

    moe = make_tiny_moe_target(tmp_path / "moe")
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--ep-check", str(moe)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # test_ep.py's bound for EP vs one rank (the experts' all-to-all reorders no sums)
    assert res["max_logit_diff"] < 1e-5 and res["max_tap_diff"] < 1e-5, res
    assert res["supports_trees"] and res["bad_args_refused"] == 3 and res["failure"] is None, res
    assert res["worker_exit_codes"] == [0], res


def _ep_check(path: str) -> None:
    """The 2-rank run of :func:`test_ep2_trees_match_one_rank`; prints one JSON line."""
    from verifier_svc.ep import DistributedTarget
    from verifier_svc.target import TargetModel

    torch.set_num_threads(1)
    one = TargetModel(path)
    ep = DistributedTarget(path, ep_size=2, threads=1)
    logit_diff = tap_diff = 0.0
    refused = 0

    def check(a, b):
        nonlocal logit_diff, tap_diff
        logit_diff = max(logit_diff, max_diff(a[0], b[0]))
        if a[1] is not None:
            tap_diff = max(tap_diff, max_diff(a[1], b[1]))

    prefix, block, parents = list(range(20, 50)), [5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 2, 4]
    with ep.lock:
        c1, c2 = one.new_cache(), ep.new_cache()
        one.forward(prefix, c1, None)
        ep.forward(prefix, c2, None)
        check(one.forward(block, c1, (0, 2), parents=[parents]),
              ep.forward(block, c2, (0, 2), parents=[parents]))
        one.keep(c1, len(prefix), [0, 2, 4, 5])
        ep.keep(c2, len(prefix), [0, 2, 4, 5])
        check(one.forward([11, 12], c1, (0, 2)), ep.forward([11, 12], c2, (0, 2)))
        c3, c4 = one.new_cache(), ep.new_cache()
        one.forward([1, 2, 3], c3, None)
        ep.forward([1, 2, 3], c4, None)
        for x, y in zip(one.forward_batch([block, [9, 8]], [c1, c3], [(0, 2), ()], [parents, None]),
                        ep.forward_batch([block, [9, 8]], [c2, c4], [(0, 2), ()], [parents, None])):
            check(x, y)
        for bad in (lambda: ep.forward([1, 2], c2, None, parents=[[0, 0]]),
                    lambda: ep.forward_batch([[1], [2]], [c2, c4], [(), ()], parents=[[-1]]),
                    lambda: ep.keep(c2, c2.get_seq_length() - 2, [0, 2])):
            try:
                bad()
            except ValueError:
                refused += 1
        one.keep(c1, c1.get_seq_length() - len(block), [0, 1])
        ep.keep(c2, c2.get_seq_length() - len(block), [0, 1])
        check(one.forward([4], c1, None), ep.forward([4], c2, None))   # the group still works
    failure = ep.failure
    ep.close()
    print(json.dumps({"max_logit_diff": logit_diff, "max_tap_diff": tap_diff,
                      "supports_trees": bool(ep.supports_trees and one.supports_trees),
                      "bad_args_refused": refused, "failure": failure,
                      "worker_exit_codes": [p.returncode for p in ep.workers]}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ep-check":
        _ep_check(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_target_tree.py --ep-check MOE_TARGET_DIR")
