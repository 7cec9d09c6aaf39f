"""A persistent batch K/V cache: every session's K/V in one set of per-layer tensors.

Each layer holds ``K`` and ``V`` of shape ``[rows, kv_heads, capacity, head_dim]``; a sequence
(one session) owns one row while it is *resident* and its length is a number, so a crop is an
assignment and a rejected draft's positions are simply overwritten by the next block. A batched
step first :meth:`KVPool.arrange` s its sequences onto rows ``0..b-1`` (rows move only when the
batch's make-up changes: a join or a leave), then attends over ``K[:b, :, :L]`` in place — no
per-step gather of every session's cache into a padded batch and no scatter back, which is what
batching paid per session before (vLLM v1 keeps a persistent batch for the same reason).

An idle sequence (a session kept between turns) can be :meth:`KVPool.spill` ed to tensors of its
own exact length so the pool's rows stay those of active sequences; its next use moves it back.
Rows freed by finished sequences are reused; buffers far larger than the resident rows need
shrink after a while (``shrink_after_s``).

Memory: ``rows x capacity`` positions per layer, capacity being the longest resident sequence
(rounded up by ``room``), like the padded batch it replaces; a paged layout (vLLM's
PagedAttention) would remove the padding but needs an attention kernel that reads pages.

Thread model: callers serialise every call (the verifier holds ``TargetModel.lock``, the
drafter its engine lock); a handle garbage-collected on any thread only queues its row, freed
by the next call.
"""

from __future__ import annotations

import time

import torch

from dflash.core.kv_seq import PoolSeq, SeqState, check_compact

#: Capacity granularity: positions added per growth beyond what is asked for.
ROOM = 256


class KVPool:
    """Per-layer K/V buffers ``[rows, kv_heads, capacity, head_dim]`` shared by sequences.

    Args:
        num_layers: attention layers (each gets its own K and V).
        kv_heads, head_dim: per-layer K/V shape.
        dtype, device: of the buffers (the model's).
        room: capacity granularity (positions).
        keep_idle_bytes, shrink_after_s: buffers larger than ``keep_idle_bytes`` that have been
            more than twice what the resident rows need for ``shrink_after_s`` seconds shrink
            to fit (dropped when no row is in use); smaller ones are kept, so back-to-back
            requests do not allocate and zero them again.

    Buffers are zero-initialised and only ever receive finite values, so positions a mask
    hides (another row's padding, stale drafts) cannot turn an attention output into NaN.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 room: int = ROOM, keep_idle_bytes: int = 1 << 30, shrink_after_s: float = 30.0):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.room = dtype, torch.device(device), room
        self.keep_idle_bytes = keep_idle_bytes
        self.shrink_after_s = shrink_after_s
        self._over_since: float | None = None
        self._checked = 0.0
        self.shrunk = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._rows: list[SeqState | None] = []          # row -> its sequence (None = free)
        self._orphaned: list[SeqState] = []             # finalised handles, freed by the owner
        self.grown = 0                              # reallocations (a test bound)

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        """Positions per row."""
        return self.k[0].shape[2] if self.k else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers."""
        if not self.k:
            return 0
        return 2 * self.num_layers * self.k[0].numel() * self.k[0].element_size()

    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def resident(self) -> int:
        """Rows held by sequences."""
        self._collect()
        return sum(r is not None for r in self._rows)

    def new_seq(self) -> PoolSeq:
        """An empty sequence (it takes a row at its first write)."""
        return PoolSeq(self._orphaned.append)

    def _collect(self) -> None:
        freed = bool(self._orphaned)
        while self._orphaned:
            rec = self._orphaned.pop()
            if rec.row >= 0 and rec.row < len(self._rows) and self._rows[rec.row] is rec:
                self._rows[rec.row] = None
            rec.row, rec.spilled = -1, None
        now = time.monotonic()
        if freed or now - self._checked >= 1.0:   # cheap enough per call, not per row
            self._checked = now
            self._maybe_shrink(now)

    def _maybe_shrink(self, now: float) -> None:
        """Give memory back once the buffers have been more than twice what the resident rows
        need, and above ``keep_idle_bytes``, for ``shrink_after_s`` (so a burst's peak is not
        kept forever, and a pool that empties between the turns of one client is not dropped
        and re-zeroed every turn)."""
        if not self.k or self.nbytes <= self.keep_idle_bytes:
            self._over_since = None
            return
        used = [i for i, r in enumerate(self._rows) if r is not None]
        need_rows = used[-1] + 1 if used else 0
        need_cap = max((self._rows[i].length for i in used), default=0)
        if 2 * need_rows > self.k[0].shape[0] and 2 * need_cap > self.capacity:
            self._over_since = None
            return
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < self.shrink_after_s:
            return
        self._over_since = None
        if not used:
            self.k, self.v, self._rows = [], [], []
            return
        cap = min(-(-(need_cap + self.room) // self.room) * self.room, self.capacity)
        self.k = [k[:need_rows, :, :cap].clone() for k in self.k]
        self.v = [v[:need_rows, :, :cap].clone() for v in self.v]
        del self._rows[need_rows:]
        self.shrunk += 1

    def _alloc(self, rows: int, capacity: int) -> None:
        """Buffers with at least ``rows`` rows and ``capacity`` positions, keeping the contents
        (one copy of the pool per growth: rows by half, capacity by 25% or ``room``)."""
        cur_rows = self.k[0].shape[0] if self.k else 0
        cur_cap = self.capacity
        new_rows = cur_rows if rows <= cur_rows else max(rows, cur_rows + cur_rows // 2)
        new_cap = cur_cap if capacity <= cur_cap else \
            -(-max(capacity + self.room, cur_cap + cur_cap // 4) // self.room) * self.room
        if self.k and (new_rows, new_cap) == (cur_rows, cur_cap):
            return
        shape = (new_rows, self.kv_heads, new_cap, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for dst, src in zip(self.k + self.v, old_k + old_v):
            dst[:cur_rows, :, :cur_cap].copy_(src)
        self.grown += 1

    def reserve(self, length: int) -> None:
        """Room for ``length`` positions in every row."""
        self._collect()
        if length > self.capacity:
            self._alloc(max(self.rows, 1), length)

    # ------------------------------------------------------------------ rows
    def _free_row(self) -> int:
        for i, r in enumerate(self._rows):
            if r is None:
                return i
        self._rows.append(None)
        self._alloc(len(self._rows), self.capacity)
        return len(self._rows) - 1

    def ensure_resident(self, seq: PoolSeq) -> int:
        """Give ``seq`` a row (loading it back if it was spilled); returns the row."""
        self._collect()
        rec = seq.state
        if rec.row >= 0:
            return rec.row
        row = self._free_row()
        self._rows[row] = rec
        rec.row = row
        if rec.spilled is not None:
            n = rec.spilled[0][0].shape[2] if rec.spilled else 0
            self.reserve(n)
            for layer, (k, v) in enumerate(rec.spilled):
                self.k[layer][row, :, :n].copy_(k[0])
                self.v[layer][row, :, :n].copy_(v[0])
            rec.spilled = None
        return row

    def arrange(self, seqs: list[PoolSeq]) -> list[int]:
        """Place ``seqs`` on rows ``0..b-1`` (b = len(seqs)) and return each one's row.

        Sequences already on a row below b stay there; the others fill the free places, so a
        leave or a join moves at most the sequences it displaces, not every later row."""
        for s in seqs:
            self.ensure_resident(s)
        b = len(seqs)
        taken = {s.state.row for s in seqs if s.state.row < b}
        holes = iter(i for i in range(b) if i not in taken)
        for s in seqs:
            if s.state.row >= b:
                self._swap(next(holes), s.state.row)
        return [s.state.row for s in seqs]

    def _swap(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (copying only what their sequences hold)."""
        ra, rb = self._rows[a], self._rows[b]
        na, nb = (ra.length if ra else 0), (rb.length if rb else 0)
        for buf in self.k + self.v:
            if na and nb:
                n = max(na, nb)
                tmp = buf[a, :, :n].clone()
                buf[a, :, :n].copy_(buf[b, :, :n])
                buf[b, :, :n].copy_(tmp)
            elif nb:
                buf[a, :, :nb].copy_(buf[b, :, :nb])
            elif na:
                buf[b, :, :na].copy_(buf[a, :, :na])
        self._rows[a], self._rows[b] = rb, ra
        if ra is not None:
            ra.row = b
        if rb is not None:
            rb.row = a

    def spill(self, seq: PoolSeq) -> None:
        """Move ``seq``'s K/V out of the pool into tensors of its own length; frees its row."""
        self._collect()
        rec = seq.state
        if rec.row < 0:
            return
        n = rec.length
        rec.spilled = [(self.k[i][rec.row:rec.row + 1, :, :n].clone(),
                        self.v[i][rec.row:rec.row + 1, :, :n].clone()) for i in range(self.num_layers)]
        self._rows[rec.row] = None
        rec.row = -1
        self._collect()

    def fork(self, src: PoolSeq, dst: PoolSeq, length: int) -> None:
        """Make ``dst`` a copy of ``src``'s first ``length`` positions (``dst``'s own entries are
        dropped): shared prompt prefill. The copy is kept out of the pool, as a spilled
        sequence, until ``dst``'s next forward loads it into a row.

        Raises:
            ValueError: ``length`` outside ``[0, src's length]``, or ``src is dst``.
        """
        self._collect()
        s, d = src.state, dst.state
        if s is d:
            raise ValueError("dst: must be another sequence than src")
        if not 0 <= length <= s.length:
            raise ValueError(f"length: {length} outside the source's [0, {s.length}] positions")
        if s.row >= 0:
            kv = [(self.k[i][s.row:s.row + 1, :, :length], self.v[i][s.row:s.row + 1, :, :length])
                  for i in range(self.num_layers)]
        else:
            assert s.spilled is not None            # a sequence is resident or spilled
            kv = [(k[:, :, :length], v[:, :, :length]) for k, v in s.spilled]
        if d.row >= 0:
            self._rows[d.row] = None
            d.row = -1
        d.spilled = [(k.clone(), v.clone()) for k, v in kv]
        d.length = length

    def set_length(self, seq: PoolSeq, length: int) -> None:
        """Crop ``seq`` to ``length`` positions (never lengthens)."""
        rec = seq.state
        length = max(0, min(length, rec.length))
        if rec.spilled is not None:
            rec.spilled = [(k[:, :, :length], v[:, :, :length]) for k, v in rec.spilled]
        rec.length = length

    def compact(self, seq: PoolSeq, start: int, offsets: list[int]) -> None:
        """Keep entries ``start + offsets[m]`` at ``start + m`` in every layer, then set the
        length to ``start + len(offsets)`` (a tree verify's accepted path: DDTree's KV
        compaction). In place on the resident row (or the spilled tensors): one index_select
        and one copy per K and V per layer, of the entries from the first one that moves; none
        when ``offsets`` is ``0..n-1`` (a path straight down the block, as a chain's).

        ``start``, ``offsets``: as :func:`check_compact` wants them.

        Raises:
            ValueError: naming ``start`` or ``offsets`` (:func:`check_compact`).
        """
        rec = seq.state
        offsets = check_compact(rec.length, start, offsets)
        n = len(offsets)
        first = next((m for m, o in enumerate(offsets) if o != m), n)
        if first < n:
            if rec.row >= 0:
                bufs = [buf[rec.row] for buf in self.k + self.v]             # [H, cap, D] views
            else:
                bufs = [t[0] for kv in rec.spilled for t in kv]              # [H, len, D]
            dev = bufs[0].device
            src = torch.tensor([start + o for o in offsets[first:]], dtype=torch.int64, device=dev)
            for buf in bufs:
                # index_select copies first, so overlapping source and destination are safe
                buf[:, start + first:start + n].copy_(buf.index_select(1, src))
        self.set_length(seq, start + n)

    # ------------------------------------------------------------------ one forward
    def write(self, layer: int, row0: int, starts: torch.Tensor | int, k: torch.Tensor,
              v: torch.Tensor, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` [b, H, q, D] of rows ``row0..row0+b-1`` at positions ``starts[i]..``
        (``starts``: int for one row, else int64 [b], on the buffers' device) and return the
        K/V views ``[b, H, end, D]`` the attention reads; ``end`` = max(starts) + q, given by
        the caller when it knows it (computing it from a device tensor would synchronise)."""
        b, q = k.shape[0], k.shape[2]
        kb, vb = self.k[layer], self.v[layer]
        if isinstance(starts, int):
            kb[row0:row0 + b, :, starts:starts + q].copy_(k)
            vb[row0:row0 + b, :, starts:starts + q].copy_(v)
            end = starts + q
        else:
            idx = (starts[:, None] + torch.arange(q, device=starts.device))      # [b, q]
            idx = idx[:, None, :, None].expand(b, k.shape[1], q, k.shape[3])
            kb[row0:row0 + b].scatter_(2, idx, k)
            vb[row0:row0 + b].scatter_(2, idx, v)
            end = end if end is not None else int(starts.max()) + q
        return kb[row0:row0 + b, :, :end], vb[row0:row0 + b, :, :end]

    def advance(self, seqs: list[PoolSeq], counts: list[int]) -> None:
        """Lengths after a forward wrote ``counts[i]`` positions for ``seqs[i]``."""
        for s, n in zip(seqs, counts):
            s.state.length += n

    def views(self, row0: int, b: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the in-place K/V views ``[b, H, length, D]`` of rows ``row0..row0+b-1``
        (for a forward whose new K/V are not written into the pool, e.g. a drafter's block)."""
        return [(k[row0:row0 + b, :, :length], v[row0:row0 + b, :, :length])
                for k, v in zip(self.k, self.v)]

    def collect(self) -> None:
        """Free the rows of dropped handles now (and the buffers once no row is held) instead
        of at the next call: for an owner that drops sequences with no forward to follow."""
        self._collect()


class PoolStep:
    """The cache one forward hands transformers: each attention layer's ``update`` writes its
    new K/V into pool rows ``row0..`` at their own lengths (``starts``) and attends over the
    rows in place. Used only with an explicit mask and position ids, so transformers asks it
    for nothing else."""

    is_compileable = False

    def __init__(self, pool: KVPool, row0: int, starts: torch.Tensor | int, end: int):
        self.pool, self.row0, self.starts, self.end = pool, row0, starts, end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.write(layer_idx, self.row0, self.starts, key_states, value_states, self.end)
