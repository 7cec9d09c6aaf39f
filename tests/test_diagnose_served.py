"""``dflash diagnose`` prices what the verifier serves: its costs are measured with the
services' thread count, linear-layer products and dtypes; trees are walked as the decode loop
verifies them; every servable mode is priced and the adaptive policy's own choice is never
below a mode it could choose; the exit status separates pays / does not pay / mis-wired."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from dflash_app.diagnose_cost import CostTable
from verifier_svc.cost_model import StepCostModel

from tap_models import letter_prompt, make_probe_drafter, make_tap_drafter, make_tap_target, mixed_prompt

B = 8
MAX_NEW = 1 + 3 * B
TAPPED = 1
PROMPTS = ("--raw", "--prompt", "a" * 12, "--prompt", "k" * 9, "--max-tokens", MAX_NEW)


@pytest.fixture(scope="module")
def tap(tmp_path_factory):
    root = tmp_path_factory.mktemp("tap")
    target = make_tap_target(root / "target")
    dirs = {ids: make_tap_drafter(root / f"drafter{ids}", target, tapped_layer=TAPPED,
                                  saved_layer_ids=[ids], block_size=B) for ids in (1, 2)}
    return target, dirs


def diagnose_json(*args) -> tuple[int, dict]:
    from dflash_app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["diagnose", *map(str, args), "--json"])
    return rc, json.loads(out.getvalue())


# ---------------------------------------------------------------------- the services' settings
@pytest.mark.slow
def test_costs_are_measured_with_the_services_settings(tap, monkeypatch):
    """Every timed forward runs with the thread count, skinny rows, packed and panel products the
    services take from their flags' environment, the drafter in the dtype its service picks,
    and the tree budgets priced are the verifier's. The choices differ from the model
    classes' own defaults (packed off, 16 skinny rows, a float32 drafter), so measuring with
    anything but the services' settings fails here."""
    from dflash.core.device import cpu_native_bf16
    from drafter_svc.engine import DrafterEngine
    from kernels.panel_linear import available as panel_available
    from kernels.skinny_linear import SkinnyLinear
    from verifier_svc.target import TargetModel

    for k, v in {"DFLASH_TORCH_THREADS": "2", "DFLASH_PACKED_LINEAR": "on", "DFLASH_PANEL_LINEAR": "on",
                 "DFLASH_SKINNY_MAX_ROWS": "4", "DFLASH_TREE_BUDGETS": "2,5",
                 "DFLASH_TREE_BUDGET": "6"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DFLASH_DTYPE", raising=False)
    seen: dict[str, set] = {"target": set(), "drafter": set()}

    def layers(model):
        return {(m.skinny_max_rows, m.skinny_packed, m.skinny_panel) for m in model.modules()
                if isinstance(m, SkinnyLinear)}

    forward_batch, propose_on = TargetModel.forward_batch, DrafterEngine._propose_on

    def spy_target(self, *a, **kw):
        seen["target"].add((torch.get_num_threads(), frozenset(layers(self.model)), self.dtype))
        return forward_batch(self, *a, **kw)

    def spy_drafter(self, *a, **kw):
        if self.skinny_max_rows == 4:          # the served engine (the probe's has 16 rows)
            seen["drafter"].add((torch.get_num_threads(), frozenset(layers(self.drafter)),
                                 next(self.drafter.parameters()).dtype))
        return propose_on(self, *a, **kw)

    monkeypatch.setattr(TargetModel, "forward_batch", spy_target)
    monkeypatch.setattr(DrafterEngine, "_propose_on", spy_drafter)
    target, dirs = tap
    rc, r = diagnose_json("--target", target, "--drafter", dirs[TAPPED], *PROMPTS,
                          "--no-offset-probe")
    bf16 = torch.bfloat16 if cpu_native_bf16() else torch.float32
    # "on" holds where the panels can apply: float32 weights, AVX-512 and the extension
    panel_t = int(panel_available())
    panel_d = panel_t if bf16 == torch.float32 else 0
    assert seen["target"] == {(2, frozenset({(4, 1, panel_t)}), torch.float32)}
    assert seen["drafter"] == {(2, frozenset({(4, 1, panel_d)}), bf16)}
    assert r["costs"]["settings"] == {
        "threads": 2, "tree_budgets": [2, 5], "tree_budget": 6,
        "target": {"dtype": "float32", "skinny_max_rows": 4, "packed_linear": "on",
                   "panel_linear": ["off", "on"][panel_t], "batch_invariant": False},
        "drafter": {"dtype": str(bf16).replace("torch.", ""), "skinny_max_rows": 4,
                    "packed_linear": "on", "panel_linear": ["off", "on"][panel_d],
                    "batch_invariant": False}}
    assert r["threads"] == 2 and rc in (0, 3)       # (pays or not: test_exit_status)
    dom = r["probe"]["domains"]["all"]           # acceptance priced with the served drafter
    assert dom.get("served_dtype") == ("bfloat16" if bf16 == torch.bfloat16 else None)
    modes = [m["mode"] for m in r["speculation"]["all"]["modes"]]
    assert modes == ["off", "fixed", *(f"chain:{k}" for k in range(1, B - 1)), "tree:2", "tree:5",
                     "tree:6", "suffix", "hybrid:2", "hybrid:5", "hybrid:6", "adaptive", "adaptive (race)"]


# ---------------------------------------------------------------------- trees
@pytest.mark.parametrize("budget", [3, 7])
def test_tree_walk_is_the_decode_loop(tap, tmp_path, budget):
    """The teacher-forced tree steps give the counts the decode loop records verifying
    trees of that budget (a drafter with partial acceptance: the wrong rope spreads it)."""
    from dflash_app.diagnose_tf import Head
    from dflash_app.diagnose_trees import tree_steps
    from dflash_app.probe import InProcessProbe
    from verifier_svc.engine import Request, VerifierEngine

    target, _ = tap
    d = make_probe_drafter(tmp_path / "recent", target, recent=True, block_size=B)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1e8
    (d / "config.json").write_text(json.dumps(cfg))
    probe = InProcessProbe(target, d)
    prompts = [mixed_prompt(), mixed_prompt("c", "d", 28, 14), letter_prompt("k", 9)]
    engine = VerifierEngine(probe.target, spec_mode="tree", tree_budget=budget)
    try:
        drafts = accepted = 0
        for i, p in enumerate(prompts):
            last = None
            for ev in engine.generate(Request(request_id=f"t{i}", prompt=list(p),
                                              max_tokens=MAX_NEW, proposer=probe.engine)):
                last = ev
            drafts += last.stats.drafts
            accepted += last.stats.accepted_tokens
        seqs = probe.collect(prompts, ["x"] * 3, max_new_tokens=MAX_NEW)
        steps = tree_steps(probe.drafter, probe.head, Head.of(probe.head.lm_head, None), seqs,
                           [budget], layer_ids=probe.layer_ids,
                           mask_token_id=probe.drafter.cfg.mask_token_id)["all"][budget]
    finally:
        engine.close()
        probe.close()
    assert 0 < accepted < drafts * (B - 1)               # neither nothing nor everything
    assert (len(steps), sum(steps) - len(steps)) == (drafts, accepted)


def test_a_deployments_tree_tokens_are_read_from_its_metrics():
    """The verifier's policy gauges carry tokens per tree step per budget; ``scrape`` reads them
    (what --gateway --metrics prices trees with)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from dflash.serving.metrics import PolicyGauges
    from dflash.serving.telemetry import serve_metrics
    from dflash_app.diagnose_cost import scrape
    from verifier_svc.policy import SpeculationPolicy

    policy = SpeculationPolicy("adaptive")
    policy.acceptance.observe_trees("d@1", [(7, 4), (7, 6), (3, 2)])
    registry = CollectorRegistry()
    PolicyGauges(registry, lambda: SimpleNamespace(policy=policy,
                                                   scheduler=SimpleNamespace(batch_size=1)))
    server = serve_metrics(registry, 0, "127.0.0.1")
    try:
        dep = scrape(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert dep.trees == {"d@1": {7: pytest.approx(5.0), 3: pytest.approx(2.0)}}


# ---------------------------------------------------------------------- the table of modes
def _costs(plain: float, per_draft: float, top: int, rounds: int = 3) -> CostTable:
    """Step (and verify) seconds ``plain + per_draft * k`` at every k up to ``top``, the same
    every round."""
    def model() -> StepCostModel:
        m = StepCostModel()
        for k in range(top + 1):
            for _ in range(2):
                m.observe_step(1, k, plain + per_draft * k)
                m.observe_verify(1, k, plain + per_draft * k)
        return m
    return CostTable(model(), {}, {}, "synthetic", [model() for _ in range(rounds)])


def test_adaptive_is_never_priced_below_a_mode_it_could_choose():
    from dflash_app.diagnose_cost import payoff

    blocks = [(15, 1)] * 50 + [(15, 3)] * 30 + [(15, 0)] * 20         # tau 2.4
    for trees in ({3: 2.2, 7: 2.9, 15: 3.3}, {3: 1.5, 7: 1.6, 15: 1.7}, {}):
        for per_draft in (0.001, 0.01, 0.05):
            p = payoff(_costs(0.05, per_draft, 15), blocks, 16, trees=trees,
                       tree_budgets=(3, 7, 15), tree_budget=15)
            assert p is not None
            ad = p.row("adaptive")
            assert all(ad.speedup >= r.speedup - 1e-9 for r in p.rows), p.sentence()
            fixed = p.row("fixed")
            assert fixed.tokens == pytest.approx(1 + (50 * 1 + 30 * 3) / 100)
            assert fixed.seconds == pytest.approx(0.05 + 15 * per_draft)
            assert [r.mode for r in p.rows if r.mode.startswith("tree")] == \
                [f"tree:{n}" for n in sorted(trees)]
    # cheap verifies and good trees: adaptive picks the best tree
    p = payoff(_costs(0.05, 0.001, 15), blocks, 16, trees={3: 2.2, 7: 2.9, 15: 3.6},
               tree_budgets=(3, 7, 15), tree_budget=15)
    assert p.row("adaptive").choice == "tree of 15 nodes" and p.best.mode in ("tree:15", "adaptive")
    assert p.pays and not p.does_not_pay


def test_does_not_pay_only_beyond_the_spread():
    from dflash_app.diagnose_cost import MIN_SPREAD, payoff

    blocks = [(7, 0)] * 90 + [(7, 1)] * 10           # tau 1.1
    # a verify of one draft costs 5% more than plain: best mode 1.1 / 1.05 ~ 1.05x
    p = payoff(_costs(0.1, 0.005, 7), blocks, 8)
    assert p.pays and not p.does_not_pay
    # 12% more: ~0.98x, below 1.0 but within the spread: not "does not pay"
    p = payoff(_costs(0.1, 0.012, 7), blocks, 8)
    assert not p.pays and not p.does_not_pay and p.spread == pytest.approx(MIN_SPREAD)
    # 30% more: ~0.85x, below by more than the spread
    p = payoff(_costs(0.1, 0.03, 7), blocks, 8)
    assert p.does_not_pay and p.row("adaptive").choice == "off" and p.best.mode == "chain:1"


# ---------------------------------------------------------------------- exit status
@pytest.mark.parametrize("saved, per_draft, verdict, rc", [
    (TAPPED, 0.0005, "healthy", 0),       # wired right, verifies cheap: speculation pays
    (TAPPED, 0.05, "degraded", 3),        # wired right, each draft costs as much as a token
    (TAPPED + 1, 0.0005, "mis-wired", 1),  # taps shifted: named with the fix
])
def test_exit_status(tap, monkeypatch, saved, per_draft, verdict, rc):
    """Healthy and pays / healthy but does not pay here / mis-wired, on costs set by hand
    (the measurement itself is the services' one, pinned above)."""
    import dflash_app.diagnose_cost as dc

    monkeypatch.setattr(dc, "measure_costs", lambda *a, **kw: _costs(0.01, per_draft, B - 1))
    target, dirs = tap
    got, r = diagnose_json("--target", target, "--drafter", dirs[saved], *PROMPTS)
    assert (r["verdict"], got) == (verdict, rc), r["causes"]
    if verdict == "degraded":
        assert r["causes"][0].startswith("speculation does not pay here")
        assert "below 1.0x by more than the spread" in r["causes"][0]
