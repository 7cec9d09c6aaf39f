"""One sequence of a :class:`~dflash.core.kv_pool.KVPool`: the handle a session holds as its
cache (:class:`PoolSeq`), the state it shares with the pool's row table, and the check of a
compaction of it (:func:`check_compact`, also what the expert-parallel cache checks with)."""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable

import torch


@dataclasses.dataclass(eq=False)
class SeqState:
    """A sequence's state, shared by its handle and the pool's row table."""

    row: int = -1                                   # -1: not resident
    length: int = 0
    spilled: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # per layer [1, H, n, D]


class PoolSeq:
    """A handle on one sequence of a ``KVPool`` (what a session holds as its cache).

    Dropping the last reference frees its row. ``get_seq_length`` mirrors transformers'
    caches so callers can read the cached length the same way.
    """

    def __init__(self, orphaned: Callable[[SeqState], object]):
        """``orphaned(state)`` runs once the handle is collected (on any thread): its pool
        queues the row, freed by the pool's next call."""
        self.state = SeqState()
        weakref.finalize(self, orphaned, self.state)

    def get_seq_length(self) -> int:
        return self.state.length

    @property
    def resident(self) -> bool:
        return self.state.row >= 0

    @property
    def row(self) -> int:
        return self.state.row


def check_compact(length: int, start: int, offsets: list[int]) -> list[int]:
    """Validate a :meth:`KVPool.compact` of a sequence of ``length`` positions: ``0 <= start``,
    ``offsets`` non-empty integers (anything ``operator.index`` takes), strictly increasing,
    ``offsets[0] == 0`` (the anchor) and every ``start + offsets[m] < length`` (entries the
    last forward wrote). Returns ``offsets`` as a list of Python ints.

    Raises:
        ValueError: naming ``start`` or ``offsets`` and the offending index.
    """
    try:
        start = operator.index(start)
    except TypeError:
        raise ValueError(f"start: an int expected, got {start!r}") from None
    if not 0 <= start <= length:
        raise ValueError(f"start: {start} outside the sequence's [0, {length}] positions")
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__") or not len(offsets):
        raise ValueError(f"offsets: a non-empty list of ints expected, got {offsets!r}")
    out = []
    for m, o in enumerate(offsets):
        try:
            out.append(operator.index(o))
        except TypeError:
            raise ValueError(f"offsets[{m}]: an int expected, got {o!r}") from None
    if out[0] != 0:
        raise ValueError(f"offsets[0]: must be 0 (the anchor), got {out[0]}")
    for m in range(1, len(out)):
        if out[m] <= out[m - 1]:
            raise ValueError(f"offsets[{m}]: must be above offsets[{m - 1}] ({out[m - 1]}), "
                             f"got {out[m]}")
    if start + out[-1] >= length:
        raise ValueError(f"offsets[-1]: position {start} + {out[-1]} is past the sequence's "
                         f"{length} positions")
    return out
