"""The in-process peer: transformers' own DFlash drafter (``MuseGlimmerAssistantModel``).

transformers 5.x drives DFlash through ``generate(..., assistant_model=..., speculation_type=
"dflash")``. Its drafter has the same network as z-lab's with other names. This module loads a
z-lab checkpoint into it (renames ``fc`` -> ``encoder.fc``, ``hidden_norm`` ->
``encoder.output_norm_enc``; lifts ``dflash_config`` keys to the top level; explicit
``layer_types``; rope settings as ``rope_parameters``) so that parity tests and ``dflash bench``
can compare against it with identical weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.core.config import DrafterConfig

RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def load_peer_drafter(path: str | Path, dtype: torch.dtype = torch.float32):
    """Return a ``MuseGlimmerAssistantModel`` holding the z-lab drafter at ``path``.

    Raises ImportError when the installed transformers has no DFlash support.
    """
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = DrafterConfig.from_pretrained(path)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    hcfg = MuseGlimmerAssistantConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=int(cfg.sliding_window or cfg.max_position_embeddings),
        layer_types=list(cfg.layer_types), block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = MuseGlimmerAssistantModel(hcfg)
    state = {RENAMES.get(k, k): v for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


@contextlib.contextmanager
def record_acceptance():
    """Record transformers' per-step accepted-draft counts during DFlash ``generate()``.

    Yields a list that receives, for every verify step after the first drafted one, the number
    of drafts transformers accepted (its ``n_last_matches``), in order. The hook is removed on
    exit. (transformers passes the previous step's matches to the next ``get_candidates`` call,
    so the very last step of a generation is not seen.)
    """
    from transformers.generation import candidate_generator as cg

    matches: list[int] = []
    orig = cg.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        if not is_first_iteration and not self.is_main_model_prefill:
            matches.append(int(n_last_matches))
        return orig(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)

    cg.DFlashTokenCandidateGenerator.get_candidates = recording
    try:
        yield matches
    finally:
        cg.DFlashTokenCandidateGenerator.get_candidates = orig
