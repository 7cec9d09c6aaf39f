"""The verifier's verification runs through the dispatching kernel entry points (``kernels``),
so on CUDA tensors the Triton kernels are on the step path.

No GPU here: ``kernels._on_cuda`` is made to say yes and the Triton ops are stand-ins that record
their calls and compute with the torch references (the kernels' own exactness against those
references is tests/test_kernels.py's). The decode must call them for every speculative step,
greedy and sampled, and give the same tokens as the plain reference path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kernels
from dflash.core.sampling import Sampling
from drafter_svc.engine import DrafterEngine
from kernels import reference
from verifier_svc.engine import Request, VerifierEngine


def _decode(engine, drafter, sampling):
    req = Request(request_id="r", prompt=list(range(30, 45)), max_tokens=20, ignore_eos=True,
                  proposer=drafter, sampling=sampling, spec_mode="fixed")
    out, steps = [], []
    for ev in engine.generate(req):
        out += ev.tokens
        if ev.step >= 0:
            steps.append(ev.drafted)
    return out, steps


# greedy and seeded rows accept through greedy_accept (a seeded row on the scores p / noise),
# unseeded sampled rows through rejection_sample
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, seed=11),
                                      Sampling(temperature=0.8)])
def test_cuda_tensors_take_the_triton_ops_in_the_decode(monkeypatch, target_model, make_drafter,
                                                        tiny_target, sampling):
    drafter = DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target,
                                            context_threads=0)
    engine = VerifierEngine(target_model, spec_mode="fixed")
    try:
        want, steps = _decode(engine, drafter, sampling)
        assert any(steps)
        calls = []

        def op(name, fn):
            def run(*args):
                calls.append((name, tuple(args[0].shape)))
                return fn(*args)
            return SimpleNamespace(supports=lambda *a: True, **{name: run})

        monkeypatch.setattr(kernels, "_on_cuda", lambda *tensors: True)
        monkeypatch.setattr(kernels, "triton_kernels", lambda: SimpleNamespace(
            greedy=op("greedy_accept", reference.greedy_accept),
            rejection=op("rejection_sample", reference.rejection_sample),
            pack=op("pack_features", reference.pack_features)))
        got, steps = _decode(engine, drafter, sampling)
    finally:
        engine.close()
        drafter.close()
    if sampling.seed is not None or sampling.greedy:
        assert got == want                      # unseeded: each run draws its own sample
    name = "rejection_sample" if not sampling.greedy and sampling.seed is None else "greedy_accept"
    # one call per decode step: the row's drafts [1, k]
    assert [shape for n, shape in calls if n == name] == [(1, k) for k in steps], calls
