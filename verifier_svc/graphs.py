"""CUDA graphs for the target's decode and verify forwards (``--cuda-graphs``, off by default).

A graph replays one forward's kernels with no Python and no launch overhead, which on a GPU is
most of a small batch's decode step. It needs fixed shapes and fixed addresses, so a forward
over pool rows ``row0..row0+b-1`` with ``q`` tokens is captured once per ``(row0, b, q, taps)``
and attends over the batch KV pool's whole capacity (``AttentionLayout.inputs`` masks the columns
past each row's length): the K/V buffers are the same tensors every step, written in place by
the captured scatter (``KVPool.write`` with device ``starts``). When the pool reallocates
(more rows or positions) every graph is dropped and recaptured on use. Inputs are copied into
static buffers; the logits are cloned out of the graph's output so a later replay cannot
overwrite what a caller still holds.

Only decode and verify shapes are captured (``q <= MAX_Q`` tokens, logits for every row): a
prefill chunk runs eagerly. Graphs of one target share one memory pool (vLLM's layout: they
never run at once). Greedy output with graphs equals eager output in tests/test_gpu.py (run by
scripts/gpu_check.sh); it stays off by default until a GPU run has shown that (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import torch

from dflash.core.kv_pool import PoolStep

log = logging.getLogger("dflash.verifier.graphs")

#: Most tokens per row a captured forward takes: an anchor plus up to 31 drafts or tree nodes.
MAX_Q = 32
#: Most graphs kept; past it the longest-kept one is dropped for a new shape.
MAX_GRAPHS = 64


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor          # [b, q] int64
    pos: torch.Tensor          # [b, q] int64
    mask: Any                  # bool [b, 1, q, capacity], or a dict of them by layer type
    starts: torch.Tensor       # [b] int64
    out: Any                   # the model output of the captured forward (static tensors)


class GraphRunner:
    """Captures and replays ``target.model`` forwards (module docstring)."""

    def __init__(self, target):
        self.target = target
        self._graphs: dict[tuple, _Graph] = {}
        self._signature: tuple | None = None
        self._pool = torch.cuda.graph_pool_handle()
        self.captured = 0          # graphs captured over the runner's life (a test reads it)
        self.replayed = 0

    def takes(self, b: int, q: int, logits_to_keep: int, trees) -> bool:
        """Whether this forward replays a graph: a decode or verify shape (module docstring)."""
        return logits_to_keep == 0 and q <= MAX_Q

    def run(self, ids: torch.Tensor, pos: torch.Tensor, mask, row0: int, lens: list[int],
            want: list[int] | bool):
        """The forward of ``TargetModel._run`` from a graph: ``ids`` / ``pos`` int64 [b, q],
        ``mask`` bool [b, 1, q, capacity] (or a dict), host tensors. Returns an object with
        ``logits`` (float [b, q, V], a copy) and ``hidden_states`` (the graph's, valid until
        the next replay: callers concatenate the taps at once)."""
        pool = self.target.pool
        signature = (pool.k[0].data_ptr(), pool.capacity, pool.k[0].shape[0])
        if signature != self._signature:       # reallocated: every captured address is stale
            self._graphs.clear()
            self._signature = signature
        b, q = ids.shape
        key = (row0, b, q, tuple(want) if isinstance(want, list) and want else False)
        g = self._graphs.get(key)
        fresh = g is None
        if g is None:
            if len(self._graphs) >= MAX_GRAPHS:
                del self._graphs[next(iter(self._graphs))]
            g = self._static(b, q, mask)
        _fill(g, ids, pos, mask, lens)
        if fresh:
            self._capture(g, row0, want)
            self._graphs[key] = g
        g.graph.replay()
        self.replayed += 1
        return SimpleNamespace(logits=g.out.logits.clone(), hidden_states=g.out.hidden_states)

    def _static(self, b: int, q: int, mask) -> _Graph:
        dev = self.target.device

        def like(m):
            return torch.zeros(m.shape, dtype=torch.bool, device=dev)

        return _Graph(graph=torch.cuda.CUDAGraph(),
                      ids=torch.zeros((b, q), dtype=torch.int64, device=dev),
                      pos=torch.zeros((b, q), dtype=torch.int64, device=dev),
                      mask={k: like(m) for k, m in mask.items()} if isinstance(mask, dict)
                      else like(mask),
                      starts=torch.zeros(b, dtype=torch.int64, device=dev), out=None)

    def _capture(self, g: _Graph, row0: int, want) -> None:
        """Warm up on a side stream (the forward writes the same K/V the replay will: the
        static inputs already hold this step's), then capture."""
        t = self.target
        end = t.pool.capacity

        def forward():
            return t.model(input_ids=g.ids, attention_mask=g.mask, position_ids=g.pos,
                           cache=PoolStep(t.pool, row0, g.starts, end), use_cache=True,
                           output_hidden_states=want, logits_to_keep=0)

        side = torch.cuda.Stream(device=t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(t.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.out = forward()
        self.captured += 1
        log.info("captured a CUDA graph: rows %d..%d, %d tokens, capacity %d (%d kept)",
                 row0, row0 + g.ids.shape[0] - 1, g.ids.shape[1], end, len(self._graphs) + 1)


def _fill(g: _Graph, ids, pos, mask, lens) -> None:
    """Copy this forward's host inputs into the graph's static buffers (asynchronously)."""
    def put(dst, src):
        dst.copy_(src.pin_memory(), non_blocking=True)

    put(g.ids, ids)
    put(g.pos, pos)
    if isinstance(mask, dict):
        for k, m in mask.items():
            put(g.mask[k], m)
    else:
        put(g.mask, mask)
    put(g.starts, torch.tensor(lens, dtype=torch.int64, device="cpu"))
