"""The target's layout as its transformers config gives it, read once into typed fields
(:class:`TargetLayout`: context length, RoPE base, K/V head geometry, attention layout), and the
position ids and attention mask of a forward under that attention layout
(:meth:`AttentionLayout.inputs`).

A transformers config is an open set of fields that differ by model type. :func:`config_fields`
turns it into one dict, so each optional field is read by name, with its default, in one place
(:func:`read_layout`, :func:`attention_layout`, :func:`num_experts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig

from verifier_svc.tree import ancestor_mask


def config_fields(config: PreTrainedConfig) -> dict[str, Any]:
    """``config``'s fields under the names attribute access takes: its own fields
    (``to_dict``) plus each alias its class's ``attribute_map`` gives one of them (e.g.
    ``num_local_experts`` for DeepSeek's ``n_routed_experts``)."""
    fields = config.to_dict()
    return fields | {alias: fields[name] for alias, name in config.attribute_map.items()
                     if name in fields}


@dataclass(frozen=True)
class AttentionLayout:
    """How the target's layers attend, as its model builds its masks."""

    #: "full_attention" / "sliding_attention" (one mask for every layer) or "mixed" (a dict
    #: of masks by layer type)
    kind: str
    #: the window of the sliding layers; None when no layer slides
    sliding_window: int | None

    def inputs(self, lens: list[int], q: int, width: int, trees: list[list[int] | None] | None
               ) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """Position ids int64 [b, q] and the attention mask, bool [b, 1, q, width] (a dict by
        layer type for mixed layouts), built on the host: causal from each row's own length,
        within the window for sliding-window layers (SDPA reads True = attend). Columns from
        ``max(lens) + q`` on are never attended, so ``width`` may be the pool's capacity.

        ``trees[i]`` (validated parents, or None = chain) turns row i's block part of the mask
        into its ancestor matrix and its position ids into ``lens[i] + depth``; the window then
        compares position ids, not cache slots. Chains-only steps build exactly the causal
        mask and nothing more."""
        b = len(lens)
        lens_t = torch.tensor(lens, dtype=torch.int64, device="cpu")
        pos = lens_t[:, None] + torch.arange(q, device="cpu")                 # [b, q]
        cols = torch.arange(width, device="cpu")
        col_pos = cols[None, :]                                               # [1 or b, L]
        causal = cols[None, None, :] <= pos[:, :, None]                       # [b, q, L]
        if trees is not None and any(t is not None for t in trees):
            col_pos = cols[None, :].repeat(b, 1)
            for i, tree in enumerate(trees):
                if tree is None:
                    continue
                m, start = len(tree), lens[i]
                anc, depth = _ancestors(tree)
                # block entries: ancestor-or-self only; padding queries (j >= m) keep causal
                causal[i, :m, start:start + m] = anc
                pos[i, :m] = start + depth
                col_pos[i, start:start + m] = start + depth
        masks = {"full_attention": causal}
        if self.sliding_window:     # set for every layout with sliding layers (attention_layout)
            masks["sliding_attention"] = causal & (col_pos[:, None, :] > pos[:, :, None] - self.sliding_window)
        if self.kind == "mixed":
            return pos, {k: m[:, None] for k, m in masks.items()}
        return pos, masks[self.kind][:, None]


@dataclass(frozen=True)
class TargetLayout:
    """What the target's config says beyond the fields every causal LM config has."""

    max_positions: int      # max_position_embeddings; 1 << 30 when the config has none
    rope_theta: float       # rope_parameters["rope_theta"], else rope_theta; 0.0 when neither
    head_dim: int           # head_dim; hidden_size // num_attention_heads when unset
    kv_heads: int           # num_key_value_heads; num_attention_heads when unset
    attention: AttentionLayout


def read_layout(config: PreTrainedConfig) -> TargetLayout:
    """The target's :class:`TargetLayout` from its loaded model's config: the optional fields
    ``max_position_embeddings``, ``rope_parameters`` / ``rope_theta``, ``head_dim``,
    ``v_head_dim`` (None), ``num_key_value_heads`` and those of :func:`attention_layout`, with
    the defaults :class:`TargetLayout` lists; ``hidden_size`` and ``num_attention_heads`` are
    required.

    Raises:
        ValueError: naming the field, for a layout the batch KV pool cannot hold
            (:func:`attention_layout`; ``v_head_dim`` other than ``head_dim``: multi-head latent
            attention).
    """
    fields = config_fields(config)
    rp = fields.get("rope_parameters") or {}
    attention = attention_layout(fields, config._attn_implementation)
    heads = config.num_attention_heads
    head_dim = fields.get("head_dim") or config.hidden_size // heads
    if fields.get("v_head_dim") not in (None, head_dim):
        raise ValueError(f"v_head_dim: keys ({head_dim}) and values ({fields['v_head_dim']}) of "
                         "different sizes (multi-head latent attention) do not fit the batch KV pool")
    return TargetLayout(
        max_positions=fields.get("max_position_embeddings", 1 << 30),
        rope_theta=float(rp.get("rope_theta", fields.get("rope_theta", 0.0)) or 0.0),
        head_dim=head_dim, kv_heads=fields.get("num_key_value_heads") or heads,
        attention=attention)


def attention_layout(fields: Mapping[str, Any], attn_implementation: str | None) -> AttentionLayout:
    """The attention layout of a config's ``fields`` (:func:`config_fields`), as its model builds
    its masks: ``attention_chunk_size`` (None), ``sliding_window`` (None),
    ``use_sliding_window`` (True), ``layer_types`` (None). Without ``layer_types`` a config with
    a ``sliding_window`` (and ``use_sliding_window`` not False) slides on every layer (Mistral).
    ``attn_implementation``: the loaded model's (``config._attn_implementation``).

    Raises:
        ValueError: naming the field, for layouts the pool's masks cannot express (chunked or
            linear attention, a non-SDPA kernel: the boolean mask is SDPA's form; eager
            attention would add it).
    """
    if attn_implementation != "sdpa":
        raise ValueError(f"attn_implementation: {attn_implementation!r}; the batch KV pool's masks "
                         "need 'sdpa'")
    if fields.get("attention_chunk_size"):
        raise ValueError("attention_chunk_size: chunked attention layers do not fit the batch KV pool")
    window = fields.get("sliding_window")
    if not fields.get("use_sliding_window", True):
        window = None
    types = set(fields.get("layer_types") or ["sliding_attention" if window else "full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types: {sorted(types)}; only full and sliding-window attention "
                         "layers fit the batch KV pool")
    if "sliding_attention" in types and not window:
        raise ValueError("sliding_window: required by sliding_attention layers")
    if len(types) == 2:
        return AttentionLayout("mixed", window)
    kind = types.pop()
    return AttentionLayout(kind, window if kind == "sliding_attention" else None)


def num_experts(config: PreTrainedConfig) -> int:
    """Experts per MoE layer: ``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen MoE);
    0 for a dense model."""
    fields = config_fields(config)
    return fields.get("num_local_experts") or fields.get("num_experts") or 0


def _ancestors(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor-or-self bool [m, m] (``verifier_svc.tree.ancestor_mask``), depth int64 [m]: the
    anchor 0) of a validated tree: a node's depth is how many ancestors it has. Built on the
    host, where the rest of the mask is (:meth:`AttentionLayout.inputs`)."""
    with torch.device("cpu"):
        anc = ancestor_mask(parents)
    return anc, anc.sum(1) - 1
