"""Verification math behind one dispatching entry point per operation.

On CUDA tensors the Triton kernel runs (when triton is importable); elsewhere the torch reference
in :mod:`kernels.reference`. Both have the same signature and semantics.
"""

from kernels.reference import greedy_accept, pack_features, rejection_sample, unpack_features

__all__ = ["greedy_accept", "rejection_sample", "pack_features", "unpack_features"]
