"""The target as training uses it: float32 transformers model and tokenizer, safetensors only.

float32 is the dtype the verifier serves on a CPU (``--dtype`` default), so generated answers
and recomputed features are the served target's (:mod:`dflash.train.datagen`,
:mod:`dflash.train.featcache`).
"""

from __future__ import annotations

import torch


def load_target(target_dir: str, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` of the target directory (``use_safetensors``, no remote code);
    float32 unless ``dtype`` says otherwise (bf16 generation: :mod:`dflash.train.datagen`), on
    ``device`` (``model.device``; callers put their inputs there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype,
                                                 use_safetensors=True).eval()
    return model.to(device), tok
