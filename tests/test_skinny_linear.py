"""kernels.skinny_linear: the transposed product for 2..N rows equals F.linear (float32 rounding),
is taken only where it was measured to help, and is what the target and drafter run."""

import time

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_linear as sk


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(2, 64), (1, 5, 64), (3, 4, 64), (16, 64), (17, 64), (1, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias, two_threads):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    out = sk.skinny_linear(x, w, b, max_rows=16)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape == (*shape[:-1], 48)
    assert out.stride() == ref.stride()          # row-major: consumers get F.linear's layout
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _calls(monkeypatch):
    """Count the products skinny_linear hands to F.linear (the path it did not take)."""
    seen = []
    real = F.linear
    monkeypatch.setattr(sk.F, "linear", lambda *a: seen.append(a[0].shape) or real(*a))
    return seen


def test_dispatch_takes_transposed_product_only_for_2_to_max_rows(monkeypatch, two_threads):
    seen = _calls(monkeypatch)
    w = torch.randn(8, 4)
    for rows in (1, 2, 16, 17):
        sk.skinny_linear(torch.randn(rows, 4), w, max_rows=16)
    assert seen == [(1, 4), (17, 4)]
    seen.clear()
    sk.skinny_linear(torch.randn(4, 4), w, max_rows=0)                       # off
    sk.skinny_linear(torch.randn(4, 4).double(), w.double(), max_rows=16)    # not float32
    assert len(seen) == 2
    torch.set_num_threads(1)                                                  # one thread: slower
    seen.clear()
    sk.skinny_linear(torch.randn(4, 4), w, max_rows=16)
    assert len(seen) == 1


def test_use_skinny_linear_switches_plain_linears_and_keeps_weights():
    class Sub(torch.nn.Linear):
        pass

    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Sub(8, 2))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(3, 4)
    ref = m(x)
    assert sk.use_skinny_linear(m, max_rows=0) == 0 and type(m[0]) is torch.nn.Linear
    assert sk.use_skinny_linear(m, max_rows=8) == 1
    assert type(m[0]) is sk.SkinnyLinear and type(m[2]) is Sub
    assert m.state_dict().keys() == before.keys()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-6)


def test_target_and_drafter_engine_use_it(tiny_target, make_drafter):
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

    t = TargetModel(tiny_target)
    assert any(type(m) is sk.SkinnyLinear for m in t.model.modules())
    off = TargetModel(tiny_target, skinny_max_rows=0)
    assert not any(type(m) is sk.SkinnyLinear for m in off.model.modules())
    d = DrafterEngine.from_pretrained(make_drafter(), tiny_target)
    assert any(type(m) is sk.SkinnyLinear for m in d.drafter.modules())
    assert d.head.skinny_max_rows == sk.DEFAULT_MAX_ROWS


def test_target_verify_runs_flash_attention_on_grouped_kv(tiny_target, monkeypatch, two_threads):
    """A multi-token forward (a verify) after a prefill: the skinny projections hand attention
    row-major activations, so PyTorch's flash SDPA kernel runs (a transposed layout sent it to the
    math kernel), and K/V reach it grouped, never repeated to the query heads."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.integrations import sdpa_attention

    from verifier_svc.target import TargetModel

    repeats = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or real_repeat(*a))
    t = TargetModel(tiny_target)
    assert t.config.num_key_value_heads < t.config.num_attention_heads
    cache = t.new_cache()
    t.forward(list(range(3, 40)), cache, None, logits_to_keep=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits, _ = t.forward([5, 6, 7], cache, None)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert not repeats
    ref = TargetModel(tiny_target, skinny_max_rows=0)
    ref_cache = ref.new_cache()
    ref.forward(list(range(3, 40)), ref_cache, None, logits_to_keep=1)
    torch.testing.assert_close(logits, ref.forward([5, 6, 7], ref_cache, None)[0],
                               rtol=1e-4, atol=1e-4)


def _timed_probe(model, slow):
    """A probe whose cost is set by the test: ``slow(n, skinny_on)`` -> seconds to sleep."""
    import time

    calls = []

    def probe(n):
        on = model[0].skinny_max_rows >= n
        calls.append((n, on))
        time.sleep(slow(n, on))   # the behaviour: a product that costs what the test says

    return probe, calls


@pytest.mark.parametrize("skinny_wins_up_to,expected", [(16, 16), (4, 4), (0, 0)])
def test_tune_keeps_the_faster_product_per_row_count(skinny_wins_up_to, expected):
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    sk.use_skinny_linear(m, sk.AUTO)
    assert m[0].skinny_max_rows == sk.DEFAULT_MAX_ROWS
    head = type("Head", (), {"skinny_max_rows": 16})()
    probe, calls = _timed_probe(
        m, lambda n, on: 0.002 if on == (n <= skinny_wins_up_to) else 0.012)
    best, timings = sk.tune_max_rows(m, probe, rows=(2, 4, 8, 16), reps=3, also=[head])
    assert best == expected
    assert m[0].skinny_max_rows == head.skinny_max_rows == expected   # left at the result
    assert sorted(timings) == [2, 4, 8, 16]
    for n, (t_on, t_off) in timings.items():
        assert (t_on < t_off) == (n <= skinny_wins_up_to)
    assert {(n, on) for n, on in calls} == {(n, on) for n in (2, 4, 8, 16) for on in (True, False)}


def test_tune_stops_at_the_first_row_count_where_skinny_loses():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    sk.use_skinny_linear(m, sk.AUTO)
    probe, _ = _timed_probe(m, lambda n, on: 0.002 if on == (n != 4) else 0.012)
    assert sk.tune_max_rows(m, probe, rows=(2, 4, 8, 16), reps=3)[0] == 2


def _tuning_threads(monkeypatch, module: str) -> list[str]:
    """Names of the threads that call ``module.tune_max_rows`` (which still runs)."""
    import threading

    seen = []

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return sk.tune_max_rows(*a, **kw)

    monkeypatch.setattr(f"{module}.tune_max_rows", spy)
    return seen


def test_target_tunes_on_the_scheduler_thread(tiny_target, monkeypatch):
    """The verifier tunes its target on the thread that runs every forward
    (``Scheduler.run_on_loop``), and only when asked to (AUTO)."""
    from verifier_svc.engine import VerifierEngine
    from verifier_svc.target import TargetModel

    t = TargetModel(tiny_target, skinny_max_rows=sk.AUTO)
    engine = VerifierEngine(t)
    seen = _tuning_threads(monkeypatch, "verifier_svc.target")
    try:
        chosen = engine.run_on_loop(t.tune_skinny)
        assert seen == ["verifier-scheduler"]
        assert chosen == t.skinny_max_rows and chosen in (0, 2, 4, 8, 16)
        assert all(m.skinny_max_rows == chosen for m in t.model.modules()
                   if isinstance(m, sk.SkinnyLinear))
        fixed = TargetModel(tiny_target, skinny_max_rows=8)
        assert engine.run_on_loop(fixed.tune_skinny) == 8 and len(seen) == 1
        with pytest.raises(ZeroDivisionError):
            engine.run_on_loop(lambda: 1 / 0)
    finally:
        engine.close()


def test_drafter_tunes_on_its_compute_thread(tiny_target, make_drafter, monkeypatch):
    from drafter_svc.engine import DrafterEngine

    seen = _tuning_threads(monkeypatch, "drafter_svc.warmup")
    d = DrafterEngine.from_pretrained(make_drafter(), tiny_target, skinny_max_rows=sk.AUTO)
    d.warmup()
    assert len(seen) == 1 and seen[0].startswith("drafter-compute")
    assert d.skinny_max_rows in (0, 2, 4, 8, 16)
    assert d.head.skinny_max_rows == d.skinny_max_rows
    assert all(m.skinny_max_rows == d.skinny_max_rows for m in d.drafter.modules()
               if isinstance(m, sk.SkinnyLinear))
    assert d.num_sessions == 0                     # the probe session is gone
    d.close()
    fixed = DrafterEngine.from_pretrained(make_drafter(), tiny_target, skinny_max_rows=8)
    fixed.warmup()
    assert len(seen) == 1 and fixed.skinny_max_rows == 8
    fixed.close()


def test_row_limits_below_auto_are_refused_naming_the_field():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match="skinny_max_rows"):
        sk.use_skinny_linear(m, -2)
    assert type(m[0]) is torch.nn.Linear


def test_service_flag_refuses_row_limits_below_auto(capsys):
    import argparse

    from dflash.serving.server import add_compute_args

    p = argparse.ArgumentParser()
    add_compute_args(p, "verifier")
    assert p.parse_args([]).skinny_max_rows == sk.AUTO
    assert p.parse_args(["--skinny-max-rows", "8"]).skinny_max_rows == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--skinny-max-rows", "-3"])
    assert "--skinny-max-rows" in capsys.readouterr().err


def test_the_product_modes_are_the_service_flags_choices():
    # the kernels import nothing of dflash, so the torch-free flag list is written twice
    from dflash.core.flags import PACKED_CHOICES

    assert sk.PRODUCT_MODES == PACKED_CHOICES
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match="panel_linear: one of auto, on, off"):
        sk.switch_linear(m, 0, "off", torch.device("cpu"), panel_linear="fast")


def test_one_row_takes_the_two_copy_product_only_when_asked(two_threads):
    w, b = torch.randn(48, 32), torch.randn(48)
    x = torch.randn(1, 1, 32)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(sk.skinny_linear(x, w, b, 16, one_row=True), ref, rtol=1e-5, atol=1e-5)
    calls = []
    real = torch.Tensor.repeat
    try:
        torch.Tensor.repeat = lambda self, *a: calls.append(a) or real(self, *a)
        sk.skinny_linear(x, w, b, 16)
        assert calls == []                       # one row, switch off: F.linear
        sk.skinny_linear(x, w, b, 0, one_row=True)
        assert calls == [(2, 1)]                 # independent of the multi-row limit
    finally:
        torch.Tensor.repeat = real


def test_tune_decides_one_row_on_its_own():
    """A 1 in ``rows`` sets the layers' one-row switch from its own timing; it neither counts
    for nor stops the multi-row limit."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    sk.use_skinny_linear(m, sk.AUTO)
    calls = []

    def probe(n):
        on = m[0].skinny_one_row if n == 1 else m[0].skinny_max_rows >= n
        calls.append((n, on))
        time.sleep(0.002 if on == (n != 1 or one_wins) else 0.012)   # the behaviour: its cost

    for one_wins in (True, False):
        best, timings = sk.tune_max_rows(m, probe, rows=(1, 2, 4), reps=3)
        assert best == 4 and m[0].skinny_max_rows == 4
        assert m[0].skinny_one_row is one_wins
        assert sorted(timings) == [1, 2, 4]
        assert ("one row two-copy product" in sk.tuning_summary(best, timings)) is one_wins
    assert {(n, on) for n, on in calls if n == 1} == {(1, True), (1, False)}
    sk.tune_max_rows(m, probe, rows=(2, 4), reps=1)
    assert m[0].skinny_one_row is False          # no decode probe: the switch stays off
