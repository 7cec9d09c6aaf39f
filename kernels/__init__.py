"""Verification math behind one dispatching entry point per operation.

On CUDA tensors the Triton kernel runs (when triton is importable); elsewhere the torch reference
in :mod:`kernels.reference`. Both have the same signature and semantics, and the kernels match the
references bit for bit (tests/test_kernels.py runs them under ``TRITON_INTERPRET=1``).

``DFLASH_KERNELS=reference`` in the environment (read once, at the first CUDA call) forces the
references everywhere, e.g. to rule a kernel out while debugging.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import SimpleNamespace

import torch

from kernels import reference

__all__ = ["greedy_accept", "rejection_sample", "pack_features", "unpack_features",
           "triton_kernels"]


@functools.cache
def triton_kernels() -> SimpleNamespace | None:
    """The Triton kernel modules, or None when triton is missing or disabled by the environment.

    Imported lazily so that importing :mod:`kernels` never imports triton (and so that a test can
    set ``TRITON_INTERPRET`` before the kernels are defined).
    """
    if os.environ.get("DFLASH_KERNELS", "").lower() == "reference":
        return None
    try:
        return SimpleNamespace(
            greedy=importlib.import_module("kernels.triton_greedy"),
            rejection=importlib.import_module("kernels.triton_rejection"),
            pack=importlib.import_module("kernels.triton_pack"))
    except ImportError:
        return None


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.reference.greedy_accept`."""
    if (_on_cuda(draft_tokens, target_logits) and (ops := triton_kernels()) is not None
            and ops.greedy.supports(draft_tokens, target_logits)):
        return ops.greedy.greedy_accept(draft_tokens, target_logits)
    return reference.greedy_accept(draft_tokens, target_logits)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, uniforms: torch.Tensor, exp_noise: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.reference.rejection_sample`."""
    args = (draft_tokens, draft_probs, target_probs, uniforms, exp_noise)
    if (_on_cuda(*args) and (ops := triton_kernels()) is not None
            and ops.rejection.supports(*args)):
        return ops.rejection.rejection_sample(*args)
    return reference.rejection_sample(*args)


def pack_features(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.reference.pack_features`."""
    if (features and _on_cuda(*features) and (ops := triton_kernels()) is not None
            and ops.pack.supports(features)):
        return ops.pack.pack_features(features)
    return reference.pack_features(features)


def unpack_features(buffer: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """See :func:`kernels.reference.unpack_features` (views on every device: no kernel needed)."""
    return reference.unpack_features(buffer, offsets)
