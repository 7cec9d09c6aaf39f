"""The DFlash drafter network (torch), in the z-lab checkpoint layout.

Method: DFlash (Chen, Liang, Liu, arXiv 2602.06036, Sec. 3) as implemented in z-lab/dflash
``dflash/model.py`` and transformers 5.x ``models/muse_glimmer_assistant``:

* Target taps ``[n, len(target_layer_ids) * H]`` are projected by ``fc`` then ``hidden_norm``
  into one context vector per committed position, shared by all drafter layers.
* In every layer the context vectors go through that layer's ``k_proj``/``v_proj`` (+ ``k_norm``
  and RoPE at their absolute positions) and form an extra K/V prefix ("KV injection"); queries
  come only from the block. Attention is non-causal: a block query sees all context K/V and every
  position of its own block.
* The block is ``[anchor, MASK x (B-1)]`` embedded with the target's (frozen) input embedding;
  the output at block position k (k >= 1) is read through the target's LM head and predicts the
  token at ``anchor_position + k``.

The building blocks (RMSNorm, SwiGLU MLP, rotary embedding) are transformers' Qwen3 modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash.core.config import DrafterConfig
from kernels.invariant import attention as invariant_attention
from kernels.skinny_linear import skinny_linear

if TYPE_CHECKING:
    from dflash.core.dflash2 import CandidateSelector

# One layer's cached context keys and values: ([b, kv_heads, n, head_dim], same).
LayerKV = tuple[torch.Tensor, torch.Tensor]


def _qwen3_config(cfg: DrafterConfig) -> Qwen3Config:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        hidden_act=cfg.hidden_act,
        attention_bias=cfg.attention_bias,
        rope_parameters=rope,
    )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, n, d]; cos/sin: [b, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Block self-attention with the injected context K/V prefix (non-causal).

    ``batch_invariant`` (attribute, off by default): attend through
    ``kernels.invariant.attention``, so a block's drafts do not depend on the other blocks of a
    batched call or on their context lengths."""

    batch_invariant: bool = False

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.sliding_window = (cfg.sliding_window
                               if cfg.layer_types[layer_idx] == "sliding_attention" else None)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LayerKV:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LayerKV:
        """K/V of projected context vectors ``ctx`` [b, n, H] at the positions of ``cos``/``sin``."""
        return self._kv(ctx, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_kv: LayerKV, mask: torch.Tensor | None) -> torch.Tensor:
        """x: [b, q, H] (normed block hidden); cos/sin: [b, q, d]; mask: bool [b, 1, q, n + q]."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k, v = self._kv(x, cos, sin)
        k = torch.cat([ctx_kv[0], k], dim=2)
        v = torch.cat([ctx_kv[1], v], dim=2)
        if self.batch_invariant:
            out = invariant_attention(q, k, v, mask, self.head_dim ** -0.5)     # [b, q, h, d]
            return self.o_proj(out.reshape(b, q_len, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention with context injection, then SwiGLU MLP."""

    def __init__(self, cfg: DrafterConfig, qcfg: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(qcfg)

    def forward(self, x, cos, sin, ctx_kv: LayerKV, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """DFlash drafter: ``fc``, ``hidden_norm``, ``layers.N``, ``norm`` (z-lab state-dict names).

    It has no embedding and no LM head: callers embed the block with the target's
    ``embed_tokens`` and read logits with the target's ``lm_head`` (see :class:`TargetHead`).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        qcfg = _qwen3_config(cfg)
        self.fc = nn.Linear(cfg.context_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, qcfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=qcfg)
        # DFlash2's re-ranker of the top candidates (dflash.core.dflash2); DFlash has none
        self.candidate_selector: CandidateSelector | None = None

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, n, head_dim] for absolute ``positions`` [b, n] (int64), dtype of ``like``."""
        return self.rotary_emb(like, positions)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        """Per-layer context K/V for raw tap ``features`` [b, n, len(ids)*H] at ``positions`` [b, n].

        Returns one ``(k, v)`` pair per layer, each ``[b, kv_heads, n, head_dim]``.
        """
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                ctx_kv: list[LayerKV], mask: torch.Tensor | None = None,
                context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the block through all layers.

        Args:
            block_embeds: [b, q, H] target embeddings of ``[anchor, MASK, ...]`` (q = B at
                inference; N*B when training N blocks per sequence at once).
            block_positions: [b, q] int64 absolute positions.
            ctx_kv: per-layer context K/V from :meth:`context_kv` (``n`` context positions).
            mask: optional bool [b, 1, q, n + q], True = may attend. None = attend everywhere
                (the inference case for one block with a full-attention drafter).
            context_positions: optional int64 [b, n], the absolute position of each context
                K/V column (read by sliding-window layers only). None = the ``n`` positions
                right before each block's anchor.
        Returns:
            [b, q, H] final-normed hidden states (apply the target LM head for logits).
        """
        cos, sin = self.rope(block_positions, block_embeds)
        x = block_embeds
        for layer, kv in zip(self.layers, ctx_kv):
            layer_mask = mask
            if layer.self_attn.sliding_window is not None:
                layer_mask = _and_masks(mask, self._window_mask(block_positions, kv, layer,
                                                                context_positions))
            x = layer(x, cos, sin, kv, layer_mask)
        return self.norm(x)

    def _window_mask(self, block_positions, kv, layer, ctx_pos=None) -> torch.Tensor:
        # Without ``ctx_pos`` the context is taken to end right before the block.
        if ctx_pos is None:
            n = kv[0].shape[2]
            q0 = block_positions[:, :1]                             # [b, 1] anchor position
            ctx_pos = q0 - n + torch.arange(n, device=q0.device)    # [b, n]
        key_pos = torch.cat([ctx_pos, block_positions], dim=1)      # [b, n + q]
        dist = block_positions[:, :, None] - key_pos[:, None, :]   # [b, q, n + q]
        return (dist < layer.self_attn.sliding_window).unsqueeze(1)


def _and_masks(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else (a & b)


class TargetHead(nn.Module):
    """The target's frozen input embedding and LM head, shared with the drafter.

    ``embed`` [V, H] and ``lm_head`` [V, H] are buffers (never trained). Tied targets pass the
    same tensor for both.
    """

    skinny_max_rows: int = 0
    skinny_packed: int = 0
    skinny_panel: int = 0
    skinny_invariant: bool = False
    embed: torch.Tensor        # [V, H] buffer
    lm_head: torch.Tensor      # [V, H] buffer

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [...] -> embeddings [..., H]."""
        return F.embedding(ids, self.embed)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (float32). ``weight`` [N, H]: a subset of the LM
        head's rows (a draft vocabulary, ``dflash.core.draft_vocab``) -> logits [..., N].
        ``skinny_max_rows`` (attribute, 0 = off), ``skinny_packed``, ``skinny_panel`` and
        ``skinny_invariant``: see ``kernels.skinny_linear``."""
        w = self.lm_head if weight is None else weight
        return skinny_linear(hidden, w, max_rows=self.skinny_max_rows,
                             packed=self.skinny_packed, panel=self.skinny_panel,
                             invariant=self.skinny_invariant).float()
