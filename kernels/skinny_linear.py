"""Skinny linear layers on CPU: ``x @ W.T`` for a few rows, computed as ``(W @ x.T).T``.

A verify forward multiplies every weight matrix by only ``k + 1`` rows (the anchor and the
drafts of one block). For such skinny products some CPU BLAS paths behind ``F.linear`` (small-M
sgemm) are far from memory speed, while the transposed product, where the weight is the tall
left operand, streams the weight once. One row (a matrix-vector product) takes the slow path
either way, so :func:`skinny_linear` keeps ``F.linear`` there unless ``one_row`` (and on every
accelerator, and for any dtype but float32, where the vendor library already picks its kernel).
The gain needs a second thread at work, so one torch thread keeps ``F.linear`` too. Both compute
the same float32 dot products in a different summation order: results may differ in the last
bits, as a block forward already differs from one-token forwards (the verify path is not
bit-identical to decode anywhere in the field; see the lossless tests for how near-ties are
handled).

Whether it pays depends on the CPU (on some, the vendor's small-M sgemm wins at every row
count), so the services tune the row limit at start (:func:`tune_max_rows`, ``--skinny-max-rows
-1``, the default): the real model's forward, timed both ways on the thread that runs it. The
figures behind this design: ``docs/bench/perf-history/README.md``, "kernels/skinny_linear.py".

The torch reference is ``F.linear`` itself; ``tests/test_skinny_linear.py`` compares them.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F

from kernels.invariant import linear as invariant_linear
from kernels.packed_linear import available as packed_available, try_packed_linear
from kernels.panel_linear import (
    MAX_ROWS as PANEL_MAX_ROWS,
    available as panel_available,
    packed_ids as panel_packed_ids,
    release_new as panel_release_new,
    try_panel_linear,
)

log = logging.getLogger("dflash.kernels")

#: Default row limit: a block of 16 (an anchor and 15 drafts).
DEFAULT_MAX_ROWS = 16
#: ``max_rows`` value meaning "measure at start" (:func:`tune_max_rows`); switched layers use
#: ``DEFAULT_MAX_ROWS`` until tuned.
AUTO = -1
#: How much faster (fraction) the transposed product must be to be chosen.
MARGIN = 0.03
#: The packed and panel products' modes (:func:`switch_linear`; the services' ``--packed-linear``
#: and ``--panel-linear``, whose torch-free list is ``dflash.core.flags.PACKED_CHOICES``).
PRODUCT_MODES = ("auto", "on", "off")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int = DEFAULT_MAX_ROWS, one_row: bool = False,
                  packed: int = 0, panel: int = 0, invariant: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(weight @ x2d.T).T`` when it has 2..``max_rows`` rows
    (and, with ``one_row``, for one row, computed as two copies of it); with ``packed``, as the
    oneDNN product on the prepacked weight (:mod:`kernels.packed_linear`) at every row count
    where that applies.

    Args:
        x: [..., in_features]; rows = the product of the leading dimensions.
        weight: [out_features, in_features], same dtype and device as ``x``.
        bias: [out_features] or None.
        max_rows: largest row count that takes the transposed product; 0 = never. Only on
            CPU, float32, with at least two torch threads.
        one_row: one row (a decode step) takes the transposed product of the row and a copy
            of it: on some CPUs both ``F.linear`` and ``weight @ x`` of one row take a slow
            matrix-vector kernel that a two-column product avoids. Same conditions as
            ``max_rows``; :func:`tune_max_rows` decides it.
        packed: from this many rows on (0 = never), take
            :func:`kernels.packed_linear.packed_linear` (CPU, float32 or bfloat16, no autograd)
            before either; :func:`tune_packed` decides it.
        panel: from this many rows on (0 = never) up to ``kernels.panel_linear.MAX_ROWS``,
            take :func:`kernels.panel_linear.try_panel_linear` (CPU float32 on AVX-512) before
            all of them; :func:`tune_panel` decides it.
        invariant: take :func:`kernels.invariant.linear` at every row count instead of all the
            others (batch-invariant mode: a row's result does not depend on the call's rows).
    Returns:
        [..., out_features], ``x``'s dtype, contiguous (row-major, as ``F.linear`` returns).
    Raises:
        RuntimeError: shape or dtype mismatch (from torch, as ``F.linear`` would).
    """
    if invariant:
        return invariant_linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if panel and panel <= rows <= PANEL_MAX_ROWS:
        out = try_panel_linear(x, weight, bias)
        if out is not None:
            return out
    if packed and rows >= packed:
        out = try_packed_linear(x, weight, bias)
        if out is not None:
            return out
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or torch.get_num_threads() < 2
            or not (2 <= rows <= max_rows or (rows == 1 and one_row))):
        return F.linear(x, weight, bias)
    if rows == 1:   # the matrix-vector kernel is the slow path: two columns, keep one
        out = (weight @ x.reshape(1, x.shape[-1]).repeat(2, 1).T)[:, :1].T.contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])
    # Row-major like F.linear's result: the transposed view's last-dim stride is ``rows``, and
    # consumers pay for that layout (attention leaves the flash SDPA kernel for the math one, which
    # needs a unit last-dim stride; every elementwise op keeps the strided layout), far more than
    # this copy of rows x out_features floats costs.
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is :func:`skinny_linear` (same parameters and state dict)."""

    skinny_max_rows: int = DEFAULT_MAX_ROWS
    skinny_one_row: bool = False
    skinny_packed: int = 0
    skinny_panel: int = 0
    skinny_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, self.skinny_max_rows, self.skinny_one_row,
                             self.skinny_packed, self.skinny_panel, self.skinny_invariant)


def use_skinny_linear(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS,
                      always: bool = False) -> int:
    """Switch every plain ``nn.Linear`` in ``model`` to :class:`SkinnyLinear`, in place.

    Parameters, hooks and the state dict are untouched (only the class changes). Subclasses of
    ``nn.Linear`` (quantised or sharded layers) are left alone. ``max_rows`` 0 changes nothing
    unless ``always`` (then the layers switch with limit 0, for :func:`set_packed`);
    :data:`AUTO` (-1) switches with ``DEFAULT_MAX_ROWS`` (then :func:`tune_max_rows`).

    Returns:
        The number of layers switched.
    Raises:
        ValueError: ``max_rows`` below :data:`AUTO`.
    """
    if max_rows < AUTO:
        raise ValueError(f"skinny_max_rows: must be -1 (tune), 0 (off) or a row limit, got {max_rows}")
    if max_rows == 0 and not always:
        return 0
    if max_rows == AUTO:
        max_rows = DEFAULT_MAX_ROWS
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = SkinnyLinear
            cast(SkinnyLinear, m).skinny_max_rows = max_rows
            n += 1
    return n


def set_max_rows(model: torch.nn.Module, max_rows: int, also: Iterable[Any] = (),
                 one_row: bool | None = None) -> None:
    """Set the row limit of every :class:`SkinnyLinear` in ``model`` and of each object in
    ``also`` that has a ``skinny_max_rows`` attribute (e.g. the drafter's target head); with
    ``one_row`` not None, also the layers' one-row switch."""
    for m in model.modules():
        if isinstance(m, SkinnyLinear):
            m.skinny_max_rows = max_rows
            if one_row is not None:
                m.skinny_one_row = one_row
    for o in also:
        o.skinny_max_rows = max_rows


def switch_linear(model: torch.nn.Module, max_rows: int, packed_linear: str, device: torch.device,
                  also: Iterable[Any] = (), panel_linear: str = "off") -> tuple[str, str]:
    """A model service's linear layers at load: :func:`use_skinny_linear` with ``max_rows``
    (switching even at 0 when packed or panel products may be taken), and the packed product
    (``packed_linear`` "on") and the panel product (``panel_linear`` "on") at every row count
    (``model``'s layers and ``also``'s).

    Returns:
        The packed and panel modes in force: the flags' values, each "off" off the CPU, and the
        panel mode "off" (with a warning) where "on" cannot apply (no float32 weight, no
        AVX-512 or no extension).
    Raises:
        ValueError: ``packed_linear`` / ``panel_linear`` not one of ``PRODUCT_MODES``;
            ``max_rows`` below AUTO.
    """
    for name, value in (("packed_linear", packed_linear), ("panel_linear", panel_linear)):
        if value not in PRODUCT_MODES:
            raise ValueError(f"{name}: one of {', '.join(PRODUCT_MODES)}, got {value!r}")
    mode = packed_linear if device.type == "cpu" else "off"
    panel = panel_linear if device.type == "cpu" else "off"
    if panel == "on" and not (panel_available() and any(
            p.dtype == torch.float32 for p in model.parameters())):
        log.warning("panel linear: on was asked, but it needs float32 weights on a CPU with "
                    "AVX-512 and a built extension: off")
        panel = "off"
    use_skinny_linear(model, max_rows, always=mode != "off" or panel != "off")
    set_packed(model, int(mode == "on"), also)
    set_panel(model, int(panel == "on"), also)
    return mode, panel


def set_invariant(model: torch.nn.Module, on: bool, also: Iterable[Any] = ()) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SkinnyLinear` and set its
    batch-invariant product (:func:`kernels.invariant.linear`) on or off, and the same attribute
    (``skinny_invariant``) of each object in ``also``. Returns the number of layers set."""
    use_skinny_linear(model, 0, always=True)
    n = 0
    for m in model.modules():
        if isinstance(m, SkinnyLinear):
            m.skinny_invariant = on
            n += 1
    for o in also:
        o.skinny_invariant = on
    return n


def packed_state(threshold: int) -> str:
    """The packed mode a :func:`tune_packed` threshold leaves: "on", "from N rows" or "off"."""
    return "on" if threshold == 1 else f"from {threshold} rows" if threshold else "off"


def set_packed(model: torch.nn.Module, packed: int, also: Iterable[Any] = ()) -> None:
    """Set the prepacked product's row threshold (:mod:`kernels.packed_linear`; 0 = off, 1 =
    every row count, 2 = two rows or more) of every :class:`SkinnyLinear` in ``model`` and of
    each object in ``also`` (``skinny_packed``)."""
    for m in model.modules():
        if isinstance(m, SkinnyLinear):
            m.skinny_packed = packed
    for o in also:
        o.skinny_packed = packed


def _medians_both_ways(probe: Callable[[int], object], rows: tuple[int, ...], reps: int,
                       use: Callable[[bool], None], *,
                       warm: bool = True) -> dict[int, tuple[float, float]]:
    """{n: (median s with ``use(True)``, median s with ``use(False)``)} of ``reps`` calls of
    ``probe(n)`` each way per ``n`` in ``rows``, the two ways interleaved (the order alternating
    by round) after, with ``warm``, one untimed call each way, so drift falls on both alike.
    Leaves the last state set (False or True); the caller sets the result."""
    runs: dict[int, dict[bool, list[float]]] = {n: {True: [], False: []} for n in rows}
    for state in (True, False) if warm else ():
        use(state)
        for n in rows:
            probe(n)
    for r in range(reps):
        for state in ((True, False) if r % 2 else (False, True)):
            use(state)
            for n in rows:
                t0 = time.perf_counter()
                probe(n)
                runs[n][state].append(time.perf_counter() - t0)
    return {n: (statistics.median(v[True]), statistics.median(v[False])) for n, v in runs.items()}


def tune_packed(model: torch.nn.Module, probe: Callable[[int], object], *,
                rows: tuple[int, ...] = (1, 4, 16), reps: int = 5, margin: float = MARGIN,
                also: Iterable[Any] = ()) -> tuple[int, dict[int, tuple[float, float]]]:
    """Decide the prepacked product of ``model``'s skinny layers (and ``also``'s) by timing the
    real workload, after :func:`tune_max_rows` chose the other paths.

    ``probe(n)`` runs ``reps`` times per ``n`` in ``rows`` with the packed product at every row
    count and ``reps`` times without, interleaved, after one untimed call each way (which also
    packs the weights). Multi-row blocks (a verify) take it when the sum of its medians over the
    ``rows`` above 1 beats the other's by more than ``margin``; one row (a decode, where the
    two-copy product may already be fast) when its own median does as well. ``model`` (and
    ``also``) are left at the result. Returns (threshold for :func:`set_packed`, {n: (packed
    median s, unpacked median s)}); (0, {}) when no layer is a :class:`SkinnyLinear` or oneDNN
    is missing.
    """
    also = list(also)
    if not packed_available(torch.float32) or (
            not also and not any(isinstance(m, SkinnyLinear) for m in model.modules())):
        return 0, {}
    timings = _medians_both_ways(probe, rows, reps, lambda on: set_packed(model, int(on), also))
    multi = [t for n, t in timings.items() if n > 1]
    threshold = 0
    if multi and wins(sum(t[0] for t in multi), sum(t[1] for t in multi), margin):
        threshold = 1 if 1 in timings and wins(*timings[1], margin) else 2
    set_packed(model, threshold, also)
    return threshold, timings


def packed_summary(threshold: int, timings: dict[int, tuple[float, float]]) -> str:
    """One log line for a :func:`tune_packed` result."""
    return _summary("packed", "no oneDNN or no switchable layer", threshold, timings)


def _summary(what: str, why_not: str, threshold: int,
             timings: dict[int, tuple[float, float]]) -> str:
    """``"<what> linear: <state> (ms, <what> vs other: ...)"``, or unavailable ``why_not``."""
    if not timings:
        return f"{what} linear: unavailable ({why_not})"
    parts = ", ".join(f"{n} rows {a * 1e3:.1f} vs {b * 1e3:.1f} ms" for n, (a, b) in timings.items())
    return f"{what} linear: {packed_state(threshold)} (ms, {what} vs other: {parts})"


def set_panel(model: torch.nn.Module, panel: int, also: Iterable[Any] = ()) -> None:
    """Set the panel product's row threshold (:mod:`kernels.panel_linear`; 0 = off, 1 = every
    row count, N = N rows or more) of every :class:`SkinnyLinear` in ``model`` and of each
    object in ``also`` (``skinny_panel``)."""
    for m in model.modules():
        if isinstance(m, SkinnyLinear):
            m.skinny_panel = panel
    for o in also:
        o.skinny_panel = panel


def tune_panel(model: torch.nn.Module, probe: Callable[[int], object], *,
               rows: tuple[int, ...] = (1, 2, 4, 8, 16), reps: int = 5, margin: float = MARGIN,
               also: Iterable[Any] = ()) -> tuple[int, dict[int, tuple[float, float]]]:
    """Decide the panel product (:mod:`kernels.panel_linear`) of ``model``'s float32 skinny
    layers (and ``also``'s) by timing the real workload, after :func:`tune_max_rows` and
    :func:`tune_packed` chose the other paths (the "other" side of each timing).

    ``probe(n)`` runs ``reps`` times per ``n`` in ``rows`` with the panel product at every row
    count and ``reps`` times without, interleaved, after one untimed call each way (which also
    packs the weights and, the first time on a machine, builds the extension). The threshold is
    the smallest ``n`` in ``rows`` from which the panel product's median beats the other's by
    more than ``margin`` at that and every larger tested ``n``; 0 when it does not win at the
    largest (the panel copies the probes made are then dropped). ``model`` (and ``also``) are
    left at the result. Returns (threshold for :func:`set_panel`, {n: (panel median s, other
    median s)}); (0, {}) when no float32 layer is a :class:`SkinnyLinear` or the extension is
    unavailable.
    """
    also = list(also)
    layers = [m for m in model.modules() if isinstance(m, SkinnyLinear)]
    if (not any(m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" for m in layers)
            or not panel_available()):
        return 0, {}
    before = panel_packed_ids()
    timings = _medians_both_ways(probe, rows, reps, lambda on: set_panel(model, int(on), also))
    threshold = 0
    for n in sorted(rows, reverse=True):
        if not wins(*timings[n], margin):
            break
        threshold = n
    set_panel(model, threshold, also)
    if not threshold:        # the probes packed every weight they reached: free those copies
        panel_release_new(before)
    return threshold, timings


def panel_summary(threshold: int, timings: dict[int, tuple[float, float]]) -> str:
    """One log line for a :func:`tune_panel` result."""
    return _summary("panel", "no AVX-512, no compiler or no float32 layer", threshold, timings)


def tune_products(model: torch.nn.Module, probe: Callable[[int], object], packed: str,
                  panel: str, *, rows: tuple[int, ...] | None = None,
                  also: Iterable[Any] = ()) -> tuple[str, str]:
    """A service's product tunes after its row-limit tune: :func:`tune_packed` where
    ``packed`` is "auto", then :func:`tune_panel` where ``panel`` is "auto" (``rows``: both
    tunes' row counts; None = each one's default), each result logged. Call on the thread that
    runs the forwards. Returns the packed and panel modes in force (:func:`packed_state` of a
    tuned one; the other unchanged)."""
    also = list(also)
    kw: dict[str, Any] = {"also": also} | ({"rows": rows} if rows else {})
    if packed == "auto":
        threshold, timings = tune_packed(model, probe, **kw)
        packed = packed_state(threshold)
        log.info("%s", packed_summary(threshold, timings))
    if panel == "auto":
        threshold, timings = tune_panel(model, probe, **kw)
        panel = packed_state(threshold)
        log.info("%s", panel_summary(threshold, timings))
    return packed, panel


def tune_max_rows(model: torch.nn.Module, probe: Callable[[int], object], *,
                  rows: tuple[int, ...] = (2, 4, 8, 16), reps: int = 5, margin: float = MARGIN,
                  also: Iterable[Any] = ()) -> tuple[int, dict[int, tuple[float, float]]]:
    """Choose the row limit of ``model``'s skinny layers by timing the real workload.

    For each ``n`` in ``rows``, ``probe(n)`` (a forward whose linear layers see ``n`` input
    rows, e.g. a verify of ``n`` tokens) runs ``reps`` times with the transposed product and
    ``reps`` times with ``F.linear``, interleaved (the order alternating), after one untimed
    call each way. The limit is the largest ``n`` such that the transposed product's median
    was more than ``margin`` faster at that and every smaller tested ``n``; 0 when it does not
    win at ``rows[0]``. Call it on the thread that runs the model's forwards, with its torch
    thread count (:func:`skinny_linear` keeps ``F.linear`` on one thread, so a tune there
    finds no difference and returns 0). ``model`` (and ``also``) are left at the result.

    A 1 in ``rows`` (a decode-shaped probe) is timed the same way and decided on its own: the
    layers of ``model`` take the two-copy product for one row (``skinny_one_row``) when it won
    by ``margin``; it neither counts for nor stops the limit. Without a 1 the switch is left
    off.

    Returns:
        (limit, {n: (transposed median s, F.linear median s)}).
    """
    also = list(also)
    if not also and not any(isinstance(m, SkinnyLinear) for m in model.modules()):
        return 0, {}

    def timed(n: int, use: Callable[[bool], None], warm: bool) -> tuple[float, float]:
        return _medians_both_ways(probe, (n,), reps, use, warm=warm)[n]

    timings: dict[int, tuple[float, float]] = {}
    one_row = False
    if 1 in rows:
        timings[1] = timed(1, lambda state: set_max_rows(model, 0, also, one_row=state), True)
        one_row = wins(*timings[1], margin)
    set_max_rows(model, 0, also, one_row=one_row)
    rows = tuple(n for n in rows if n != 1)
    limit = max(rows, default=0)
    for i, n in enumerate(rows):
        timings[n] = timed(n, lambda state: set_max_rows(model, limit if state else 0, also), i == 0)
    best = 0
    for n in rows:
        if not wins(*timings[n], margin):
            break
        best = n
    set_max_rows(model, best, also)
    return best, timings


def wins(t_skinny: float, t_linear: float, margin: float = MARGIN) -> bool:
    """The transposed product's time beats ``F.linear``'s by more than ``margin``."""
    return t_skinny < t_linear * (1 - margin)


def tuning_summary(limit: int, timings: dict[int, tuple[float, float]]) -> str:
    """One log line for a :func:`tune_max_rows` result."""
    one = timings.get(1)
    head = f"skinny_max_rows tuned to {limit}" + (
        f", one row {'two-copy product' if wins(*one) else 'F.linear'}" if one else "")
    return head + " (ms, transposed vs F.linear: " + ", ".join(
        f"{n} rows {1e3 * a:.1f} vs {1e3 * b:.1f}" for n, (a, b) in timings.items()) + ")"
