"""kernels.panel_linear: the AVX-512 float32 product on column panels equals F.linear (rounding),
gives a row the same bits whatever rows share the call, follows a weight changed in place, stays
out of autograd and other dtypes, is chosen by measurement, and is what the target and drafter
run when asked."""

import time

import pytest
import torch
import torch.nn.functional as F

from kernels import panel_linear as ql, skinny_linear as sk

# Only a CPU without AVX-512 skips (the kernel has no other path to test; callers keep
# F.linear). On an AVX-512 CPU a build failure fails the tests: a missing g++ or ninja would
# otherwise hide every panel test on a fresh machine (docs/limits.md).
AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
pytestmark = pytest.mark.skipif(
    not AVX512, reason=f"no AVX-512 (ATen: {torch.backends.cpu.get_cpu_capability()})")


def test_the_extension_builds_on_an_avx512_cpu():
    assert ql.available(), "AVX-512 CPU, but kernels/csrc/panel_linear.cpp did not build (needs g++ and ninja)"


@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (1, 3, 64), (3, 6, 64), (17, 64), (0, 64),
                                   (9, 7)])
@pytest.mark.parametrize("out", [48, 32, 1, 97])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, out, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out, shape[-1], generator=g)
    b = torch.randn(out, generator=g) if bias else None
    got = ql.try_panel_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got is not None and got.shape == ref.shape == (*shape[:-1], out)
    assert got.dtype == torch.float32 and got.is_contiguous()
    # float32 dot products of 64 terms in another order: within a few float32 ulps of float64
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert hasattr(w, "_dflash_panels")


def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    """What makes a verify block's products equal a decode's: each output is one FMA chain over
    the input features in order, in every row block, panel and thread."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 576, generator=g) * 0.05
    x = torch.randn(23, 576, generator=g)
    full = ql.try_panel_linear(x, w)
    for rows in (1, 2, 7, 8, 9, 16):
        for start in (0, 5, 23 - rows):
            part = ql.try_panel_linear(x[start:start + rows], w)
            assert torch.equal(part, full[start:start + rows]), (rows, start)
    # F.linear's blocking does not promise it (nor is this test about it): the panel product
    # differs from it in the last bits only
    assert (full - F.linear(x, w)).abs().max() < 1e-4


def test_a_thread_that_claimed_threads_keeps_them():
    """The kernel's parallel region runs on the calling thread's own count and leaves it: the
    verifier's scheduler claims 2 threads while the process default is 1
    (``dflash.serving.threads.claim``), and a kernel that re-ran torch's per-thread init would
    drop every later forward of that thread to one thread."""
    import threading

    from dflash.serving.threads import claim

    before = torch.get_num_threads()
    got = []

    def run():
        claim(2, others=1)
        x, w = torch.randn(4, 64), torch.randn(96, 64)
        ql.try_panel_linear(x, w)
        got.append(torch.get_num_threads())
        ql.try_panel_linear(x, w)
        got.append(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    torch.set_num_threads(before)
    assert got == [2, 2]


def test_a_stale_build_lock_does_not_hang_the_build():
    """A build killed half-way (Ctrl-C on a first start) leaves torch's lock file in the build
    folder, which torch's loader waits on forever; the loader drops it under its own flock."""
    import threading

    _, build = ql.build_directory()
    (build / "lock").write_text("")               # what a killed build leaves
    ql._extension.cache_clear()
    got = []
    t = threading.Thread(target=lambda: got.append(ql._extension()), daemon=True)
    t.start()
    t.join(120)
    assert got and got[0] is not None, "the build waited on a stale lock"
    assert not (build / "lock").exists()


def test_the_product_releases_the_gil():
    """Other Python threads (gRPC handlers, the drafter's context thread) run while a product
    does, as beside F.linear: a thread counting during one long call gets ticks in."""
    import threading

    g = torch.Generator().manual_seed(2)
    w = torch.randn(8192, 4096, generator=g)
    x = torch.randn(64, 4096, generator=g)
    ql.try_panel_linear(x[:1], w)                 # packs outside the timed call
    span, ticks, done = [], [], threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    t = threading.Thread(target=count)
    t.start()
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.no_grad():
                ql.try_panel_linear(x, w)
            span.append((t0, time.perf_counter()))
    finally:
        done.set()
        t.join()
    inside = sum(a < tick < b for a, b in span for tick in ticks)
    assert inside >= 3 * len(span), (inside, [b - a for a, b in span])


def test_mismatches_raise_f_linear_errors():
    w = torch.randn(40, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        sk.skinny_linear(torch.randn(3, 7), w, max_rows=0, panel=1)
    assert ql.try_panel_linear(torch.randn(3, 8), w, torch.zeros(40, dtype=torch.float64)) is None


def test_pack_layout_and_padding():
    w = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    p = ql.pack(w)
    assert p.shape == (3, 3, ql.PANEL)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[2, :, 70 - 64 - 1], w[69])
    assert torch.equal(p[2, :, 6:], torch.zeros(3, ql.PANEL - 6))


def test_a_weight_changed_in_place_is_packed_again():
    w = torch.randn(40, 8)
    x = torch.randn(3, 8)
    ql.try_panel_linear(x, w)
    first = w._dflash_panels[1]
    with torch.no_grad():
        w.mul_(-2.0)                              # a reload into the same storage
    torch.testing.assert_close(ql.try_panel_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert w._dflash_panels[1] is not first


def test_autograd_and_other_dtypes_keep_their_path():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    assert not ql.applies(x, lin.weight) and ql.try_panel_linear(x, lin.weight) is None
    out = sk.skinny_linear(x, lin.weight, lin.bias, max_rows=0, panel=1)
    out.sum().backward()                          # F.linear took it: the graph is there
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        assert ql.applies(x, lin.weight)
        assert not ql.applies(x.bfloat16(), lin.weight.bfloat16())
        assert not ql.applies(x.double(), lin.weight.double())
        assert ql.try_panel_linear(x.bfloat16(), lin.weight.bfloat16()) is None


def test_skinny_layers_take_it_from_their_threshold(monkeypatch):
    seen = []
    real = ql.try_panel_linear
    monkeypatch.setattr(sk, "try_panel_linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    w = torch.randn(8, 4)
    big = ql.MAX_ROWS + 1                        # a prefill chunk keeps the vendor's kernels
    with torch.no_grad():
        for threshold in (0, 1, 4):
            for rows in (1, 2, 16, big):
                out = sk.skinny_linear(torch.ones(rows, 4), w, max_rows=16, panel=threshold)
                torch.testing.assert_close(out, F.linear(torch.ones(rows, 4), w))
            seen.append("|")
    assert seen == ["|", 1, 2, 16, "|", 16, "|"]


@pytest.mark.parametrize("wins_from,expected", [(1, 1), (4, 4), (16, 16), (99, 0)])
def test_tune_panel_keeps_the_faster_from_where_it_wins(wins_from, expected):
    m = torch.nn.Sequential(torch.nn.Linear(4, 8))
    sk.use_skinny_linear(m, 0, always=True)
    head = type("Head", (), {"skinny_panel": 0})()
    calls = []

    def probe(n):
        on = m[0].skinny_panel != 0 and n >= m[0].skinny_panel
        calls.append((n, on))
        # the behaviour: a product that costs what the test says
        time.sleep(0.002 if on == (n >= wins_from) else 0.012)

    outside = torch.randn(8, 4)                  # a weight of neither model nor also (a draft head)

    def probe_and_pack(n):
        probe(n)
        with torch.no_grad():                    # what a real probe does: packs the weights
            sk.skinny_linear(torch.ones(4, 4), m[0].weight, panel=m[0].skinny_panel)
            sk.skinny_linear(torch.ones(4, 4), outside, panel=m[0].skinny_panel)

    threshold, timings = sk.tune_panel(m, probe_and_pack, rows=(1, 4, 16), reps=3, also=[head])
    assert threshold == expected
    # a tune that leaves the panels off frees the copy its probes made; one that keeps them not
    assert hasattr(m[0].weight, "_dflash_panels") is (expected != 0)
    assert hasattr(outside, "_dflash_panels") is (expected != 0)
    assert m[0].skinny_panel == head.skinny_panel == expected         # left at the result
    assert sorted(timings) == [1, 4, 16]
    assert {(n, on) for n, on in calls} == {(n, on) for n in (1, 4, 16) for on in (True, False)}
    assert ("off" in sk.panel_summary(threshold, timings)) is (expected == 0)


def test_tune_panel_skips_models_without_float32_layers():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8)).bfloat16()
    sk.use_skinny_linear(m, 0, always=True)
    assert sk.tune_panel(m, lambda n: pytest.fail("no probe expected")) == (0, {})


def test_target_with_panel_products_decodes_as_without(tiny_target):
    """The real target with every linear layer and the LM head on panels: logits of a prefill,
    a decode and a verify block equal the plain target's within float32 rounding; a verify
    block's logits equal the same tokens decoded one by one to the bit (the products are
    row-invariant; the tiny target's attention is too, at these lengths, which the assertion
    would catch if it stopped being so)."""
    from verifier_svc.target import TargetModel

    on = TargetModel(tiny_target, panel_linear="on", skinny_max_rows=0)
    off = TargetModel(tiny_target, panel_linear="off", skinny_max_rows=0)
    layers = [m for m in on.model.modules() if isinstance(m, sk.SkinnyLinear)]
    assert layers and all(m.skinny_panel == 1 for m in layers)
    assert on.model.get_output_embeddings() in layers                # the LM head too
    caches = on.new_cache(), off.new_cache()
    prompt = list(range(3, 40))
    for block in (prompt, [7], [5, 6, 7, 8, 9]):
        a, b = (t.forward(block, c, None)[0] for t, c in zip((on, off), caches))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert hasattr(on.model.get_output_embeddings().weight, "_dflash_panels")
    with pytest.raises(ValueError, match="panel_linear"):
        TargetModel(tiny_target, panel_linear="yes")
    # "on" where it cannot apply (bfloat16 weights) is reported off, not on
    assert TargetModel(tiny_target, panel_linear="on", dtype="bfloat16").panel_linear == "off"


def test_greedy_speculation_on_panels_is_identical_to_decoding(tiny_target):
    """Lossless with the panel product: greedy generation in mode ``suffix`` (trees of the
    prompt's continuations, verified as blocks of many rows) equals plain decoding on the same
    target, token for token."""
    import random

    from dflash.core.speculation import SpecMode
    from verifier_svc.engine import Request, VerifierEngine
    from verifier_svc.target import TargetModel

    def run(engine, prompt):
        events = list(engine.generate(Request(request_id=f"r{random.random()}", prompt=prompt,
                                              max_tokens=48)))
        return [t for ev in events for t in ev.tokens], events

    spec = VerifierEngine(TargetModel(tiny_target, panel_linear="on", skinny_max_rows=0),
                          spec_mode="suffix")
    base = VerifierEngine(TargetModel(tiny_target, panel_linear="on", skinny_max_rows=0),
                          spec_mode=SpecMode.OFF)
    try:
        rng = random.Random(5)
        for _ in range(3):
            text = [rng.randrange(3, 200) for _ in range(24)]
            prompt = text + text + text[:4]          # the target may copy; candidates exist
            want, _ = run(base, prompt)
            got, events = run(spec, prompt)
            assert got == want
            assert sum(ev.suffix_nodes for ev in events) > 0     # blocks of several rows ran
    finally:
        spec.close()
        base.close()


def test_target_auto_tunes_panel_on_the_scheduler_thread(tiny_target, monkeypatch):
    import threading

    from verifier_svc.engine import VerifierEngine
    from verifier_svc.target import TargetModel

    seen = []

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    real = sk.tune_panel
    monkeypatch.setattr("kernels.skinny_linear.tune_panel", spy)
    t = TargetModel(tiny_target, skinny_max_rows=0, panel_linear="auto")
    engine = VerifierEngine(t)
    try:
        engine.run_on_loop(t.tune_skinny)
        assert seen == ["verifier-scheduler"]
        assert t.panel_linear == "off" or t.panel_linear == "on" or t.panel_linear.startswith("from ")
        want = 0 if t.panel_linear == "off" else 1 if t.panel_linear == "on" else int(
            t.panel_linear.split()[1])
        assert all(m.skinny_panel == want for m in t.model.modules()
                   if isinstance(m, sk.SkinnyLinear))
    finally:
        engine.close()


def test_drafter_with_panel_products_drafts_as_without(tiny_target, make_drafter):
    """A float32 drafter on panels (layers and LM head) proposes the same greedy block."""
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from drafter_svc.engine import DrafterEngine

    path = make_drafter()
    on = DrafterEngine.from_pretrained(path, tiny_target, panel_linear="on", skinny_max_rows=0)
    off = DrafterEngine.from_pretrained(path, tiny_target, panel_linear="off", skinny_max_rows=0)
    assert on.head.skinny_panel == 1
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(12, on.cfg.context_size, generator=g)
    req = ProposalRequest(session_id="s", context_start=0, context=ctx, anchor_token=5,
                          block_size=on.cfg.block_size, sampling=Sampling(), top_k=4)
    a, b = on.propose([req])[0], off.propose([req])[0]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.top_ids, b.top_ids)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, rtol=1e-4, atol=1e-4)
    for d in (on, off):
        d.close()


def test_a_bad_environment_value_is_refused_naming_the_flag(monkeypatch, capsys):
    import argparse

    from dflash.serving.server import add_compute_args

    monkeypatch.setenv("DFLASH_PANEL_LINEAR", "yes")
    p = argparse.ArgumentParser()
    add_compute_args(p, "verifier")
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert "--panel-linear" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_PANEL_LINEAR", "off")
    p = argparse.ArgumentParser()                 # defaults are read when the flags are added
    add_compute_args(p, "verifier")
    assert p.parse_args([]).panel_linear == "off"
