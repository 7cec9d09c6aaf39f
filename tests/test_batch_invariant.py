"""Batch-invariant mode (``kernels.invariant``, ``--batch-invariant``): a row's result does not
depend on the rows that share its forward.

Kernel level: each kernel's rows equal the same rows computed one at a time, bit for bit. Target
level: a verify forward of k rows gives the logits of k one-token decodes at the same positions,
bit for bit, in float32 and bfloat16, for chains and trees, alone and in a batch of sessions of
different lengths. Both paths are checked: the AVX-512 kernels (built on every CPU kind CI runs
on) and the row-at-a-time references every other device takes (forced here by hiding the
kernels). End to end through the services: ``tests/test_bf16_cpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels import invariant as inv

DTYPES = [torch.float32, torch.bfloat16]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 8, 9, 10, 12, 14]   # a 16-node tree, two branches deep


@pytest.fixture(params=["kernels", "reference"])
def path(request, monkeypatch):
    """Each test once on the AVX-512 kernels and once on the references."""
    if request.param == "kernels":
        if not inv.kernels_available():
            pytest.skip("no AVX-512 or no compiler: the kernels do not build here")
    else:
        monkeypatch.setattr(inv, "kernels_available", lambda: False)
    return request.param


def _path(node: int) -> list[int]:
    """The root-to-``node`` path of :data:`PARENTS`, in path order."""
    nodes = []
    while node != -1:
        nodes.append(node)
        node = PARENTS[node]
    return nodes[::-1]


def _masked(b: int, q: int, length: int, lens: list[int]) -> torch.Tensor:
    """bool [b, 1, q, length]: row r's query i sees positions 0..lens[r] + i (a chain)."""
    mask = torch.zeros(b, 1, q, length, dtype=torch.bool)
    for r in range(b):
        for i in range(q):
            mask[r, 0, i, :lens[r] + i + 1] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_call(path, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g).to(dtype)
    bias = torch.randn(70, generator=g).to(dtype)
    x = torch.randn(2, 9, 96, generator=g).to(dtype)
    together = inv.linear(x, w, bias)
    alone = torch.stack([torch.cat([inv.linear(x[i, j:j + 1], w, bias) for j in range(9)])
                         for i in range(2)])
    assert together.shape == (2, 9, 70) and together.dtype == dtype
    assert torch.equal(together, alone)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 0.3      # bf16: one rounding of values up to ~40
    assert (together.float() - want).abs().max() < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_queries_do_not_depend_on_the_call(path, dtype):
    """A block of 8 queries per row, two rows of different lengths, grouped heads: each query
    equals a one-query call over exactly the keys it sees (a decode's shape, no mask)."""
    g = torch.Generator().manual_seed(1)
    b, h, kvh, d, length, q = 2, 6, 2, 24, 40, 8
    k = torch.randn(b, kvh, length, d, generator=g).to(dtype)
    v = torch.randn(b, kvh, length, d, generator=g).to(dtype)
    query = torch.randn(b, h, q, d, generator=g).to(dtype)
    lens = [20, 31]
    mask = _masked(b, q, length, lens)
    out = inv.attention(query, k, v, mask, d ** -0.5)
    assert out.shape == (b, q, h, d) and out.dtype == dtype
    for r in range(b):
        for i in range(q):
            n = lens[r] + i + 1
            one = inv.attention(query[r:r + 1, :, i:i + 1], k[r:r + 1, :, :n], v[r:r + 1, :, :n],
                                None, d ** -0.5)
            assert torch.equal(one[0, 0], out[r, i]), (r, i)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert (out.float() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_attention_of_a_tree_node_is_the_decode_along_its_path(path):
    """A tree node sees the context and its ancestors: the same keys, in the same order, as a
    decode along its root-to-node path after the path's K/V were compacted."""
    g = torch.Generator().manual_seed(2)
    h, d, ctx, m = 4, 16, 12, len(PARENTS)
    k = torch.randn(1, 2, ctx + m, d, generator=g)
    v = torch.randn(1, 2, ctx + m, d, generator=g)
    query = torch.randn(1, h, m, d, generator=g)
    mask = torch.zeros(1, 1, m, ctx + m, dtype=torch.bool)
    mask[..., :ctx] = True
    for j in range(m):
        mask[0, 0, j, [ctx + a for a in _path(j)]] = True
    out = inv.attention(query, k, v, mask, 0.25)
    for j in (3, 9, 15):
        keep = list(range(ctx)) + [ctx + a for a in _path(j)]
        one = inv.attention(query[:, :, j:j + 1], k[:, :, keep], v[:, :, keep], None, 0.25)
        assert torch.equal(one[0, 0], out[0, j])


def test_a_query_that_sees_nothing_gets_zeros_and_bad_masks_are_refused(path):
    q = torch.randn(1, 2, 2, 8)
    k = v = torch.randn(1, 1, 5, 8)
    mask = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    mask[0, 0, 1, :3] = True
    out = inv.attention(q, k, v, mask, 1.0)
    assert torch.equal(out[0, 0], torch.zeros(2, 8)) and out[0, 1].abs().sum() > 0
    with pytest.raises(ValueError, match="mask: bool"):
        inv.attention(q, k, v, mask.float(), 1.0)
    with pytest.raises(ValueError, match="heads"):
        inv.attention(torch.randn(1, 3, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                      None, 1.0)


def test_resolve_reads_the_flag():
    assert inv.resolve("on", "cpu") and not inv.resolve("off", "cpu")
    # auto: off until a kernel costs <= 10% at every shape (docs/batch-invariance.md)
    assert not inv.resolve("auto", "cpu", torch.float32) and not inv.resolve("auto", "cuda", "bfloat16")
    assert inv.resolve("on", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="batch_invariant"):
        inv.resolve("yes", "cpu")


# ---------------------------------------------------------------- the target


@pytest.fixture(scope="module")
def invariant_targets(tiny_target):
    from verifier_svc.target import TargetModel

    return {dt: TargetModel(tiny_target, dtype=dt, batch_invariant=True)
            for dt in ("float32", "bfloat16")}


def _prefilled(model, prompt):
    cache = model.new_cache()
    model.forward(prompt, cache, None, logits_to_keep=1)
    return cache


def _decodes(model, prompt, tokens):
    """float32 [len(tokens), V]: one-token decode steps of ``tokens`` after ``prompt``."""
    cache = _prefilled(model, prompt)
    return torch.stack([model.forward([t], cache, None)[0][-1] for t in tokens])


def _ids(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (n,), generator=g).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_of_16_is_16_decodes_bit_for_bit(path, invariant_targets, dtype):
    model = invariant_targets[dtype]
    prompt, block = _ids(model, 37, 3), _ids(model, 16, 4)
    logits, _ = model.forward(block, _prefilled(model, prompt), None)
    assert torch.equal(logits, _decodes(model, prompt, block))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_verify_is_the_decode_along_each_path(path, invariant_targets, dtype):
    model = invariant_targets[dtype]
    prompt, block = _ids(model, 29, 5), _ids(model, len(PARENTS), 6)
    logits, _ = model.forward(block, _prefilled(model, prompt), None, parents=[PARENTS])
    for leaf in (7, 13, 15):
        nodes = _path(leaf)
        assert torch.equal(logits[nodes], _decodes(model, prompt, [block[j] for j in nodes]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batched_step_is_each_session_alone(path, invariant_targets, dtype):
    """Four sessions of different context lengths, chains and a tree of different block sizes
    in one forward: each session's rows are its own decodes."""
    model = invariant_targets[dtype]
    prompts = [_ids(model, n, 10 + n) for n in (9, 30, 17, 44)]
    blocks = [_ids(model, 16, 1), _ids(model, 5, 2), _ids(model, len(PARENTS), 3), [7]]
    parents = [None, None, PARENTS, None]
    out = model.forward_batch(blocks, [_prefilled(model, p) for p in prompts],
                              [()] * 4, parents=parents)
    for i in (0, 1, 3):
        assert torch.equal(out[i][0], _decodes(model, prompts[i], blocks[i])), i
    path7 = _path(7)
    assert torch.equal(out[2][0][path7], _decodes(model, prompts[2], [blocks[2][j] for j in path7]))


def test_the_default_kernels_are_not_invariant_and_the_mode_is_recorded(tiny_target,
                                                                        invariant_targets):
    """What the mode removes is there without it (else the tests above prove nothing about
    it): the default bf16 verify rounds differently from decodes somewhere along a block."""
    from verifier_svc.target import TargetModel

    default = TargetModel(tiny_target, dtype="bfloat16")
    assert not default.batch_invariant and invariant_targets["bfloat16"].batch_invariant
    prompt = _ids(default, 37, 3)
    differs = False
    for seed in range(8):
        block = _ids(default, 16, 40 + seed)
        logits, _ = default.forward(block, _prefilled(default, prompt), None)
        differs |= not torch.equal(logits, _decodes(default, prompt, block))
    assert differs


def test_the_mode_refuses_cuda_graphs(tiny_target):
    from dflash.core.device import DeviceError
    from verifier_svc.target import TargetModel

    with pytest.raises(DeviceError, match="--cuda-graphs"):
        TargetModel(tiny_target, cuda_graphs=True, batch_invariant=True)


# ---------------------------------------------------------------- the drafter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_drafter_block_does_not_depend_on_its_batch(path, make_drafter, tiny_target, dtype):
    """A session's drafts and their log-probabilities alone equal the same session's in a batch
    with a session of another context length and block size."""
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target, dtype=dtype,
                                           batch_invariant=True, context_threads=0)
    try:
        width = engine.cfg.context_size
        g = torch.Generator().manual_seed(7)
        ctx = {"a": torch.randn(23, width, generator=g), "b": torch.randn(9, width, generator=g)}

        def req(sid, block):
            return ProposalRequest(session_id=sid, context_start=0, context=ctx[sid],
                                   anchor_token=5, block_size=block, sampling=Sampling(),
                                   top_k=6)

        alone = engine.propose([req("a", 8)])[0]
        engine.release(["a"])
        both = engine.propose([req("b", 4), req("a", 8)])
        assert torch.equal(alone.top_logprobs, both[1].top_logprobs)
        assert torch.equal(alone.tokens, both[1].tokens)
    finally:
        engine.close()
