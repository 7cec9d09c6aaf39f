"""A session's tapped hidden states, one row per cached position, in a growable host buffer."""

from __future__ import annotations

import torch

from dflash.core.growable import ROOM, append_into


class TapRows:
    """Rows ``[n, F]`` (F = len(target_layer_ids) x hidden, the target's dtype) appended in
    place into a buffer with spare room (``dflash.core.growable.append_into``), so reading the rows
    the drafter lacks copies only those.

    The rows only ever go to a drafter, over the wire, so they are kept on the host. Rows from a
    CUDA target are copied into a pinned buffer without blocking (the step's one wait for the
    device has already happened: they are read after the accepted tokens); the copy is waited
    for when the rows are read, one step later, long after it ran. Pinned memory is used only
    for rows that come from CUDA.

    Why in place: concatenating per-step chunks copies the whole context at every context
    update, a cost that grows with the batch and the context
    (``docs/bench/perf-history/README.md``, "verifier_svc/tap_buffer.py").
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._n = 0
        self._copied: torch.cuda.Event | None = None   # the last device -> host copy

    def __len__(self) -> int:
        return self._n

    def append(self, rows: torch.Tensor) -> None:
        """Append ``rows`` [m, F] (any device) after the last row (copied into the buffer)."""
        if not rows.shape[0]:
            return
        if rows.device.type != "cuda":
            self._buf = append_into(self._buf, self._n, rows, 0)
            self._n += rows.shape[0]
            return
        end = self._n + rows.shape[0]
        buf = self._buf
        if (buf is None or not buf.is_pinned() or buf.shape[0] < end or buf.dtype != rows.dtype
                or buf.shape[1:] != rows.shape[1:]):
            self._wait()                      # the old buffer's rows are read below
            grown = torch.empty((end + ROOM, *rows.shape[1:]), dtype=rows.dtype,
                                device="cpu", pin_memory=True)
            if buf is not None and self._n:
                grown[:self._n].copy_(buf[:self._n])
            self._buf = buf = grown
        buf[self._n:end].copy_(rows, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(rows.device))
        self._n = end

    def rows(self, start: int) -> torch.Tensor:
        """Rows ``[start, n)`` on the host: a view of the buffer (valid until the next append
        or truncate); an empty tensor when there are none."""
        if self._buf is None:
            return torch.empty(0, device="cpu")
        self._wait()
        return self._buf[start:self._n]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (a prefix reused by the next turn)."""
        self._n = min(self._n, max(n, 0))

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
