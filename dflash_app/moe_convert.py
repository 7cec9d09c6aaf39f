"""An exact mixture-of-experts form of a dense Llama-style target (``dflash convert-moe``).

Each dense MLP ``down(silu(gate x) * up x)`` with intermediate size ``I`` becomes a Mixtral
sparse-MoE block with ``E`` experts of intermediate size ``I / E``: expert ``e`` holds rows
``e*I/E .. (e+1)*I/E`` of ``gate``/``up`` and the matching columns of ``down``, scaled by ``E``.
The router weights are zero and top-k = E, so softmax gives every expert weight exactly ``1/E``
(Mixtral renormalises the top-k weights: still ``1/E``) and the block output is

    sum_e (1/E) * (E * down_e) (silu(gate_e x) * up_e x) = down(silu(gate x) * up x),

the dense MLP (``E`` a power of two keeps the scaling exact in floating point; only the summation
order of the down projection changes, ~1e-6 relative). Attention, norms, embeddings and the head
are copied unchanged, so the same trained drafter serves the converted target.

Usage: ``python -m dflash_app.moe_convert SRC DST [--experts 8]`` (or ``dflash convert-moe``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "special_tokens_map.json")
# Config fields that carry over from a Llama config to Mixtral unchanged.
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                 "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id", "pad_token_id", "initializer_range")


def moe_config(dense: dict, num_experts: int) -> dict:
    """The Mixtral config.json dict for ``dense`` (a Llama-style config dict)."""
    if dense.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"model_type {dense.get('model_type')!r}: only Llama-style dense MLPs "
                         "(gate/up/down, no bias) convert")
    if dense.get("mlp_bias") or dense.get("attention_bias"):
        raise ValueError("biased MLP/attention projections do not map onto Mixtral")
    inter = dense["intermediate_size"]
    if num_experts < 1 or num_experts & (num_experts - 1) or inter % num_experts:
        raise ValueError(f"--experts {num_experts}: must be a power of two dividing "
                         f"intermediate_size {inter}")
    cfg = {k: dense[k] for k in SHARED_FIELDS if k in dense}
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
               intermediate_size=inter // num_experts, num_local_experts=num_experts,
               num_experts_per_tok=num_experts, sliding_window=None, router_jitter_noise=0.0,
               output_router_logits=False, dtype=dense.get("dtype", "float32"))
    return cfg


@torch.no_grad()
def convert(src: str | Path, dst: str | Path, *, num_experts: int = 8) -> Path:
    """Write the exact MoE form of the dense target at ``src`` to ``dst``; returns ``dst``."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    src, dst = Path(src), Path(dst)
    dense_cfg = json.loads((src / "config.json").read_text())
    cfg = MixtralConfig(**{k: v for k, v in moe_config(dense_cfg, num_experts).items()
                           if k not in ("model_type", "architectures")})
    dense = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                 use_safetensors=True)
    moe = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = dense.state_dict()
    missing = moe.load_state_dict({k: v for k, v in sd.items() if ".mlp." not in k}, strict=False)
    e, part = num_experts, cfg.intermediate_size
    for i, layer in enumerate(moe.model.layers):
        g = sd[f"model.layers.{i}.mlp.gate_proj.weight"]      # [I, H]
        u = sd[f"model.layers.{i}.mlp.up_proj.weight"]        # [I, H]
        d = sd[f"model.layers.{i}.mlp.down_proj.weight"]      # [H, I]
        layer.mlp.gate.weight.zero_()                         # [E, H]: uniform routing
        layer.mlp.experts.gate_up_proj.copy_(torch.stack(     # [E, 2 * I/E, H]
            [torch.cat([g[j * part:(j + 1) * part], u[j * part:(j + 1) * part]]) for j in range(e)]))
        layer.mlp.experts.down_proj.copy_(torch.stack(        # [E, H, I/E]
            [d[:, j * part:(j + 1) * part] * e for j in range(e)]))
    left = [k for k in missing.missing_keys if ".mlp." not in k and k != "lm_head.weight"]
    if left:
        raise RuntimeError(f"weights not carried over: {left}")
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    dst.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(str(dst))
    for name in COPY_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_app.moe_convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    a = p.parse_args(argv)
    return run(a)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", help="dense target dir (default: the SmolLM2 target)")
    p.add_argument("dst", nargs="?", help="output dir (default: <cache>/smollm2-135m-instruct-moe<E>)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (power of two)")


def run(a) -> int:
    from dflash.train.target_setup import default_cache_dir, setup_target

    src = a.src or str(setup_target())
    dst = a.dst or str(default_cache_dir() / f"smollm2-135m-instruct-moe{a.experts}")
    print(convert(src, dst, num_experts=a.experts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
