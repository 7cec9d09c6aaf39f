"""Trainer checkpoints without pickle: tensors in safetensors, everything else in JSON.

``<run_dir>/ckpt.safetensors`` holds ``drafter.<param>``, ``opt.<index>.<key>`` (AdamW state),
``torch_rng`` and ``vocab``; ``<run_dir>/ckpt.json`` holds step, elapsed seconds, epoch, data
order, the ``random.Random`` state, the train config, the shard list and the optimizer's
param_groups. Both are written to temporary names and renamed, the JSON last, and the JSON
records the step the tensors belong to, so a crash between the two renames is detected.
Nothing here calls ``torch.load`` (project rule: never unpickle a file a user can hand us).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TENSORS, META = "ckpt.safetensors", "ckpt.json"


def save(run_dir: Path, *, drafter: dict[str, torch.Tensor], opt: dict, tensors: dict[str, torch.Tensor],
         meta: dict) -> None:
    """Write one checkpoint. ``opt`` is ``optimizer.state_dict()``; ``meta`` must be JSON-able
    (it gains ``param_groups``); ``tensors`` are extra named tensors (RNG state, vocab).

    Every tensor is written from the host, so a checkpoint taken on a GPU loads anywhere
    (:func:`load` returns CPU tensors; ``load_state_dict`` copies them to the model's device)."""
    flat = {f"drafter.{k}": v.detach().cpu().contiguous() for k, v in drafter.items()}
    for idx, st in opt["state"].items():
        for key, v in st.items():
            flat[f"opt.{idx}.{key}"] = (v.cpu() if torch.is_tensor(v) else torch.tensor(v, device="cpu")).contiguous()
    flat.update({k: v.cpu().contiguous() for k, v in tensors.items()})
    step = str(meta["step"])
    tmp = run_dir / (TENSORS + ".tmp")
    save_file(flat, str(tmp), metadata={"step": step})
    tmp.replace(run_dir / TENSORS)
    doc = dict(meta, param_groups=opt["param_groups"])
    tmp = run_dir / (META + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(run_dir / META)


def load(run_dir: Path) -> tuple[dict, dict[str, torch.Tensor], dict, dict[str, torch.Tensor]] | None:
    """``(meta, drafter_state, optimizer_state, extra_tensors)`` or None when there is none.

    Raises ``ValueError`` when the two files belong to different steps (a torn write).
    """
    mp, tp = run_dir / META, run_dir / TENSORS
    if not (mp.is_file() and tp.is_file()):
        return None
    meta = json.loads(mp.read_text())
    from safetensors import safe_open

    with safe_open(str(tp), "pt") as f:
        step = (f.metadata() or {}).get("step")
    if step != str(meta["step"]):
        raise ValueError(f"checkpoint: {tp} is for step {step}, {mp} for step {meta['step']}")
    flat = load_file(str(tp))
    drafter = {k[len("drafter."):]: v for k, v in flat.items() if k.startswith("drafter.")}
    state: dict[int, dict] = {}
    for k, v in flat.items():
        if k.startswith("opt."):
            _, idx, key = k.split(".", 2)
            state.setdefault(int(idx), {})[key] = v
    extra = {k: v for k, v in flat.items() if not k.startswith(("drafter.", "opt."))}
    return meta, drafter, {"state": state, "param_groups": meta.pop("param_groups")}, extra
