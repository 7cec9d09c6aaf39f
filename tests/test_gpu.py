"""On a CUDA device (``pytest -m gpu``; scripts/gpu_check.sh runs them): every service piece on
the GPU, lossless, through the real code. Skipped where torch sees no GPU (CI, the dev machines).

The models are the tiny ones of the other tests, moved to ``cuda`` in bfloat16 (the GPU
default); correctness is compared on the GPU itself (bf16 against bf16), never against the CPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_target(tiny_target):
    from verifier_svc.target import TargetModel

    return TargetModel(tiny_target, device="cuda", dtype="bfloat16")


@pytest.fixture(scope="module")
def cuda_drafter(tiny_target, make_drafter):
    from drafter_svc.engine import DrafterEngine

    d = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target, device="cuda",
                                      dtype="bfloat16", context_threads=0)
    yield d
    d.close()


def _decode(engine, proposer, sampling=None, mode="fixed", n=32, prompt=None):
    from dflash.core.sampling import Sampling
    from verifier_svc.engine import Request

    req = Request(request_id="g", prompt=prompt or list(range(40, 60)), max_tokens=n,
                  ignore_eos=True, proposer=proposer, sampling=sampling or Sampling(),
                  spec_mode=mode if proposer is not None else "off")
    toks, drafted, accepted = [], 0, 0
    for ev in engine.generate(req):
        toks += ev.tokens
        drafted += ev.drafted
        accepted += ev.accepted
    return toks, drafted, accepted


def test_everything_lives_on_the_gpu(cuda_target, cuda_drafter):
    assert cuda_target.device.type == "cuda" and cuda_target.dtype == torch.bfloat16
    assert next(cuda_target.model.parameters()).is_cuda
    assert cuda_drafter.device.type == "cuda" and cuda_drafter.head.embed.is_cuda
    cache = cuda_target.new_cache()
    logits, taps = cuda_target.forward(list(range(5, 20)), cache, (1,))
    assert logits.is_cuda and taps.is_cuda and cuda_target.pool.k[0].is_cuda


@pytest.mark.parametrize("mode", ["fixed", "tree"])
def test_greedy_speculation_equals_decoding_on_the_gpu(cuda_target, cuda_drafter, mode):
    from verifier_svc.engine import VerifierEngine

    engine = VerifierEngine(cuda_target, spec_mode=mode)
    try:
        off, _, _ = _decode(engine, None)
        on, drafted, _ = _decode(engine, cuda_drafter, mode=mode)
    finally:
        engine.close()
    assert drafted > 0 and on == off


def test_oracle_accepts_every_draft_on_the_gpu(cuda_target):
    from dflash.core.sampling import Sampling
    from verifier_svc.engine import Request, VerifierEngine

    from doubles import ReferenceDrafter

    engine = VerifierEngine(cuda_target, spec_mode="fixed")
    prompt = list(range(70, 90))
    try:
        off, _, _ = _decode(engine, None, n=1 + 3 * 8, prompt=prompt)
        oracle = ReferenceDrafter(cuda_target, {"g": prompt + off}, block_size=8)
        req = Request(request_id="g", session_id="g", prompt=prompt, max_tokens=1 + 3 * 8,
                      ignore_eos=True, proposer=oracle, sampling=Sampling(), spec_mode="fixed")
        evs = list(engine.generate(req))
    finally:
        engine.close()
    assert [t for ev in evs for t in ev.tokens] == off
    assert sum(ev.accepted for ev in evs) == 3 * 7      # tau = block size


def test_seeded_sampling_is_reproducible_on_the_gpu(cuda_target, cuda_drafter):
    from dflash.core.sampling import Sampling
    from verifier_svc.engine import VerifierEngine

    engine = VerifierEngine(cuda_target, spec_mode="fixed")
    s = Sampling(temperature=0.8, seed=5)
    try:
        a = _decode(engine, cuda_drafter, s)[0]
        b = _decode(engine, cuda_drafter, s)[0]
    finally:
        engine.close()
    assert a == b and len(a) == 32


def test_cuda_graphs_give_the_eager_tokens(tiny_target, cuda_drafter):
    """``--cuda-graphs``: decode and verify forwards replayed from graphs, same greedy output
    (the evidence docs/gpu.md asks for before the flag could default on)."""
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.target import TargetModel

    eager = TargetModel(tiny_target, device="cuda", dtype="bfloat16")
    graphed = TargetModel(tiny_target, device="cuda", dtype="bfloat16", cuda_graphs=True)
    out = {}
    for name, t in (("eager", eager), ("graphs", graphed)):
        engine = VerifierEngine(t, spec_mode="fixed")
        try:
            out[name] = (_decode(engine, None, n=24), _decode(engine, cuda_drafter, n=24))
        finally:
            engine.close()
    assert out["graphs"] == out["eager"]
    assert graphed.graphs.captured > 0 and graphed.graphs.replayed > graphed.graphs.captured


def test_triton_kernels_are_bit_exact_on_cuda():
    import kernels
    from kernels import reference

    g = torch.Generator(device="cuda").manual_seed(0)
    for b, k, v in ((1, 15, 151936), (32, 15, 151936), (8, 7, 1000)):
        logits = torch.randn(b, k + 1, v, device="cuda", generator=g).bfloat16()
        drafts = logits.argmax(-1)[:, :k].contiguous()
        drafts[:, k // 2:] = 0
        for got, want in zip(kernels.greedy_accept(drafts, logits),
                             reference.greedy_accept(drafts, logits)):
            assert torch.equal(got, want)
        q = torch.softmax(torch.randn(b, k, v, device="cuda", generator=g), -1)
        p = torch.softmax(torch.randn(b, k + 1, v, device="cuda", generator=g), -1)
        d = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, k)
        u = torch.rand(b, k, device="cuda", generator=g)
        e = torch.empty(b, k + 1, v, device="cuda").exponential_(generator=g)
        for got, want in zip(kernels.rejection_sample(d, q, p, u, e),
                             reference.rejection_sample(d, q, p, u, e)):
            assert torch.equal(got, want)
    assert kernels.triton_kernels() is not None, "triton did not import: the references ran"


def test_taps_reach_the_wire_through_pinned_host_memory(cuda_target):
    from dflash.core import wire
    from verifier_svc.tap_buffer import TapRows

    _, taps = cuda_target.forward(list(range(3, 40)), cuda_target.new_cache(), (0, 2))
    rows = TapRows()
    rows.append(taps[:20])
    rows.append(taps[20:])
    host = rows.rows(0)
    assert host.device.type == "cpu" and host.is_pinned() and host.dtype == torch.bfloat16
    assert torch.equal(host, taps.cpu())
    msg = wire.to_proto(taps)                          # a CUDA tensor straight to the wire
    assert msg.dtype == "bfloat16" and torch.equal(wire.from_proto(msg), taps.cpu())


def test_drafter_proposals_come_back_on_the_host(cuda_drafter):
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling

    ctx = torch.randn(12, cuda_drafter.cfg.context_size).bfloat16()
    reqs = [ProposalRequest(session_id=f"s{i}", context_start=0, context=ctx, anchor_token=3,
                            block_size=8, sampling=s, top_k=4)
            for i, s in enumerate([Sampling(), Sampling(temperature=0.7, seed=1)])]
    out = cuda_drafter.propose(reqs)
    cuda_drafter.release([r.session_id for r in reqs])
    for p in out:
        assert p.tokens.device.type == "cpu" and p.tokens.shape == (7,)
        assert p.top_ids.device.type == "cpu" and p.top_ids.shape == (7, 4)
    assert out[1].probs is not None and out[1].probs.device.type == "cpu"
