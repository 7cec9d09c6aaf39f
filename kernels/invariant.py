"""Batch-invariant linear layers and attention: a row's result does not depend on the rows that
share its forward.

The vendor kernels behind ``F.linear`` and ``F.scaled_dot_product_attention`` choose their
blocking (and so their summation order) by the shape of the call: a verify block of 16 rows, a
batch of 8 sessions or a decode of one row round differently in the last bits, and in bfloat16
that flips near-tie argmaxes. With every reduction done in one order whatever the call's shape
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; vLLM's
``VLLM_BATCH_INVARIANT``, SGLang's ``--enable-deterministic-inference``), the target's verify of
k rows gives the bits of k one-token decodes, and greedy speculation is plain decoding bit for bit.

Two paths, one contract:

* CPUs with AVX-512 (where the extensions build): the panel product
  (``kernels/csrc/panel_linear.cpp``: one FMA chain per output over the input features in
  order; float32 or bfloat16 weights, float32 accumulation) and
  ``kernels/csrc/invariant_attention.cpp`` (per query: its visible keys in order; hidden keys
  skipped).
* Anywhere else (another CPU, a GPU): the references, :func:`reference_linear` and
  :func:`reference_attention`, which run every row alone through the vendor kernel at the shape
  a decode gives it (one row; one query over exactly its visible keys), so the same shape meets
  the same kernel. Correct, and slow (each weight is read once per row).

The two paths agree to rounding, not bit for bit (their summation orders differ); each is
invariant on its own, and a process uses one (the extension is there or not).
``tests/test_batch_invariant.py`` checks both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import cpp_build
from kernels.panel_linear import _extension as _panel_extension, panel_weight

#: The name the target's attention layers are switched to (``transformers.AttentionInterface``).
ATTENTION_NAME = "batch_invariant"  # no "flash" in it: transformers reads that as a flash kernel
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _attention_extension():
    """The compiled attention kernel, or None (``kernels.cpp_build.load_avx512``)."""
    return cpp_build.load_avx512(cpp_build.CSRC / "invariant_attention.cpp",
                                 "dflash_invariant_attention")


def kernels_available() -> bool:
    """Both CPU kernels build here (AVX-512 and a compiler); compiles them on the first call."""
    return _panel_extension() is not None and _attention_extension() is not None


def _on_kernels(*tensors: torch.Tensor) -> bool:
    dt = tensors[0].dtype
    return (dt in _DTYPES and all(t.device.type == "cpu" and t.dtype == dt for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and kernels_available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row's result independent of the other rows.

    Args:
        x: [..., in_features], float32 or bfloat16 (the kernels) or any dtype (the reference).
        weight: [out_features, in_features], ``x``'s dtype and device.
        bias: [out_features] or None.
    Returns:
        [..., out_features] in ``x``'s dtype, contiguous. On the kernel, accumulated in float32
        and rounded once to ``x``'s dtype.
    Raises:
        RuntimeError: shape or dtype mismatch (torch's, as ``F.linear`` raises it).
    """
    if x.shape[-1] != weight.shape[-1] or not _on_kernels(x, weight):
        return reference_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = _panel_extension().panel_mm(rows, panel_weight(weight), weight.shape[0])
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def reference_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` on any device: each row alone through ``F.linear``, copied first so that
    every call sees the shape and alignment a one-row decode gives it."""
    if x.shape[-1] != weight.shape[-1]:
        return F.linear(x, weight, bias)          # torch's own error
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([F.linear(r.clone()[None], weight, bias) for r in rows]) if len(rows) else \
        F.linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled dot-product attention with each query's result independent of the other queries.

    Args:
        query: [b, heads, q, head_dim].
        key, value: [b, kv_heads, L, head_dim], ``heads`` a multiple of ``kv_heads`` (grouped
            query attention), the last dimension contiguous.
        mask: bool [b, 1 or heads, q, >= L], True = attend (the first L columns are read), or
            None (every key visible to every query).
        scale: the scores' factor (``head_dim ** -0.5`` for most models).
    Returns:
        [b, q, heads, head_dim] in ``query``'s dtype (transformers' attention layout). A query
        that sees no key gets zeros.
    Raises:
        ValueError: a mask that is not bool, or shapes that do not fit.
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask: bool expected (True = attend), got {mask.dtype}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query: {query.shape[1]} heads are not a multiple of the key's "
                         f"{key.shape[1]}")
    if (query.shape[-1] <= 256 and all(t.stride(-1) == 1 for t in (query, key, value))
            and _on_kernels(query, key, value) and (mask is None or mask.device.type == "cpu")):
        return _attention_extension().invariant_attention(query, key, value, mask, float(scale))
    return reference_attention(query, key, value, mask, scale)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`attention` on any device: each query alone, over a fresh copy of exactly the keys
    it sees, through matmul and softmax in float32, so that a decode's query and the same query
    in a block meet the same shapes."""
    if mask is not None and mask.shape[1] != 1:
        raise ValueError("reference_attention: a per-head mask is not supported")
    b, h, q, d = query.shape
    groups = h // key.shape[1]
    length = key.shape[2]
    out = query.new_zeros(b, q, h, d)
    for r in range(b):
        for i in range(q):
            idx = (torch.arange(length, device=key.device) if mask is None
                   else mask[r, 0, i, :length].nonzero()[:, 0])
            if not len(idx):
                continue
            k = key[r].index_select(1, idx).float().repeat_interleave(groups, 0)    # [h, n, d]
            v = value[r].index_select(1, idx).float().repeat_interleave(groups, 0)
            s = torch.matmul(query[r, :, i:i + 1].float(), k.transpose(1, 2)) * scale  # [h, 1, n]
            out[r, i] = torch.matmul(torch.softmax(s, dim=-1), v)[:, 0].to(query.dtype)
    return out


def transformers_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`attention` in transformers' attention-function form (``AttentionInterface``):
    query [b, heads, q, d], key/value [b, kv_heads, L, d], the mask bool or None.

    Raises:
        ValueError: dropout in a forward (inference only), a float (additive) mask, a
            soft-capped model.
    """
    if dropout:
        raise ValueError("dropout: batch-invariant attention is for inference only")
    if kwargs.get("softcap") is not None:
        raise ValueError("softcap: not supported by batch-invariant attention")
    q, length = query.shape[2], key.shape[2]
    if attention_mask is None and q > 1 and (is_causal if is_causal is not None
                                             else getattr(module, "is_causal", True)):
        rows = torch.arange(q, device=query.device)[:, None] + (length - q)
        attention_mask = (torch.arange(length, device=query.device)[None, :] <= rows)[None, None]
        attention_mask = attention_mask.expand(query.shape[0], 1, q, length)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attention(query, key, value, attention_mask, scale), None


def register_attention() -> str:
    """Register :func:`transformers_attention` (and SDPA's mask builder, whose bool masks it
    reads) under :data:`ATTENTION_NAME`; returns the name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, transformers_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def resolve(choice: str, device: torch.device | str, dtype: torch.dtype | str = "float32") -> bool:
    """The ``--batch-invariant`` flag (``dflash.core.flags.INVARIANT_CHOICES``) for a model of
    ``dtype`` on ``device``: "on" / "off" as given; "auto" on only where the mode was measured
    to cost at most 10% of a forward at every shape the verifier runs. No such place yet: on
    the AVX-512 CPUs a float32 verify of 8 x 16 rows costs +19% and a prefill chunk +23%, and
    bfloat16 (AMX, AVX512-BF16) and GPUs (the references) far more (``docs/batch-invariance.md``),
    so "auto" is off; ``device`` and ``dtype`` are the inputs a future kernel will decide by.

    Raises:
        ValueError: naming ``batch_invariant`` for another value.
    """
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"batch_invariant: one of auto, on, off, got {choice!r}")
    return choice == "on"
