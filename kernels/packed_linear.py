"""Linear products on CPU with the weight prepacked once into oneDNN's blocked layout.

``F.linear`` hands a float32 weight to the BLAS in its stored row-major layout on every call,
and for the few rows of a decode or verify step (1..17) the kernels it reaches run far below
the machine's speed. oneDNN's inner-product primitive on a weight reordered once into its own
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the layout PyTorch's Inductor
freezes CPU linear layers into) streams each weight block once for all rows with register-
blocked kernels, faster at every row count measured than the transposed product
(:mod:`kernels.skinny_linear`) and ``F.linear`` (the figures: docs/kernels.md). Bfloat16
weights (the drafter's, on CPUs with bf16 instructions) gain too.

The packed copy is made at the first packed product and kept on the weight tensor itself
(``weight._dflash_packed``), keyed by the tensor's storage and version, so a weight changed in
place (a drafter reload) is packed again, and the copy lives and dies with the weight. It costs
one more copy of the weight's bytes (SmolLM2-135M: +540 MB float32 with the LM head).

The products compute the same dot products as ``F.linear`` in another summation order: results
differ in the last bits (< 2e-6 on a 576-wide float32 row), and, as with every other path, a
row's result may depend on how many rows share the call (the kernel's blocking), so a verify
block's logits may differ from a decode's in the last bits (the lossless tests show how
near-ties are handled).

Only plain CPU tensors of float32 (and bfloat16 where oneDNN runs bf16) outside autograd take
this path; everything else, and a build without oneDNN, keeps ``F.linear``. The torch reference
is ``F.linear``; ``tests/test_packed_linear.py`` compares them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: Attribute on a weight tensor holding ``(key, packed)``.
_ATTR = "_dflash_packed"


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """This torch build can run packed products of ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x @ weight.T`` can take the packed product: CPU, plain tensors of one supported dtype,
    no autograd graph to record (the packed op has no backward)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == weight.dtype and available(weight.dtype)
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.layout == torch.strided and weight.dim() == 2 and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of ``weight`` [out, in], made once per storage and version."""
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    held = getattr(weight, _ATTR, None)
    if held is None or held[0] != key:
        held = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        setattr(weight, _ATTR, held)
    return held[1]


def packed_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``weight`` prepacked (``F.linear`` itself where
    :func:`applies` is false).

    Args:
        x: [..., in_features].
        weight: [out_features, in_features], x's dtype.
        bias: [out_features] or None.
    Returns:
        [..., out_features], x's dtype, contiguous.
    Raises:
        RuntimeError: shape mismatch (from torch / oneDNN).
    """
    out = try_packed_linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def try_packed_linear(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`packed_linear`'s product, or None where :func:`applies` is false."""
    held = getattr(weight, _ATTR, None)
    # the common case, checked cheaply (a forward makes ~200 of these calls): this weight was
    # packed as it is now, x matches it, no autograd
    if (held is None or held[0][:2] != (weight.data_ptr(), weight._version)
            or x.dtype != weight.dtype or x.device.type != "cpu" or x.shape[-1] == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        if not applies(x, weight):
            return None
        held = (None, packed_weight(weight))
    return torch.ops.mkldnn._linear_pointwise(x, held[1], bias, "none", [], "")
