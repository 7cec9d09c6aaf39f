"""Float32 products of a few rows on AVX-512 CPUs, on weights packed once into column panels.

A verify forward multiplies every weight by the ``k + 1`` rows of one block. At 8-16 rows the
float32 products are close to compute-bound on a two-core CPU, and the vendor kernels behind
``F.linear`` (MKL's small-M sgemm, oneDNN's inner product) run them at a third of the cores'
speed. ``kernels/csrc/panel_linear.cpp`` holds the weight as panels of 32 output columns,
transposed (``[ceil(out/32), in, 32]``), and keeps an 8-row x 32-column tile of results in
AVX-512 registers while it walks a panel's depth; the row blocks of a call take turns on each
slice of a panel while it is in L1, and the next panel is prefetched, so the weights stream from
memory once per call whatever the row count. Figures: ``docs/kernels.md``.

Each output is one fused multiply-add chain over the input features in order, whatever the row
count: a row's result does not depend on how many rows share the call (a verify block's products
equal a decode's, where both take this path). Against ``F.linear`` the summation order differs,
so results differ in the last bits (< 1e-5 on a 576-wide row of unit inputs).

The extension is compiled on first use with the system's C++ compiler
(``torch.utils.cpp_extension.load``, cached under torch's extensions folder, about 16 s once per
machine and source version). Where that fails (no compiler, no AVX-512), :func:`available` is
False and every caller keeps its other path; the packed copy costs one more copy of the weight's
bytes (SmolLM2-135M: +540 MB with the LM head). The torch reference is ``F.linear``;
``tests/test_panel_linear.py`` compares them.
"""

from __future__ import annotations

import functools
import logging
import weakref
from pathlib import Path

import torch

from kernels import cpp_build

log = logging.getLogger("dflash.kernels.panel_linear")

#: Output columns per panel (the C++ kernel's ``NR``).
PANEL = 32
#: Most rows a call takes the panels for (:func:`kernels.skinny_linear.skinny_linear`): a
#: block's rows re-read each panel slice from L1 per 8 rows, and for large row counts the
#: vendor's large-product kernels win (docs/kernels.md), so a prefill chunk keeps them.
MAX_ROWS = 64
#: Attribute on a weight tensor holding ``(key, panels)``.
_ATTR = "_dflash_panels"
_SOURCE = cpp_build.CSRC / "panel_linear.cpp"
#: id -> weak reference of every weight holding panels (:func:`release_new`).
_PACKED: dict[int, weakref.ref] = {}


def build_directory() -> tuple[str, Path]:
    """The extension's module name and build folder (``kernels.cpp_build.build_directory``)."""
    return cpp_build.build_directory(_SOURCE, cpp_build.AVX512_CFLAGS, "dflash_panel_linear")


@functools.cache
def _extension():
    """The compiled extension module, or None where this CPU or toolchain cannot build it
    (``kernels.cpp_build.load_avx512``)."""
    return cpp_build.load_avx512(_SOURCE, "dflash_panel_linear")


def available() -> bool:
    """This CPU has AVX-512 and the extension builds (compiles it on the first call)."""
    return _extension() is not None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x @ weight.T`` can take the panel product: CPU float32 plain tensors, no autograd graph
    to record (the kernel has no backward), and the extension available."""
    return (x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.layout == torch.strided and weight.dim() == 2 and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] float32 as column panels, float32 [ceil(out / 32), in, 32]: panel p
    holds rows 32p..32p+31 transposed, zero-padded past ``out``."""
    out, inp = weight.shape
    panels = -(-out // PANEL)
    w = weight.detach()
    if panels * PANEL != out:
        w = torch.cat([w, w.new_zeros(panels * PANEL - out, inp)])
    return w.reshape(panels, PANEL, inp).transpose(1, 2).contiguous()


def panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """The panel copy of ``weight``, made once per storage and version: a weight changed in
    place through torch (``copy_``, ``mul_``, ``load_state_dict``) bumps its version and is
    packed again; a change that bypasses the version counter (through ``.data`` or a NumPy
    view) is not seen, as with ``kernels.packed_linear``."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    held = getattr(weight, _ATTR, None)
    if held is None or held[0] != key:
        held = (key, pack(weight))
        setattr(weight, _ATTR, held)
        _PACKED[id(weight)] = weakref.ref(weight)
    return held[1]


def packed_ids() -> set[int]:
    """The ids of the live weights that hold panels now (a marker for :func:`release_new`)."""
    for i in [i for i, r in _PACKED.items() if r() is None]:
        del _PACKED[i]
    return set(_PACKED)


def release_new(before: set[int]) -> int:
    """Drop the panel copies of every weight packed since ``before`` (:func:`packed_ids`);
    returns how many. A tune that leaves the panels off calls it: its probes packed every
    weight they reached (layers, LM heads, a drafter's draft-vocabulary head), and the copies
    (one more copy of the weights) would stay for nothing."""
    n = 0
    for i in packed_ids() - before:
        w = _PACKED.pop(i)()
        if w is not None and getattr(w, _ATTR, None) is not None:
            delattr(w, _ATTR)
            n += 1
    return n


def try_panel_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` on the panel copy of ``weight``, or None where
    :func:`applies` is false.

    Args:
        x: [..., in_features] float32.
        weight: [out_features, in_features] float32.
        bias: [out_features] or None.
    Returns:
        [..., out_features] float32, contiguous; or None.
    None too where ``x``'s width or the bias's dtype does not match, so that the caller's
    ``F.linear`` raises torch's own error.
    """
    held = getattr(weight, _ATTR, None)
    # the common case, checked cheaply (a forward makes ~200 of these calls)
    if (held is None or held[0][:2] != (weight.data_ptr(), weight._version)
            or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        if not applies(x, weight):
            return None
        held = (None, panel_weight(weight))
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.dtype != torch.float32):
        return None                  # F.linear raises its own error for these
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = _extension().panel_mm(x2, held[1], weight.shape[0])
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
