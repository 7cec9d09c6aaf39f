"""Triton verification kernels against their torch references, run on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``), plus dispatch and the reference sampler's statistics.

The interpreter is chosen when a ``@triton.jit`` function is defined, so the ``tk`` fixture sets
the variable, imports the kernel modules fresh, and on teardown drops them and restores the
environment: no other test module sees interpreted kernels or the variable.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import reference as ref

_KERNEL_MODULES = ("kernels.triton_common", "kernels.triton_greedy", "kernels.triton_rejection",
                   "kernels.triton_pack")
SMALL_SPLIT = {"block_v": 128, "chunk": 256}  # V=1000 -> 4 chunks, the last one partial


@pytest.fixture(scope="module")
def tk():
    """Kernel modules defined under the Triton interpreter."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    saved = {n: sys.modules.pop(n) for n in _KERNEL_MODULES if n in sys.modules}
    try:
        pytest.importorskip("triton")
        yield SimpleNamespace(greedy=importlib.import_module("kernels.triton_greedy"),
                              rejection=importlib.import_module("kernels.triton_rejection"),
                              pack=importlib.import_module("kernels.triton_pack"))
    finally:
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
            if hasattr(kernels, name.split(".")[1]):
                delattr(kernels, name.split(".")[1])
        sys.modules.update(saved)
        mp.undo()


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), f"\n{g}\n!=\n{w}"


# ---------------------------------------------------------------------------------- greedy

def greedy_case(batch: int, k: int, vocab: int, seed: int, dtype=torch.float32):
    """Integer-valued logits (many ties: argmax tie-break matters); drafts follow the posterior
    with one mismatch per sequence at a seeded position (or none), so accepted lengths vary."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 4, (batch, k + 1, vocab), generator=g).to(dtype)
    drafts = logits.argmax(-1)[:, :k].clone()
    for i in range(batch):
        miss = int(torch.randint(0, k + 1, (1,), generator=g))  # miss == k: all accepted
        if miss < k:
            drafts[i, miss] = (drafts[i, miss] + 1) % vocab
    return drafts, logits


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block", [1, 8, 16])
def test_greedy_matches_reference(tk, batch, block):
    drafts, logits = greedy_case(batch, block - 1, 1000, seed=block * 10 + batch)
    assert_same(tk.greedy.greedy_accept(drafts, logits, **SMALL_SPLIT),
                ref.greedy_accept(drafts, logits))


def test_greedy_edge_rows_strides_and_bf16(tk):
    drafts, logits = greedy_case(3, 7, 1000, seed=7, dtype=torch.bfloat16)
    logits[0, 0] = float("-inf")       # all -inf row: torch.argmax gives 0 ...
    drafts[0, 0] = 0                   # ... which the draft matches
    logits[1, 2, 999] = float("inf")   # +inf in the last, partial chunk
    logits[2] = 1.0                    # every row one tie across all chunks: argmax 0
    drafts[2] = 0
    want = ref.greedy_accept(drafts, logits)
    assert int(want[0][0]) >= 1 and want[1][2].tolist() == [0] * 8
    padded = torch.cat([torch.zeros(3, 2, 1000, dtype=logits.dtype), logits], 1)[:, 2:]
    assert not padded.is_contiguous()  # rows strided, vocab contiguous
    assert_same(tk.greedy.greedy_accept(drafts, padded, **SMALL_SPLIT), want)
    assert_same(tk.greedy.greedy_accept(drafts, logits, block_v=1024, chunk=1024), want)


def test_greedy_large_vocab(tk):
    drafts, logits = greedy_case(2, 3, 50257, seed=3)
    assert_same(tk.greedy.greedy_accept(drafts, logits), ref.greedy_accept(drafts, logits))


# ------------------------------------------------------------------------------- rejection

def rejection_case(batch: int, k: int, vocab: int, seed: int):
    """Softmax q and p with a few exact zeros (top-k style), drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)

    def probs(rows: int) -> torch.Tensor:
        logits = torch.randn(batch, rows, vocab, generator=g) * 3
        logits[torch.rand(batch, rows, vocab, generator=g) < 0.1] = float("-inf")
        logits[..., 0] = 0.0  # keep every row non-empty
        return torch.softmax(logits, dim=-1)

    q, p = probs(k), probs(k + 1)
    drafts = (torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
              if k else torch.zeros(batch, 0, dtype=torch.int64))
    uniforms = torch.rand(batch, k, generator=g)
    exp_noise = torch.empty(batch, k + 1, vocab).exponential_(generator=g)
    return drafts, q, p, uniforms, exp_noise


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block", [1, 8, 16])
def test_rejection_matches_reference(tk, batch, block):
    args = rejection_case(batch, block - 1, 1000, seed=block * 10 + batch)
    assert_same(tk.rejection.rejection_sample(*args, **SMALL_SPLIT), ref.rejection_sample(*args))


def test_rejection_covers_every_branch(tk):
    """Rejection at 0 and mid-block, the bonus row, the all-zero-residual fallback, exact
    ``u * q == p`` boundaries and ties in the exponential race, all bit-equal to the reference."""
    drafts, q, p, u, e = rejection_case(5, 7, 1000, seed=11)
    u[0, 0] = 0.999999                      # q(d) >> p(d) for row 0 below: rejected at 0
    p[0, 0, drafts[0, 0]] = 0.0
    u[1] = 0.0                              # u = 0 accepts every draft: bonus row
    p[2, :7] = 0.5 * q[2]                   # residual all zero (unnormalised p): fallback to p
    u[2] = 0.9                              # 0.9 * q(d) > 0.5 * q(d): rejected at 0
    p[3, :7] = q[3]                         # p == q: u * q(d) <= p(d) always, bonus row
    e[3, 7] = 1.0
    p[3, 7] = torch.arange(1000) % 5 / 4.0  # ties in p / E: first index wins
    u[4, :3] = 1.0                          # u * q(d) == p(d) exactly at 0..2: accepted
    p[4, torch.arange(3), drafts[4, :3]] = q[4, torch.arange(3), drafts[4, :3]]
    u[4, 3] = 1.0
    p[4, 3, drafts[4, 3]] = q[4, 3, drafts[4, 3]] * 0.5  # rejected at 3
    e[4, 3] = 1.0
    want = ref.rejection_sample(drafts, q, p, u, e)
    assert want[0].tolist() == [0, 7, 0, 7, 3]
    assert_same(tk.rejection.rejection_sample(drafts, q, p, u, e, **SMALL_SPLIT), want)
    strided = torch.cat([torch.zeros(5, 1, 1000), p], 1)[:, 1:]
    assert_same(tk.rejection.rejection_sample(drafts, q, strided, u, e, **SMALL_SPLIT), want)


def test_rejection_large_vocab(tk):
    args = rejection_case(2, 3, 50257, seed=5)
    assert_same(tk.rejection.rejection_sample(*args), ref.rejection_sample(*args))


# --------------------------------------------------------------------------------- packing

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("lengths", [[5], [3, 0, 9, 1]])
@pytest.mark.parametrize("columns", [slice(None), slice(5, 42)], ids=["aligned", "window"])
def test_pack_matches_reference_and_round_trips(tk, dtype, lengths, columns):
    g = torch.Generator().manual_seed(len(lengths))
    hidden = (torch.randn(len(lengths), 12, 48, generator=g) * 100).to(dtype)  # [b, T, taps*C]
    # Committed rows of each sequence (all columns: 16-byte aligned rows; a window: unaligned).
    features = [hidden[i, :n, columns] for i, n in enumerate(lengths)]
    buffer, offsets = tk.pack.pack_features(features, block_r=2, block_c=16)
    assert_same((buffer, offsets), ref.pack_features(features))
    assert offsets.device.type == "cpu"
    for got, want in zip(ref.unpack_features(buffer, offsets), features):
        assert torch.equal(got, want)


def test_pack_edge_cases(tk):
    assert_same(tk.pack.pack_features([torch.zeros(0, 4), torch.zeros(0, 4)]),
                ref.pack_features([torch.zeros(0, 4), torch.zeros(0, 4)]))
    transposed = [torch.arange(12.0).reshape(4, 3).t()]  # column-strided: copied contiguous first
    assert_same(tk.pack.pack_features(transposed), ref.pack_features(transposed))
    assert not tk.pack.supports([])
    assert not tk.pack.supports([torch.zeros(2, 3), torch.zeros(2, 4)])
    assert not tk.pack.supports([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)])
    assert not tk.pack.supports([torch.zeros(2, 3, dtype=torch.bool)])


# -------------------------------------------------------------------------------- dispatch

def test_cpu_dispatch_is_the_reference():
    drafts, logits = greedy_case(2, 3, 64, seed=1)
    assert_same(kernels.greedy_accept(drafts, logits), ref.greedy_accept(drafts, logits))
    args = rejection_case(2, 3, 64, seed=1)
    assert_same(kernels.rejection_sample(*args), ref.rejection_sample(*args))
    features = [torch.randn(2, 4), torch.randn(3, 4)]
    buffer, offsets = kernels.pack_features(features)
    assert_same((buffer, offsets), ref.pack_features(features))
    views = kernels.unpack_features(buffer, offsets)
    assert views[1].data_ptr() == buffer[2:].data_ptr()  # views, not copies


def test_cuda_dispatch_routes_to_kernels(monkeypatch):
    """With CUDA tensors (faked) each op calls its kernel, unless the kernel declines."""
    calls = []

    def fake(name, supported=True):
        return SimpleNamespace(supports=lambda *a: supported,
                               **{name: lambda *a: calls.append(name) or "kernel"})

    monkeypatch.setattr(kernels, "_on_cuda", lambda *tensors: True)
    ops = SimpleNamespace(greedy=fake("greedy_accept"), rejection=fake("rejection_sample"),
                          pack=fake("pack_features"))
    monkeypatch.setattr(kernels, "triton_kernels", lambda: ops)
    assert kernels.greedy_accept(*greedy_case(1, 2, 8, seed=0)) == "kernel"
    assert kernels.rejection_sample(*rejection_case(1, 2, 8, seed=0)) == "kernel"
    assert kernels.pack_features([torch.zeros(1, 2)]) == "kernel"
    assert calls == ["greedy_accept", "rejection_sample", "pack_features"]
    ops.rejection.supports = lambda *a: False  # e.g. bf16 probabilities: the reference runs
    args = rejection_case(1, 2, 8, seed=0)
    assert_same(kernels.rejection_sample(*args), ref.rejection_sample(*args))
    monkeypatch.setattr(kernels, "triton_kernels", lambda: None)  # triton missing
    assert_same(kernels.greedy_accept(*greedy_case(1, 2, 8, seed=0)),
                ref.greedy_accept(*greedy_case(1, 2, 8, seed=0)))


def test_kernels_decline_inputs_they_cannot_match(tk):
    args = list(rejection_case(1, 2, 8, seed=0))
    assert tk.rejection.supports(*args)
    args[2] = args[2].to(torch.bfloat16)  # torch rounds bf16 arithmetic differently
    assert not tk.rejection.supports(*args)
    drafts, logits = greedy_case(1, 2, 8, seed=0)
    assert all(tk.greedy.supports(drafts, logits.to(t))
               for t in (torch.float32, torch.float16, torch.bfloat16))
    assert not tk.greedy.supports(drafts, logits.double())  # fp32 partials could make ties


# ------------------------------------------------------------ reference sampler statistics

def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    kept = probs[keep].double()
    expected = kept / kept.sum() * counts.sum()
    return float(chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


def test_reference_rejection_sampler_is_distribution_preserving():
    """Drafts ~ q; every emitted token at position j (accepted draft, recovered or bonus) must
    follow p_j, and the accepted length must follow P(accepted = j) = prod_{i<j} a_i (1 - a_j),
    a_i = sum min(p_i, q_i). The positive control shows 200k samples catch a 2% bias (total
    variation 0.02) at the same threshold."""
    pytest.importorskip("scipy")
    n, k, vocab, alpha = 200_000, 3, 8, 1e-3
    g = torch.Generator().manual_seed(1234)
    p_rows = torch.softmax(torch.randn(k + 1, vocab, generator=g), dim=-1)
    q_rows = torch.softmax(torch.randn(k, vocab, generator=g), dim=-1)
    q_rows[1, 2] = 0.0  # a token the drafter never proposes but the target may emit
    q_rows[1] /= q_rows[1].sum()
    drafts = torch.stack([torch.multinomial(q_rows[i], n, replacement=True, generator=g)
                          for i in range(k)], dim=1)                            # [n, K]
    accepted, output = ref.rejection_sample(
        drafts, q_rows.expand(n, -1, -1), p_rows.expand(n, -1, -1), torch.rand(n, k, generator=g),
        torch.empty(n, k + 1, vocab).exponential_(generator=g))

    for j in range(k + 1):
        emitted = output[accepted >= j, j]
        assert _chi2_pvalue(emitted, p_rows[j]) > alpha, f"position {j} does not follow p"

    alphas = torch.minimum(p_rows[:k], q_rows).sum(-1).double()
    reach = torch.cat([torch.ones(1, dtype=torch.float64), alphas.cumprod(0)])  # P(acc >= j)
    law = torch.cat([reach[:k] * (1 - alphas), reach[k:]])                      # P(acc == j)
    assert _chi2_pvalue(accepted, law) > alpha

    biased = p_rows[0].clone()
    hi, lo = int(biased.argmax()), int(biased.argmin())
    biased[hi] -= 0.02
    biased[lo] += 0.02
    assert _chi2_pvalue(output[:, 0], biased) < alpha, "the test could not see a 2% bias"
