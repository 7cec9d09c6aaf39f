"""Static check of a drafter directory against a target directory (nothing is run).

Each :class:`Finding` names the config field it is about. Errors make the pair unusable (the
verifier would refuse it, or the drafter would compute garbage); warnings are likely to cost
acceptance.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash.core.config import ConfigError, DrafterConfig, default_target_layer_ids
from dflash.core.proposer import MAX_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str      # "error" | "warning" | "ok"
    field: str
    message: str
    fix: str = ""   # the edit that would resolve it, when one is known

    def __str__(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.level.upper():7s} {self.field}: {self.message}{fix}"


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

    from dflash.core.checkpoint import _tensor_index

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
    err = lambda f, m, fix="": out.append(Finding("error", f, m, fix))     # noqa: E731
    warn = lambda f, m, fix="": out.append(Finding("warning", f, m, fix))  # noqa: E731
    ok = lambda f, m: out.append(Finding("ok", f, m))                      # noqa: E731
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
                     "hidden_states[i] vs output-of-layer-i off-by-one? (the live probe measures every shift)")
    if not bad and not any(o.field == f for o in out):
        ok(f, f"{ids} within 0..{n_layers - 1}")

    # mask token
    f = "dflash_config.mask_token_id"
    specials = {"eos_token_id": _ids(t.get("eos_token_id")), "bos_token_id": _ids(t.get("bos_token_id")),
                "pad_token_id": _ids(t.get("pad_token_id"))}
    clash = [k for k, v in specials.items() if d.mask_token_id in v]
    if clash:
        warn(f, f"{d.mask_token_id} is the target's {clash[0]}: a token of real text, not a "
             "reserved one (the live probe tries the target's special tokens)")
    else:
        _mask_vs_tokenizer(d.mask_token_id, target_dir, out)

    # rope
    t_theta, t_kind = _rope(t)
    d_kind = (d.rope_scaling or {}).get("rope_type") or (d.rope_scaling or {}).get("type") or "default"
    if abs(d.rope_theta - t_theta) > 1e-6 * max(1.0, t_theta):
        warn("rope_theta", f"drafter {d.rope_theta:g}, target {t_theta:g} (DFlash drafters "
             "use the target's rope; the live probe measures both)",
             f"in config.json set rope_theta to {t_theta:g} if the drafter was trained so")
    else:
        ok("rope_theta", f"{t_theta:g}")
    if d_kind != t_kind:
        warn("rope_scaling", f"drafter rope type {d_kind!r}, target {t_kind!r}",
             "in config.json copy the target's rope_scaling")
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
    _sliding_layout(drafter_dir, d, t, out)

    if d.is_dflash2:
        _dflash2_check(d, out)

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


def _dflash2_check(d: DrafterConfig, out: list[Finding]) -> None:
    """DFlash2's own fields (the config parser has refused invalid ones, naming them)."""
    out.append(Finding("ok", "architectures",
                       f"DFlash2DraftModel: conv {d.conv_kernel_size} taps in groups of "
                       f"{d.conv_group_size} ({d.hidden_size // d.conv_group_size} dynamic kernels "
                       f"a row), selector top-{d.selector_top_k} at rank {d.selector_rank}, "
                       f"softcap {d.final_logit_softcapping or 'off'}, output multiplier "
                       f"{d.output_multiplier:g}, input embedding scale {d.input_embedding_scale:g}"))
    if d.selector_top_k == 1:
        out.append(Finding("warning", "dflash_config.selector_top_k",
                           "1: the selector has one candidate per slot and chooses nothing "
                           "(chains are the head's argmax)"))


def _check_weights(drafter_dir: Path, target_dir: Path, d: DrafterConfig, t: dict,
                   out: list[Finding]) -> None:
    from dflash.core.checkpoint import load_drafter, load_target_head, target_fingerprint

    if _own_head(drafter_dir, target_dir, out):
        return
    try:
        load_drafter(drafter_dir)
        out.append(Finding("ok", "model.safetensors", "every tensor present with the config's shape"))
    except (ConfigError, FileNotFoundError) as e:
        out.append(Finding("error", getattr(e, "field", "model.safetensors"), str(e)))
    head = load_target_head(target_dir)
    fp = target_fingerprint(t, head.embed)
    if d.target_fingerprint and fp != d.target_fingerprint:
        out.append(Finding("warning", "dflash_serve.target_fingerprint",
                           f"drafter was built for {d.target_fingerprint}, this target is {fp}: "
                           "another target (or another revision of it)",
                           "serve the drafter built for this target, or retrain against it"))
    elif d.target_fingerprint:
        out.append(Finding("ok", "dflash_serve.target_fingerprint", fp))
    _card_check(d, t, fp, out)
    _draft_vocab_check(drafter_dir, d, out)


# Tensor names under which a checkpoint ships an LM head or an input embedding of its own.
HEAD_TENSORS = ("lm_head.weight", "model.lm_head.weight")
EMBED_TENSORS = ("embed_tokens.weight", "model.embed_tokens.weight")


def own_head_tensors(drafter_dir: Path) -> dict[str, "object"]:
    """Tensors of ``model.safetensors`` that are an LM head or embedding of the drafter's own
    (name -> tensor); a DFlash drafter reads the target's (``dflash.core.modeling.TargetHead``)."""
    from safetensors import safe_open

    path = Path(drafter_dir) / "model.safetensors"
    if not path.is_file():
        return {}
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k in HEAD_TENSORS + EMBED_TENSORS}


def _own_head(drafter_dir: Path, target_dir: Path, out: list[Finding]) -> bool:
    """An error per own head / embedding tensor, saying whether it equals the target's.
    Returns True when there was one (the strict loader would refuse the file)."""
    from dflash.core.checkpoint import load_target_head

    extra = own_head_tensors(drafter_dir)
    if not extra:
        return False
    head = load_target_head(target_dir)
    for name, w in extra.items():
        ref = head.lm_head if name in HEAD_TENSORS else head.embed
        what = "LM head" if name in HEAD_TENSORS else "input embedding"
        if tuple(w.shape) == tuple(ref.shape) and bool((w.float() - ref).abs().max() <= 1e-3):
            out.append(Finding("error", f"model.safetensors:{name}",
                               f"the drafter ships its own {what}, equal to the target's: the "
                               "server reads the target's and refuses the extra tensor",
                               f"drop {name} from model.safetensors"))
        else:
            out.append(Finding("error", f"model.safetensors:{name}",
                               f"the drafter ships its own {what} {list(w.shape)}, not the "
                               f"target's: it was trained with it, while this server always "
                               f"drafts through the target's (the live probe compares both)",
                               "fine-tune the drafter with the target's frozen LM head and "
                               "embedding (python -m dflash.train --init-from DIR)"))
    return True


def _mask_vs_tokenizer(mask_id: int, target_dir: Path, out: list[Finding]) -> None:
    """The mask token should be one that never occurs in text: a special token of the target's
    tokenizer or an id past its vocabulary (an unused embedding row)."""
    f = "dflash_config.mask_token_id"
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError):
        out.append(Finding("ok", f, f"{mask_id} (no tokenizer in the target directory to check)"))
        return
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    if mask_id in specials:
        out.append(Finding("ok", f, f"{mask_id} = special token {tok.convert_ids_to_tokens(mask_id)!r}"))
    elif mask_id >= len(tok):
        out.append(Finding("ok", f, f"{mask_id}: an id the tokenizer never produces"))
    else:
        out.append(Finding("warning", f, f"{mask_id} is the ordinary token "
                           f"{tok.convert_ids_to_tokens(mask_id)!r}: mask tokens are reserved "
                           "ones (the live probe tries the target's special tokens)"))


def target_window(t: dict) -> int | None:
    """The target's sliding window when any of its layers slides (its config's reading)."""
    window = t.get("sliding_window")
    types = t.get("layer_types") or []
    if not window or t.get("use_sliding_window") is False:
        return None
    return int(window) if (not types or "sliding_attention" in types) else None


def raw_sliding(drafter_dir: Path) -> tuple[list[str], int | None, bool]:
    """(layer_types, sliding_window, use_sliding_window) as written in the drafter's
    config.json, before :class:`DrafterConfig` resolves them."""
    raw = json.loads((Path(drafter_dir) / "config.json").read_text())
    return list(raw.get("layer_types") or []), raw.get("sliding_window"), \
        raw.get("use_sliding_window", True) is not False


def _sliding_layout(drafter_dir: Path, d: DrafterConfig, t: dict, out: list[Finding]) -> None:
    """Sliding-window layers the config lists but the loader runs as full attention, and a
    target that slides while the drafter does not (vLLM PR #40898 treated a drafter's sliding
    layers as full attention: correct text, lost acceptance)."""
    types, window, use = raw_sliding(drafter_dir)
    n_sliding = types.count("sliding_attention")
    if n_sliding and not use:
        out.append(Finding("warning", "use_sliding_window",
                           f"false, while layer_types lists {n_sliding} sliding_attention layers "
                           f"(window {window}): they run as full attention (the live probe "
                           "measures both)", "in config.json set use_sliding_window to true if "
                           "the drafter was trained with sliding layers"))
    tw = target_window(t)
    if tw and "sliding_attention" not in d.layer_types:
        out.append(Finding("ok", "layer_types", f"every drafter layer full attention; the target "
                           f"slides (window {tw}) on some layers (the live probe tries both)"))


def _card_check(d: DrafterConfig, t: dict, fp: str, out: list[Finding]) -> None:
    """What the verifier itself says of this drafter (``dflash.core.cards``)."""
    from types import SimpleNamespace

    from dflash.core.cards import check_drafter_card
    from dflash.core.proposer import DrafterCard
    from verifier_svc.request import PreconditionError

    card = DrafterCard(name=d.name, version=d.version, block_size=d.block_size,
                       mask_token_id=d.mask_token_id, target_layer_ids=tuple(d.target_layer_ids),
                       hidden_size=d.hidden_size, vocab_size=d.vocab_size, dtype=d.dtype,
                       target_fingerprint=d.target_fingerprint,
                       num_hidden_layers=d.num_hidden_layers, rope_theta=d.rope_theta)
    target = SimpleNamespace(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"],
                             num_layers=t["num_hidden_layers"], fingerprint=fp,
                             rope_theta=_rope(t)[0])
    try:
        warnings = check_drafter_card(card, target)
    except PreconditionError as e:
        out.append(Finding("error", "card", f"the verifier refuses this drafter: {e}"))
        return
    out.append(Finding("ok", "card", "the verifier accepts this drafter" +
                       (f" with {len(warnings)} warning(s)" if warnings else "")))


def _draft_vocab_check(drafter_dir: Path, d: DrafterConfig, out: list[Finding]) -> None:
    from dflash.core.draft_vocab import FILE, load_draft_vocab

    try:
        ids = load_draft_vocab(drafter_dir, d.vocab_size)
    except ValueError as e:
        out.append(Finding("error", "draft_vocab", str(e), f"rebuild or delete {FILE}"))
        return
    if ids is not None:
        out.append(Finding("ok", "draft_vocab", f"{ids.numel()} of {d.vocab_size} ids (the live "
                           "probe measures its coverage of the target's tokens)"))
