"""Load and save drafters (z-lab format) and read the target tensors a drafter reuses.

Weights are read with safetensors only; nothing here unpickles (no ``torch.load``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.core.config import ConfigError, DrafterConfig
from dflash.core.modeling import DFlashDrafter, TargetHead


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The network ``cfg`` describes (a DFlash2 drafter for ``DFlash2DraftModel``), untrained."""
    if cfg.is_dflash2:
        from dflash.core.dflash2 import DFlash2Drafter

        return DFlash2Drafter(cfg)
    return DFlashDrafter(cfg)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | 'float64' -> torch dtype. Raises ConfigError."""
    name = name.replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError("dtype", f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load ``<path>/config.json`` + ``<path>/model.safetensors`` (z-lab names, strict); a
    ``DFlash2DraftModel`` config gives a ``dflash.core.dflash2.DFlash2Drafter``.

    Raises FileNotFoundError, ConfigError (bad config) or ConfigError naming the tensor when a
    weight is missing, unexpected, or has the wrong shape.
    """
    path = Path(path)
    cfg = DrafterConfig.from_pretrained(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"drafter weights not found: {weights}")
    state = load_file(str(weights))
    model = build_drafter(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ConfigError(f"model.safetensors:{missing[0]}", f"missing tensor ({len(missing)} missing)")
    if unexpected:
        raise ConfigError(f"model.safetensors:{unexpected[0]}", "unexpected tensor")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ConfigError(f"model.safetensors:{k}",
                              f"shape {tuple(v.shape)} does not match config {tuple(expected[k].shape)}")
    model.load_state_dict(state, strict=True)
    model.to(dtype or torch_dtype(cfg.dtype))
    return model.eval()


def save_drafter(model: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.float32,
                 cfg: DrafterConfig | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the z-lab layout (tensors in ``dtype``,
    copied to the host first, whatever device the model is on)."""
    import dataclasses

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = cfg or model.cfg
    dname = [k for k, v in DTYPES.items() if v == dtype][0]
    cfg = dataclasses.replace(cfg, dtype=dname)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()
             if not k.startswith("rotary_emb")}    # from the host: a GPU-trained drafter loads anywhere
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def _tensor_index(target_dir: Path) -> dict[str, Path]:
    idx = target_dir / "model.safetensors.index.json"
    if idx.is_file():
        wm = json.loads(idx.read_text())["weight_map"]
        return {k: target_dir / v for k, v in wm.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {target_dir}")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def _read(index: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    for n in names:
        if n in index:
            with safe_open(str(index[n]), "pt") as f:
                return f.get_tensor(n)
    return None


def load_target_head(target_dir: str | Path, dtype: torch.dtype = torch.float32) -> TargetHead:
    """Read only ``embed_tokens`` and ``lm_head`` from the target checkpoint's safetensors.

    Tied targets (``tie_word_embeddings`` or no ``lm_head.weight``) reuse the embedding.
    Raises FileNotFoundError when the target has no safetensors or no embedding tensor.
    """
    target_dir = Path(target_dir)
    index = _tensor_index(target_dir)
    embed = _read(index, ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                          "embed_tokens.weight"))
    if embed is None:
        raise FileNotFoundError(f"no embed_tokens tensor in {target_dir}")
    head = _read(index, ("lm_head.weight",))
    cfg = json.loads((target_dir / "config.json").read_text())
    if head is None or cfg.get("tie_word_embeddings", False):
        head = embed
    return TargetHead(embed.to(dtype), head.to(dtype))


def target_fingerprint(target_config: dict, embed: torch.Tensor) -> str:
    """Short fingerprint of a target: its architecture fields and its first embedding rows.

    Two targets with the same fingerprint share shapes and embedding table, so a drafter trained
    for one serves the other. Returns ``"sha256:<16 hex>"``.
    """
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads")
    h = hashlib.sha256(json.dumps({k: target_config.get(k) for k in keys}, sort_keys=True).encode())
    h.update(embed[:16].float().contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:16]
