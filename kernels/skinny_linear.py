"""Skinny linear layers on CPU: ``x @ W.T`` for a few rows, computed as ``(W @ x.T).T``.

A verify forward multiplies every weight matrix by only ``k + 1`` rows (the anchor and the
drafts of one block). For such skinny products the CPU BLAS path behind ``F.linear`` on this
machine (MKL sgemm, 2 AVX2 cores) is far from memory speed, while the transposed product, where
the weight is the tall left operand, streams the weight once. Measured with SmolLM2-135M's 30
layers of weights (not cache-resident) in float32, median of 10:

=====  ==========  ============
rows   F.linear    (W @ x.T).T
=====  ==========  ============
1      29.2 ms     29.6 ms
2      48.3 ms     21.3 ms
5      48.5 ms     27.2 ms
9      58.3 ms     45.2 ms
17     63.9 ms     60.9 ms
=====  ==========  ============

and the 49152 x 576 LM head: 4 rows 19.7 -> 5.1 ms, 16 rows 20.6 -> 14.4 ms. One row gains
nothing, so :func:`skinny_linear` keeps ``F.linear`` there (and on every accelerator, and for
any dtype but float32, where the vendor library already picks its kernel). The gain is the
second core at work: on one thread (``torch.get_num_threads() == 1``) the transposed product
was slower (verify of 5 tokens 109 -> 133 ms), so one thread keeps ``F.linear`` too. Both compute the same
float32 dot products in a different summation order: results may differ in the last bits, as a
block forward already differs from one-token forwards (the verify path is not bit-identical to
decode anywhere in the field; see the lossless tests for how near-ties are handled).

The torch reference is ``F.linear`` itself; ``tests/test_skinny_linear.py`` compares them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Default row limit: up to 16 rows (a block of 16) the transposed product was faster above.
DEFAULT_MAX_ROWS = 16


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int = DEFAULT_MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(weight @ x2d.T).T`` when it has 2..``max_rows`` rows.

    Args:
        x: [..., in_features]; rows = the product of the leading dimensions.
        weight: [out_features, in_features], same dtype and device as ``x``.
        bias: [out_features] or None.
        max_rows: largest row count that takes the transposed product; 0 = never. Only on
            CPU, float32, with at least two torch threads.
    Returns:
        [..., out_features], ``x``'s dtype, contiguous (row-major, as ``F.linear`` returns).
    Raises:
        RuntimeError: shape or dtype mismatch (from torch, as ``F.linear`` would).
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows < 2 or rows > max_rows or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or torch.get_num_threads() < 2):
        return F.linear(x, weight, bias)
    # Row-major like F.linear's result: the transposed view's last-dim stride is ``rows``, and
    # consumers pay for that layout. Attention then left the flash SDPA kernel for the math one
    # (it needs a unit last-dim stride) and every elementwise op on the activations kept the
    # strided layout: a 3-token SmolLM2 verify took 110 ms strided vs 84 ms with this copy of
    # rows x out_features floats (2 cores, interleaved, median of 7; logits unchanged to 7e-5).
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is :func:`skinny_linear` (same parameters and state dict)."""

    skinny_max_rows: int = DEFAULT_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, self.skinny_max_rows)


def use_skinny_linear(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Switch every plain ``nn.Linear`` in ``model`` to :class:`SkinnyLinear`, in place.

    Parameters, hooks and the state dict are untouched (only the class changes). Subclasses of
    ``nn.Linear`` (quantised or sharded layers) are left alone. ``max_rows`` 0 changes nothing.

    Returns:
        The number of layers switched.
    """
    if max_rows <= 0:
        return 0
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = SkinnyLinear
            m.skinny_max_rows = max_rows
            n += 1
    return n
