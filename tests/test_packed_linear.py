"""kernels.packed_linear: oneDNN products on prepacked weights equal F.linear (rounding), follow
a weight changed in place, stay out of autograd, are chosen by measurement, and are what the
target and drafter run when asked."""

import time

import pytest
import torch
import torch.nn.functional as F

from kernels import packed_linear as pl, skinny_linear as sk

pytestmark = pytest.mark.skipif(not pl.available(torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("shape", [(1, 64), (4, 64), (1, 5, 64), (3, 6, 64), (17, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    out = pl.packed_linear(x, w, b)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape == (*shape[:-1], 48)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hasattr(w, "_dflash_packed")          # it did take the packed path


@pytest.mark.skipif(not pl.available(torch.bfloat16), reason="no bf16 oneDNN kernels on this CPU")
def test_bfloat16_matches_f_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 576, generator=g).bfloat16()
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    out = pl.packed_linear(x, w)
    assert out.dtype == torch.bfloat16 and hasattr(w, "_dflash_packed")
    # bf16 results round at 2^-8 relative; the two accumulate in float32 in different orders
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_a_weight_changed_in_place_is_packed_again():
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    pl.packed_linear(x, w)
    first = w._dflash_packed[1]
    with torch.no_grad():
        w.mul_(-2.0)                              # a reload into the same storage
    torch.testing.assert_close(pl.packed_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert w._dflash_packed[1] is not first
    pl.packed_linear(x, w)
    assert w._dflash_packed[1] is w._dflash_packed[1]


def test_a_parameter_given_new_data_is_packed_again():
    """A reload that swaps a parameter's tensor (``param.data = ...``) changes its storage."""
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        pl.packed_linear(x, lin.weight)
        lin.weight.data = torch.randn(16, 8)
        torch.testing.assert_close(pl.packed_linear(x, lin.weight), F.linear(x, lin.weight),
                                   rtol=1e-5, atol=1e-5)


def test_autograd_and_other_devices_keep_f_linear():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    assert not pl.applies(x, lin.weight)
    pl.packed_linear(x, lin.weight, lin.bias).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        assert pl.applies(x, lin.weight)
    assert not pl.applies(torch.randn(2, 8).double(), lin.weight.double())
    assert not pl.applies(torch.randn(2, 8), lin.weight.detach().bfloat16())   # dtypes differ


def test_skinny_layers_take_it_from_their_threshold(monkeypatch):
    seen = []
    real = pl.try_packed_linear
    monkeypatch.setattr(sk, "try_packed_linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    w = torch.randn(8, 4)
    with torch.no_grad():
        for threshold in (0, 1, 2):
            for rows in (1, 2, 16):
                sk.skinny_linear(torch.randn(rows, 4), w, max_rows=16, packed=threshold)
            seen.append("|")
    assert seen == ["|", 1, 2, 16, "|", 2, 16, "|"]


def _packed_probe(model, slow):
    """A probe whose cost the test sets: ``slow(n, packed_on)`` -> seconds to sleep."""
    calls = []

    def probe(n):
        on = model[0].skinny_packed not in (0,) and n >= model[0].skinny_packed
        calls.append((n, on))
        time.sleep(slow(n, on))   # the behaviour: a product that costs what the test says

    return probe, calls


@pytest.mark.parametrize("multi_wins,one_wins,expected", [
    (True, True, 1), (True, False, 2), (False, True, 0), (False, False, 0)])
def test_tune_packed_keeps_the_faster(multi_wins, one_wins, expected):
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    sk.use_skinny_linear(m, 0, always=True)
    head = type("Head", (), {"skinny_packed": 0})()

    def slow(n, on):
        wins = one_wins if n == 1 else multi_wins
        return 0.002 if on == wins else 0.012

    probe, calls = _packed_probe(m, slow)
    threshold, timings = sk.tune_packed(m, probe, rows=(1, 4, 16), reps=3, also=[head])
    assert threshold == expected
    assert m[0].skinny_packed == head.skinny_packed == expected      # left at the result
    assert sorted(timings) == [1, 4, 16]
    assert {(n, on) for n, on in calls} == {(n, on) for n in (1, 4, 16) for on in (True, False)}
    assert ("off" in sk.packed_summary(threshold, timings)) is (expected == 0)


def test_use_skinny_linear_always_switches_for_the_packed_product():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    assert sk.use_skinny_linear(m, 0) == 0 and type(m[0]) is torch.nn.Linear
    assert sk.use_skinny_linear(m, 0, always=True) == 1
    assert type(m[0]) is sk.SkinnyLinear and m[0].skinny_max_rows == 0


def test_target_with_packed_products_decodes_as_without(tiny_target):
    """The real target: every linear layer and the LM head packed; logits of a prefill, a
    decode and a verify block equal the unpacked target's within float32 rounding, and greedy
    generation is token-identical."""
    from verifier_svc.target import TargetModel

    on = TargetModel(tiny_target, packed_linear="on")
    off = TargetModel(tiny_target, packed_linear="off", skinny_max_rows=0)
    layers = [m for m in on.model.modules() if isinstance(m, sk.SkinnyLinear)]
    assert layers and all(m.skinny_packed == 1 for m in layers)
    assert on.model.get_output_embeddings() in layers                # the LM head too
    caches = on.new_cache(), off.new_cache()
    prompt = list(range(3, 40))
    for block in (prompt, [7], [5, 6, 7, 8, 9]):
        a, b = (t.forward(block, c, None)[0] for t, c in zip((on, off), caches))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert hasattr(on.model.get_output_embeddings().weight, "_dflash_packed")
    with pytest.raises(ValueError, match="packed_linear"):
        TargetModel(tiny_target, packed_linear="yes")


def test_target_auto_tunes_packed_on_the_scheduler_thread(tiny_target, monkeypatch):
    import threading

    from verifier_svc.engine import VerifierEngine
    from verifier_svc.target import TargetModel

    seen = []

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    real = sk.tune_packed
    monkeypatch.setattr("kernels.skinny_linear.tune_packed", spy)
    t = TargetModel(tiny_target, skinny_max_rows=8, packed_linear="auto")
    engine = VerifierEngine(t)
    try:
        assert engine.run_on_loop(t.tune_skinny) == 8      # the row limit was set
        assert seen == ["verifier-scheduler"]
        assert t.packed_linear in ("on", "off", "from 2 rows")
        want = {"on": 1, "off": 0, "from 2 rows": 2}[t.packed_linear]
        assert all(m.skinny_packed == want for m in t.model.modules()
                   if isinstance(m, sk.SkinnyLinear))
    finally:
        engine.close()


def test_drafter_with_packed_products_drafts_as_without(tiny_target, make_drafter):
    """The drafter packed (layers and LM head) proposes the same greedy block as unpacked; with
    "auto" it measures at warm-up on its compute thread."""
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    path = make_drafter()
    on = DrafterEngine.from_pretrained(path, tiny_target, packed_linear="on", skinny_max_rows=0)
    off = DrafterEngine.from_pretrained(path, tiny_target, packed_linear="off", skinny_max_rows=0)
    assert on.head.skinny_packed == 1
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(12, on.cfg.context_size, generator=g)
    req = ProposalRequest(session_id="s", context_start=0, context=ctx, anchor_token=5,
                          block_size=on.cfg.block_size, sampling=Sampling(), top_k=4)
    a, b = on.propose([req])[0], off.propose([req])[0]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.top_ids, b.top_ids)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, rtol=1e-4, atol=1e-4)
    auto = DrafterEngine.from_pretrained(path, tiny_target, packed_linear="auto")
    auto.warmup()
    assert auto.packed_linear in ("on", "off", "from 2 rows")
    for d in (on, off, auto):
        d.close()


def test_service_flag(capsys):
    import argparse

    from dflash.serving.server import add_compute_args

    p = argparse.ArgumentParser()
    add_compute_args(p, "drafter")
    assert p.parse_args([]).packed_linear == "auto"
    assert p.parse_args(["--packed-linear", "off"]).packed_linear == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--packed-linear", "fast"])
    assert "--packed-linear" in capsys.readouterr().err
