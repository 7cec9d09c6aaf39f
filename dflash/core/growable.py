"""Appending positions to a tensor in place: the one growth rule of the caches that grow a
step at a time (the verifier's K/V cache layers and session taps, the drafter's context K/V).

Concatenating copies everything held so far on every append; writing into a buffer with spare
room copies it once per ``room`` appended positions.
"""

from __future__ import annotations

import torch

#: Spare positions allocated per growth.
ROOM = 256


def append_into(buf: torch.Tensor | None, n: int, new: torch.Tensor, dim: int,
                room: int = ROOM) -> torch.Tensor:
    """Write ``new`` at positions ``[n, n + m)`` along ``dim`` of ``buf`` (m = ``new.shape[dim]``)
    and return the buffer that holds them.

    When ``buf`` is None, too short, or differs from ``new`` in dtype or in any other
    dimension, a new buffer with ``room`` spare positions is allocated and ``buf``'s first
    ``n`` positions are copied into it (``buf`` may then be any tensor holding them, e.g. a
    view the caller does not own). Callers view ``[:n + m]`` of the result.
    """
    end = n + new.shape[dim]
    fits = (buf is not None and buf.dim() == new.dim() and buf.dtype == new.dtype
            and buf.shape[dim] >= end
            and all(a == b for i, (a, b) in enumerate(zip(buf.shape, new.shape)) if i != dim))
    if not fits:
        shape = list(new.shape)
        shape[dim] = end + room
        grown = new.new_empty(shape)
        if n:
            grown.narrow(dim, 0, n).copy_(buf.narrow(dim, 0, n))
        buf = grown
    buf.narrow(dim, n, end - n).copy_(new)
    return buf
