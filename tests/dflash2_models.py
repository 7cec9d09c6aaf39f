"""Small random DFlash2 drafters of the published checkpoint's shape scaled down, for the
DFlash2 tests (``tests/fixtures/dflash2_header.json`` is the full-size shape)."""

from __future__ import annotations

import torch

from dflash.core.config import DrafterConfig
from dflash.core.dflash2 import DFlash2Drafter

HID, TAPS, GROUP, RANK, TOPK, LAYERS, WINDOW, V, BLOCK, NCTX = 64, 2, 16, 16, 8, 2, 6, 96, 8, 9


def small_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=HID, intermediate_size=2 * HID, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
                block_size=BLOCK, mask_token_id=V - 1, target_layer_ids=(1, 3, 5, 7, 9),
                layer_types=("sliding_attention",) * LAYERS, sliding_window=WINDOW,
                rope_theta=10000.0, architecture="DFlash2DraftModel", conv_kernel_size=TAPS,
                conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOPK,
                final_logit_softcapping=2.0, output_multiplier=0.6, input_embedding_scale=1.3)
    base.update(kw)
    return DrafterConfig(**base)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlash2Drafter:
    torch.manual_seed(seed)
    m = DFlash2Drafter(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("base_kernel"):
                p.normal_(0.0, 0.3)
                p[:, 0] += 1.0
            elif "codebook" in n:
                p.normal_(0.0, 0.7)
            elif p.dim() == 2:
                p.normal_(0.0, 0.25 if "kernel_projection" in n else 0.12)
            else:
                p.uniform_(0.7, 1.3)
    return m.eval()


