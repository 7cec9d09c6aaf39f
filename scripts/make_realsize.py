#!/usr/bin/env python3
"""Random-weight checkpoints with real shapes, written where they will be served (no model hub).

    python scripts/make_realsize.py --out /tmp/realsize              # on the GPU when there is one
    python scripts/make_realsize.py --out /tmp/tiny --tiny --device cpu   # same code, tiny dims

Writes ``OUT/target`` (a transformers ``Qwen3ForCausalLM`` checkpoint: config.json,
generation_config.json, safetensors shards + index) and ``OUT/drafter`` (the z-lab DFlash layout:
config.json + model.safetensors) for that target. Real shapes: the target is Qwen3-8B (hidden
4096, 36 layers, intermediate 12288, 32 heads / 8 KV heads, head_dim 128, vocab 151936, RoPE
theta 1e6, bf16), the drafter z-lab's Qwen3-8B-DFlash-b16 (5 layers of the same widths, taps
[1, 9, 17, 25, 33], block 16, mask id 151669). ``--tiny`` keeps every code path and shrinks the
dimensions (CPU tests, the GPU script's dry run).

Weights are drawn on ``--device`` (``torch.empty`` + ``normal_``: on a GPU the 8B parameters
take a second; they never travel over the network) and written shard by shard, so host memory
holds one shard (``--shard-gb``) at a time. Names and shapes come from the models built on the
``meta`` device: exactly what the loaders expect. Norm weights are ones, everything else
N(0, ``--std``). No tokenizer is written: the services take token ids (the bench sends ids to
the verifier), and the real Qwen3 tokenizer is not available offline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout uninstalled

# Qwen3-8B (transformers Qwen3Config) and z-lab Qwen3-8B-DFlash-b16.
REAL = {"hidden": 4096, "layers": 36, "intermediate": 12288, "heads": 32, "kv_heads": 8,
        "head_dim": 128, "vocab": 151936, "max_positions": 40960, "eos": 151645,
        "drafter_layers": 5, "taps": [1, 9, 17, 25, 33], "block": 16, "mask_id": 151669}
# The same structure, small enough for a CPU test: taps spread over the layers as in REAL.
TINY = {"hidden": 64, "layers": 6, "intermediate": 192, "heads": 4, "kv_heads": 2,
        "head_dim": 16, "vocab": 1024, "max_positions": 4096, "eos": 1000,
        "drafter_layers": 2, "taps": [1, 2, 3, 4, 5], "block": 16, "mask_id": 1001}
ROPE_THETA = 1e6


def target_config(dims: dict, dtype: torch.dtype):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=dims["vocab"], hidden_size=dims["hidden"],
                       intermediate_size=dims["intermediate"],
                       num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                       num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
                       max_position_embeddings=dims["max_positions"], rms_norm_eps=1e-6,
                       tie_word_embeddings=False, eos_token_id=dims["eos"],
                       bos_token_id=None, pad_token_id=None, dtype=dtype,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       architectures=["Qwen3ForCausalLM"])


def drafter_config(dims: dict, dtype: torch.dtype):
    from dflash.core.config import DrafterConfig

    return DrafterConfig(hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                         num_hidden_layers=dims["drafter_layers"],
                         num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                         head_dim=dims["head_dim"], rms_norm_eps=1e-6, rope_theta=ROPE_THETA,
                         max_position_embeddings=dims["max_positions"], vocab_size=dims["vocab"],
                         block_size=dims["block"], mask_token_id=dims["mask_id"],
                         target_layer_ids=tuple(dims["taps"]), num_target_layers=dims["layers"],
                         dtype=str(dtype).replace("torch.", ""), name="realsize-dflash-b16",
                         version="random")


def _shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """State-dict names and shapes of a model built on the meta device (persistent only)."""
    return {k: v.shape for k, v in model.state_dict().items() if not k.startswith("rotary_emb")}


def _draw(name: str, shape, *, dtype, device, gen, std) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def write_target(out: Path, dims: dict, *, dtype, device, seed: int, std: float,
                 shard_bytes: int) -> dict:
    """``out`` as a sharded safetensors checkpoint; returns {"params", "bytes", "shards"}."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = target_config(dims, dtype)
    with torch.device("meta"):
        shapes = _shapes(Qwen3ForCausalLM(cfg))
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, shard, size, files, total, params = {}, {}, 0, [], 0, 0

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in shapes.items():
        t = _draw(name, shape, dtype=dtype, device=device, gen=gen, std=std).cpu()
        if size and size + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
        params += t.numel()
    flush()
    # The shards' final names carry the count (transformers' layout): rename once it is known.
    n = len(files)
    for i, name in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    cfg.save_pretrained(str(out))
    GenerationConfig(eos_token_id=dims["eos"], do_sample=False).save_pretrained(str(out))
    return {"params": params, "bytes": total, "shards": n}


def write_drafter(out: Path, dims: dict, *, dtype, device, seed: int, std: float) -> dict:
    """``out`` in the z-lab layout (one model.safetensors); returns {"params", "bytes"}."""
    from safetensors.torch import save_file

    from dflash.core.modeling import DFlashDrafter

    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(dims, dtype)
    with torch.device("meta"):
        shapes = _shapes(DFlashDrafter(cfg))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    state = {k: _draw(k, s, dtype=dtype, device=device, gen=gen, std=std).cpu()
             for k, s in shapes.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return {"params": sum(t.numel() for t in state.values()),
            "bytes": sum(t.nbytes for t in state.values())}


def parse_args(argv=None) -> argparse.Namespace:
    from dflash.core.device import device_flag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for target/ and drafter/")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions, same code path")
    p.add_argument("--device", type=device_flag, default="auto",
                   help="where the weights are drawn: auto (the GPU when there is one) | cpu | "
                        "cuda | cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="weights' standard deviation")
    p.add_argument("--shard-gb", type=float, default=4.0, help="target shard size, GB")
    p.add_argument("--skip-existing", action="store_true",
                   help="keep a target/ or drafter/ already written (config.json present)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from dflash.core.device import resolve_device

    a = parse_args(argv)
    device = resolve_device(a.device)
    dtype = getattr(torch, a.dtype)
    dims = TINY if a.tiny else REAL
    out = Path(a.out)
    report = {"dims": "tiny" if a.tiny else "real (Qwen3-8B / z-lab Qwen3-8B-DFlash-b16)",
              "device": str(device), "dtype": a.dtype}
    t0 = time.perf_counter()
    if not (a.skip_existing and (out / "target" / "config.json").is_file()):
        report["target"] = write_target(out / "target", dims, dtype=dtype, device=device,
                                        seed=a.seed, std=a.std,
                                        shard_bytes=int(a.shard_gb * 2**30))
    report["target_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    if not (a.skip_existing and (out / "drafter" / "config.json").is_file()):
        report["drafter"] = write_drafter(out / "drafter", dims, dtype=dtype, device=device,
                                          seed=a.seed, std=a.std)
    report["drafter_s"] = round(time.perf_counter() - t0, 2)
    (out / "realsize.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
