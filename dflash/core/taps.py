"""Target context features ("taps") for the drafter.

Convention (z-lab ``extract_context_feature``, SpecForge, transformers' DFlash candidate
generator): ``target_layer_ids`` are 0-based decoder-layer indices and id ``i`` means *the output
of decoder layer i*, which is HF ``output_hidden_states`` entry ``hidden_states[i + 1]`` (entry 0
is the embedding output). Taps are concatenated on the last dim in ``target_layer_ids`` order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def hidden_state_indices(target_layer_ids: Sequence[int]) -> list[int]:
    """Indices into HF ``hidden_states`` for the given layer ids (``i -> i + 1``)."""
    return [i + 1 for i in target_layer_ids]


def tap_features(hidden_states: Sequence[torch.Tensor | None],
                 target_layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the tapped layers' outputs.

    Args:
        hidden_states: HF ``output_hidden_states`` tuple, entries ``[b, n, H]``.
        target_layer_ids: 0-based decoder-layer ids.
    Returns:
        ``[b, n, len(target_layer_ids) * H]`` in the hidden states' dtype.
    Raises:
        IndexError: a layer id is out of range for this target.
    """
    idx = hidden_state_indices(target_layer_ids)
    n_layers = len(hidden_states) - 1
    for i in target_layer_ids:
        if not 0 <= i < n_layers:
            raise IndexError(f"target_layer_ids: {i} out of range for a {n_layers}-layer target")
    return torch.cat([hidden_states[j] for j in idx], dim=-1)
