"""DFlash drafter configuration in the public z-lab checkpoint format.

The checkpoint's ``config.json`` uses Qwen3-style layer fields plus ``block_size`` and a
``dflash_config`` object with ``target_layer_ids`` and ``mask_token_id`` (z-lab/dflash
``dflash/model.py``; SpecForge ``configs/qwen3-8b-dflash.json``). Optional ``layer_types`` /
``sliding_window`` describe sliding-window drafter layers (Qwen3.6-family drafters).

A DFlash2 checkpoint (``architectures: ["DFlash2DraftModel"]``, Inco AI / z-lab, 2026) adds to
``dflash_config`` the grouped dynamic convolution (``conv_kernel_size`` taps, ``conv_group_size``
channels per dynamic kernel), the candidate selector (``selector_rank``, ``selector_top_k``) and
the candidate scalars ``final_logit_softcapping`` (0 / absent = off), ``output_multiplier`` and
``input_embedding_scale`` (1.0 when absent; read from ``dflash_config``, else the top level).

Two optional keys are ours and are ignored by other loaders: ``dflash_serve.name`` and
``dflash_serve.version`` (the drafter card), and ``dflash_serve.target_fingerprint``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dflash.core.errors import FieldError


class ConfigError(FieldError):
    """A config field is missing or invalid. ``field`` names it (dotted path)."""


DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                  "final_logit_softcapping", "output_multiplier", "input_embedding_scale")
_DFLASH2_REQUIRED = DFLASH2_FIELDS[:4]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Architecture and DFlash settings of a drafter.

    Attributes mirror the z-lab ``config.json``; ``target_layer_ids[i]`` is the 0-based index of a
    target decoder layer whose *output* is tapped (HF ``hidden_states[i + 1]``).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    dtype: str = "float32"
    name: str = "dflash-drafter"
    version: str = "0"
    target_fingerprint: str = ""
    architecture: str = DFLASH
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    final_logit_softcapping: float = 0.0
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter (grouped dynamic convolution + candidate selector)."""
        return self.architecture == DFLASH2

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        positive = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "block_size")
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f, f"must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", "must divide num_attention_heads")
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids", "must list at least one layer id")
        if any((not isinstance(i, int)) or i < 0 for i in self.target_layer_ids):
            raise ConfigError("dflash_config.target_layer_ids", "ids must be non-negative integers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError("dflash_config.mask_token_id",
                              f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError("layer_types", f"has {len(self.layer_types)} entries, "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError("layer_types", f"unknown layer type {t!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_window", "required when layer_types has sliding_attention")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"only 'silu' (SwiGLU) is supported, got {self.hidden_act!r}")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ConfigError("rope_theta", "must be a positive number")
        if self.architecture not in (DFLASH, DFLASH2):
            raise ConfigError("architectures", f"unknown drafter architecture {self.architecture!r}; "
                              f"use {DFLASH} or {DFLASH2}")
        if self.is_dflash2:
            _check_dflash2(self)

    @property
    def context_size(self) -> int:
        """Width of the concatenated tap features: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    # ------------------------------------------------------------------ z-lab json
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """Parse a z-lab ``config.json`` dict. Raises :class:`ConfigError` naming the field."""
        dc = d.get("dflash_config") or {}
        for key in ("target_layer_ids", "mask_token_id"):
            if key not in dc:
                raise ConfigError(f"dflash_config.{key}", "missing")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size", "block_size"):
            if key not in d:
                raise ConfigError(key, "missing")
        heads = d["num_attention_heads"]
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rp = d.get("rope_parameters")
        if rope_theta is None and isinstance(rp, dict):
            rope_theta = rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        layer_types = d.get("layer_types") or ()
        sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        if not d.get("use_sliding_window", True) and layer_types:
            layer_types = tuple("full_attention" for _ in layer_types)
        serve = d.get("dflash_serve") or {}
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            vocab_size=d["vocab_size"],
            block_size=d["block_size"],
            mask_token_id=dc["mask_token_id"],
            target_layer_ids=tuple(dc["target_layer_ids"]),
            num_target_layers=d.get("num_target_layers"),
            layer_types=tuple(layer_types),
            sliding_window=sliding,
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            name=serve.get("name", "dflash-drafter"),
            version=str(serve.get("version", "0")),
            target_fingerprint=serve.get("target_fingerprint", ""),
            **_dflash2_fields(d, dc),
        )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab ``config.json`` dict (plus our ``dflash_serve`` card keys)."""
        sliding = "sliding_attention" in self.layer_types
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window,
            "dtype": self.dtype,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                **({f: getattr(self, f) for f in DFLASH2_FIELDS} if self.is_dflash2 else {}),
            },
            "dflash_serve": {
                "name": self.name,
                "version": self.version,
                "target_fingerprint": self.target_fingerprint,
            },
        }

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DrafterConfig":
        """Read ``<path>/config.json``. Raises FileNotFoundError or :class:`ConfigError`."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"drafter config not found: {p}")
        return cls.from_dict(json.loads(p.read_text()))


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Spread ``num_taps`` tap ids evenly over ``[1, num_target_layers - 3]``.

    Same rule as z-lab ``build_target_layer_ids`` (one tap -> the middle layer). The last two
    layers are never tapped (HF's last ``hidden_states`` entry is post final norm).
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_taps - 1))) for i in range(num_taps)]


def _dflash2_fields(d: dict[str, Any], dc: dict[str, Any]) -> dict[str, Any]:
    """The DFlash2 keyword arguments of :class:`DrafterConfig` from a ``config.json`` dict
    (``{}`` for a DFlash drafter). Raises ConfigError naming a missing or causal field."""
    archs = d.get("architectures") or [DFLASH]
    if d.get("is_causal"):
        raise ConfigError("is_causal", "causal drafter layers are not supported (DFlash drafts "
                          "attend over the whole block)")
    if archs[0] != DFLASH2:
        return {"architecture": archs[0]}
    out: dict[str, Any] = {"architecture": DFLASH2}
    for f in _DFLASH2_REQUIRED:
        if f not in dc:
            raise ConfigError(f"dflash_config.{f}", "missing (required by DFlash2DraftModel)")
        out[f] = dc[f]
    for f, default in (("final_logit_softcapping", 0.0), ("output_multiplier", 1.0),
                       ("input_embedding_scale", 1.0)):
        v = dc.get(f, d.get(f))
        out[f] = float(default if v is None else v)
    return out


def _check_dflash2(c: DrafterConfig) -> None:
    for f in _DFLASH2_REQUIRED:
        v = getattr(c, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"dflash_config.{f}", f"must be a positive integer, got {v!r}")
    if c.hidden_size % c.conv_group_size:
        raise ConfigError("dflash_config.conv_group_size",
                          f"{c.conv_group_size} does not divide hidden_size {c.hidden_size}")
    if c.conv_kernel_size > c.block_size:
        raise ConfigError("dflash_config.conv_kernel_size",
                          f"{c.conv_kernel_size} taps exceed block_size {c.block_size}")
    if c.selector_top_k > c.vocab_size:
        raise ConfigError("dflash_config.selector_top_k",
                          f"{c.selector_top_k} exceeds vocab_size {c.vocab_size}")
    if not math.isfinite(c.final_logit_softcapping) or c.final_logit_softcapping < 0:
        raise ConfigError("dflash_config.final_logit_softcapping", "must be >= 0 (0 = off)")
    for f in ("output_multiplier", "input_embedding_scale"):
        v = getattr(c, f)
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"dflash_config.{f}", f"must be a positive number, got {v!r}")
