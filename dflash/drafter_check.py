"""Static check of a drafter directory against a target directory (nothing is run).

Each :class:`Finding` names the config field it is about. Errors make the pair unusable (the
verifier would refuse it, or the drafter would compute garbage); warnings are likely to cost
acceptance.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash.config import ConfigError, DrafterConfig, default_target_layer_ids

MAX_BLOCK_SIZE = 64   # verifier_svc.engine.MAX_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str      # "error" | "warning" | "ok"
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():7s} {self.field}: {self.message}"


def _target_config(target_dir: Path) -> dict:
    raw = json.loads((target_dir / "config.json").read_text())
    return raw.get("text_config", raw)


def _rope(cfg: dict) -> tuple[float, str]:
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {}
    kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def _tensor_rows(target_dir: Path, names: tuple[str, ...]) -> int | None:
    from safetensors import safe_open

    from dflash.checkpoint import _tensor_index

    index = _tensor_index(target_dir)
    for n in names:
        if n in index:
            with safe_open(str(index[n]), "pt") as f:
                return int(f.get_slice(n).get_shape()[0])
    return None


def _ids(x) -> set[int]:
    return set() if x is None else ({x} if isinstance(x, int) else set(x))


def check(drafter_dir: str | Path, target_dir: str | Path) -> list[Finding]:
    """All findings for the pair; errors first."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    out: list[Finding] = []
    err = lambda f, m: out.append(Finding("error", f, m))     # noqa: E731
    warn = lambda f, m: out.append(Finding("warning", f, m))  # noqa: E731
    ok = lambda f, m: out.append(Finding("ok", f, m))         # noqa: E731
    try:
        d = DrafterConfig.from_pretrained(drafter_dir)
    except (ConfigError, FileNotFoundError) as e:
        return [Finding("error", getattr(e, "field", "config.json"), str(e))]
    try:
        t = _target_config(target_dir)
    except FileNotFoundError as e:
        return [Finding("error", "target", str(e))]
    n_layers, hidden, vocab = t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]

    # hidden size and vocabulary / embedding rows
    if d.hidden_size != hidden:
        err("hidden_size", f"drafter {d.hidden_size}, target {hidden} (the drafter reuses the "
            "target's embedding and LM head)")
    else:
        ok("hidden_size", str(hidden))
    rows = _tensor_rows(target_dir, ("model.embed_tokens.weight",
                                     "model.language_model.embed_tokens.weight", "embed_tokens.weight"))
    head_rows = _tensor_rows(target_dir, ("lm_head.weight",))
    if d.vocab_size != vocab:
        err("vocab_size", f"drafter {d.vocab_size}, target config {vocab}")
    elif rows is not None and rows != d.vocab_size:
        err("vocab_size", f"drafter {d.vocab_size}, target embed_tokens has {rows} rows")
    elif head_rows is not None and head_rows != d.vocab_size:
        err("vocab_size", f"drafter {d.vocab_size}, target lm_head has {head_rows} rows")
    else:
        ok("vocab_size", f"{vocab} (embedding rows {rows})")

    # taps
    f = "dflash_config.target_layer_ids"
    ids = list(d.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        err(f, f"{bad} out of range for a {n_layers}-layer target (valid 0..{n_layers - 1}; id i is "
            "the output of decoder layer i = hidden_states[i + 1])")
    if len(set(ids)) != len(ids):
        warn(f, f"{ids} has duplicates")
    if ids != sorted(ids):
        warn(f, f"{ids} is not sorted (taps are concatenated in this order; fine only if trained so)")
    if n_layers - 1 in ids:
        warn(f, f"taps the last layer ({n_layers - 1}): its hidden state is taken after the final "
             "norm in transformers; DFlash drafters tap earlier layers")
    if d.num_target_layers and d.num_target_layers != n_layers:
        warn("num_target_layers", f"drafter was built for a {d.num_target_layers}-layer target, "
             f"this one has {n_layers}")
    # One tap says little (the default is just the middle layer); a shifted spread says a lot.
    default = default_target_layer_ids(n_layers, len(ids)) if n_layers > 3 and len(ids) > 1 else None
    if default and not bad:
        for delta in (-1, 1):
            if ids == [i + delta for i in default]:
                warn(f, f"{ids} = z-lab's default {default} shifted by {delta:+d}: the classic "
                     "hidden_states[i] vs output-of-layer-i off-by-one? (run the offset probe)")
    if not bad and not any(o.field == f for o in out):
        ok(f, f"{ids} within 0..{n_layers - 1}")

    # mask token
    f = "dflash_config.mask_token_id"
    specials = {"eos_token_id": _ids(t.get("eos_token_id")), "bos_token_id": _ids(t.get("bos_token_id")),
                "pad_token_id": _ids(t.get("pad_token_id"))}
    clash = [k for k, v in specials.items() if d.mask_token_id in v]
    if clash:
        warn(f, f"{d.mask_token_id} is the target's {clash[0]}")
    else:
        ok(f, str(d.mask_token_id))

    # rope
    t_theta, t_kind = _rope(t)
    d_kind = (d.rope_scaling or {}).get("rope_type") or (d.rope_scaling or {}).get("type") or "default"
    if abs(d.rope_theta - t_theta) > 1e-6 * max(1.0, t_theta):
        warn("rope_theta", f"drafter {d.rope_theta:g}, target {t_theta:g}")
    else:
        ok("rope_theta", f"{t_theta:g}")
    if d_kind != t_kind:
        warn("rope_scaling", f"drafter rope type {d_kind!r}, target {t_kind!r}")
    t_max = t.get("max_position_embeddings")
    if t_max and d.max_position_embeddings < t_max:
        warn("max_position_embeddings", f"drafter {d.max_position_embeddings} < target {t_max}: "
             "positions past it are out of the drafter's range")

    # sliding-window layers
    if "sliding_attention" in d.layer_types:
        if (d.sliding_window or 0) < d.block_size:
            err("sliding_window", f"{d.sliding_window} is smaller than the block ({d.block_size})")
        else:
            ok("layer_types", f"{d.layer_types.count('sliding_attention')} sliding layers, window "
               f"{d.sliding_window}")

    # block size
    if not 1 <= d.block_size <= MAX_BLOCK_SIZE:
        err("block_size", f"{d.block_size} not in [1, {MAX_BLOCK_SIZE}]")
    elif d.block_size == 1:
        warn("block_size", "1: the block is the anchor alone, nothing is drafted")
    else:
        ok("block_size", str(d.block_size))

    # weights and target fingerprint
    if not any(o.level == "error" for o in out):
        _check_weights(drafter_dir, target_dir, d, t, out)
    return sorted(out, key=lambda o: {"error": 0, "warning": 1, "ok": 2}[o.level])


def _check_weights(drafter_dir: Path, target_dir: Path, d: DrafterConfig, t: dict,
                   out: list[Finding]) -> None:
    from dflash.checkpoint import load_drafter, load_target_head, target_fingerprint

    try:
        load_drafter(drafter_dir)
        out.append(Finding("ok", "model.safetensors", "every tensor present with the config's shape"))
    except (ConfigError, FileNotFoundError) as e:
        out.append(Finding("error", getattr(e, "field", "model.safetensors"), str(e)))
    if d.target_fingerprint:
        fp = target_fingerprint(t, load_target_head(target_dir).embed)
        if fp != d.target_fingerprint:
            out.append(Finding("warning", "dflash_serve.target_fingerprint",
                               f"drafter was built for {d.target_fingerprint}, this target is {fp}"))
