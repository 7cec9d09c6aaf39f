"""Packing per-sequence tap features into one wire buffer in Triton; reference:
:func:`kernels.reference.pack_features`.

One launch copies every sequence, row-strided views included. The kernel reads a small int64
table, one row per sequence: ``(element offset from the first tensor, row stride, first output
row, rows)``; each program copies ``[BLOCK_R, BLOCK_C]`` tiles, striding over row blocks so the
grid stays small for long prompts. When all offsets and strides are multiples of 16 bytes the
kernel is told so (``ALIGN``) and uses vector loads.

Unpacking has no kernel on purpose: :func:`kernels.reference.unpack_features` returns views of the
buffer, which no copy can beat; the dispatcher uses it on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference

# Element types the kernel copies (a copy is exact for any of them).
PACKABLE_DTYPES = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
})
_MAX_ROW_PROGRAMS = 1024


@triton.jit
def _pack_kernel(table_ptr, base_ptr, out_ptr, C, ALIGN: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    row_prog = tl.program_id(1)
    n_row_progs = tl.num_programs(1)
    entry = table_ptr + seq * 4
    src_off = tl.load(entry)  # elements from base_ptr (sequences live in separate tensors)
    src_stride = tl.load(entry + 1)
    out_row0 = tl.load(entry + 2)
    n_rows = tl.load(entry + 3)
    if ALIGN > 1:  # every offset, row stride and C is a multiple of ALIGN: vector loads
        src_off = tl.multiple_of(src_off, ALIGN)
        src_stride = tl.multiple_of(src_stride, ALIGN)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    for r0 in range(row_prog * BLOCK_R, n_rows, n_row_progs * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < n_rows)[:, None] & (cols < C)[None, :]
        x = tl.load(base_ptr + src_off + rows[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(out_ptr + (out_row0 + rows)[:, None] * C + cols[None, :], x, mask=mask)


def supports(features: list[torch.Tensor]) -> bool:
    """Whether the kernel applies: a non-empty list of 2-D tensors on one device, with one dtype
    (from :data:`PACKABLE_DTYPES`) and one width. Anything else goes to the reference, which
    then raises or promotes exactly as ``torch.cat`` does."""
    if not features:
        return False
    first = features[0]
    return first.dtype in PACKABLE_DTYPES and all(
        f.dim() == 2 and f.dtype == first.dtype and f.device == first.device
        and f.shape[1] == first.shape[1] for f in features)


def pack_features(features: list[torch.Tensor], *, block_r: int = 4, block_c: int = 1024
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference.pack_features` (``offsets`` stays on the CPU,
    as there). Requires :func:`supports`; rows may be strided, columns are made contiguous."""
    if not supports(features):
        raise ValueError("pack_features kernel needs 2-D tensors of one dtype, device and width")
    features = [f if f.stride(1) == 1 or f.shape[1] <= 1 else f.contiguous() for f in features]
    lengths = [f.shape[0] for f in features]
    offsets = torch.zeros(len(features) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    width, device = features[0].shape[1], features[0].device
    buffer = torch.empty(int(offsets[-1]), width, dtype=features[0].dtype, device=device)
    if buffer.numel() == 0:
        return buffer, offsets
    base = next(f for f in features if f.shape[0])
    elsize = base.element_size()
    deltas = [f.data_ptr() - base.data_ptr() if f.shape[0] else 0 for f in features]
    if any(d % elsize for d in deltas):  # e.g. views at odd byte offsets of one byte buffer
        return reference.pack_features(features)
    starts = [d // elsize for d in deltas]
    table = torch.tensor(
        [[start, f.stride(0), row0, n]
         for f, start, row0, n in zip(features, starts, offsets[:-1].tolist(), lengths)],
        dtype=torch.int64).to(device)
    vec = 16 // elsize  # elements per 16-byte vector
    aligned = (vec > 1 and base.data_ptr() % 16 == 0 and width % vec == 0
               and all(s % vec == 0 for s in starts)
               and all(f.stride(0) % vec == 0 or f.shape[0] <= 1 for f in features))
    block_c = min(block_c, triton.next_power_of_2(width))
    grid = (len(features), min(triton.cdiv(max(lengths), block_r), _MAX_ROW_PROGRAMS),
            triton.cdiv(width, block_c))
    _pack_kernel[grid](table, base, buffer, width, ALIGN=vec if aligned else 1,
                       BLOCK_R=block_r, BLOCK_C=block_c)
    return buffer, offsets
