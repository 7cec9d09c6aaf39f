"""DFlash2 drafter parity: ``dflash.core.dflash2`` against an independent float64 statement of
the published math (``tests/dflash2_reference.py``), per component and end to end, on random
weights of the published checkpoint's shape scaled down (``tests/fixtures/dflash2_header.json``:
all layers sliding-window, 2 conv taps in groups of 16 channels, selector over the top 16 at
rank 256, 5 target taps, block 8 -> hidden 64, rank 16, top 8, 2 layers, window 6).

float32 runs match to 1e-4 (relative to the output's scale); bfloat16 runs to a bf16 tolerance
(3e-2 relative) that no CPU's rounding approaches. ``test_each_component_matters`` shows that
the reference with any one component left out is far outside those tolerances, so the parity
tests would fail if the implementation dropped it.
"""

from __future__ import annotations

import json
from pathlib import Path

import dflash2_reference as ref
import numpy as np
import pytest
import torch
from dflash2_models import BLOCK, GROUP, HID, LAYERS, NCTX, TOPK, V, random_drafter, small_config

from dflash.core.config import DrafterConfig
from dflash.core.dflash2 import DFlash2Drafter, grouped_conv, selector_rows

FIXTURE = Path(__file__).parent / "fixtures" / "dflash2_header.json"
def rcfg(cfg: DrafterConfig) -> dict:
    return dict(hidden=cfg.hidden_size, group=cfg.conv_group_size, taps=cfg.conv_kernel_size,
                heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, theta=cfg.rope_theta,
                window=cfg.sliding_window, layers=cfg.num_hidden_layers,
                softcap=cfg.final_logit_softcapping, multiplier=cfg.output_multiplier,
                embed_scale=cfg.input_embedding_scale)


def weights64(m) -> dict:
    return {k: v.detach().double().numpy() for k, v in m.state_dict().items()}


def inputs(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, NCTX, cfg.context_size, generator=g)
    embed = torch.randn(V, HID, generator=g) * 0.5
    head = torch.randn(V, HID, generator=g) * 0.5
    block = torch.full((1, BLOCK), cfg.mask_token_id)
    block[0, 0] = 17
    return feats, embed, head, block


def run_ours(m, cfg, dtype):
    feats, embed, head, block = inputs(cfg)
    m = m.to(dtype)
    ctx_pos = torch.arange(NCTX)[None]
    pos = torch.arange(NCTX, NCTX + BLOCK)[None]
    with torch.no_grad():
        kv = m.context_kv(feats.to(dtype), ctx_pos)
        hidden = m(embed[block].to(dtype), pos, kv)[0]                       # [B, H]
        logits = (hidden[1:].float() @ head.T.float())                         # [L, V]
        sel = m.candidate_selector
        cols, vals = sel.candidates(logits)
        scores = sel.edges(cols[None], vals[None], hidden[None, 1:], torch.tensor([17]))[0]
        rows = selector_rows(sel, logits, hidden[1:], 17, None)
    return dict(hidden=hidden.float().numpy(), logits=logits.numpy(), cols=cols.numpy(),
                scores=scores.numpy(), path=rows.argmax(-1).tolist())


def run_ref(m, cfg, drop=(), cols=None):
    feats, embed, head, block = inputs(cfg)
    w = weights64(m.float())
    hidden = ref.drafter(w, rcfg(cfg), feats[0].double().numpy(), np.arange(NCTX),
                         embed[block[0]].double().numpy(), np.arange(NCTX, NCTX + BLOCK), drop)
    logits = hidden[1:] @ head.double().numpy().T
    vals = ref.candidate_values(logits, rcfg(cfg), drop)
    if cols is None:
        cols = np.argsort(-vals, axis=-1, kind="stable")[:, :TOPK]
    unary = np.take_along_axis(vals, cols, -1)
    scores = ref.edge_scores(w, rcfg(cfg), cols, unary, hidden[1:], 17, drop)
    return dict(hidden=hidden, logits=logits, cols=cols, scores=scores,
                path=ref.greedy_path(scores, cols))


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-9))


@pytest.fixture(scope="module")
def model():
    return random_drafter(small_config())


def test_fixture_shapes_are_what_the_drafter_builds():
    """The published DFlash2 tensor set at full size (meta tensors: shapes only)."""
    fx = json.loads(FIXTURE.read_text())
    cfg = DrafterConfig.from_dict(fx["config"])
    assert cfg.is_dflash2 and set(cfg.layer_types) == {"sliding_attention"}
    with torch.device("meta"):
        m = DFlash2Drafter(cfg)
    shapes = {k: list(v.shape) for k, v in m.state_dict().items()}
    assert len(shapes) == fx["tensor_count"]
    for name, shape in fx["dflash2_tensors"].items():
        assert shapes[name] == shape, name


def test_conv_matches_reference():
    g = torch.Generator().manual_seed(3)
    for block_len in (5, 8, 16):       # modulo and power-of-two block lengths
        x = torch.randn(1, 2 * block_len, HID, generator=g)
        delta = torch.randn(1, 2 * block_len, 3, HID // GROUP, generator=g)
        base = torch.randn(3, HID, generator=g)
        got = grouped_conv(x, delta, base, block_len)[0].numpy()
        want = ref.conv(x[0].double().numpy(), delta[0].double().numpy(), base.double().numpy(),
                        block_len)
        assert rel(got, want) < 1e-5, block_len


def test_float32_matches_reference_end_to_end(model):
    cfg = model.cfg
    ours = run_ours(model, cfg, torch.float32)
    want = run_ref(model, cfg)
    assert rel(ours["hidden"], want["hidden"]) < 1e-4
    assert rel(ours["logits"], want["logits"]) < 1e-4
    assert (ours["cols"] == want["cols"]).all()
    assert rel(ours["scores"], want["scores"]) < 1e-4
    assert ours["path"] == want["path"]


def test_bfloat16_matches_reference_to_bf16_tolerance(model):
    cfg = model.cfg
    ours = run_ours(random_drafter(cfg), cfg, torch.bfloat16)
    # the bf16-rounded weights are the reference's weights; candidates as ours chose them
    want = run_ref(random_drafter(cfg).to(torch.bfloat16), cfg, cols=ours["cols"])
    assert rel(ours["logits"], want["logits"]) < 3e-2
    assert rel(ours["scores"], want["scores"]) < 3e-2


@pytest.mark.parametrize("component", ref.COMPONENTS)
def test_each_component_matters(model, component):
    """Without ``component`` the reference is >= 100x the float32 tolerance from ours: parity
    would catch its loss."""
    cfg = model.cfg
    ours = run_ours(model, cfg, torch.float32)
    dropped = run_ref(model, cfg, drop=(component,), cols=ours["cols"])
    assert rel(ours["scores"], dropped["scores"]) > 1e-2, component


def test_window_shorter_than_context_and_full_attention_differ(model):
    """The window (6) is shorter than the 9 context rows: a full-attention drafter differs."""
    cfg = model.cfg
    full = random_drafter(small_config(layer_types=("full_attention",) * LAYERS))
    a = run_ours(model, cfg, torch.float32)["hidden"]
    b = run_ours(full, full.cfg, torch.float32)["hidden"]
    assert rel(a, b) > 0.05
