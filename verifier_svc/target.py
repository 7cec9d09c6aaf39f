"""The target model: any transformers causal LM, loaded from safetensors only.

One call, :meth:`TargetModel.forward`, runs new tokens through the model with a KV cache and
returns the logits and the tapped hidden states (``dflash.core.taps`` convention).

A block is either a chain (each token follows the one before) or a tree (DDTree: Ringel &
Romano, arXiv 2604.12989; reference code liranringel/ddtree): the anchor plus draft nodes, each
with a parent earlier in the block. A tree is verified in the same one forward, with position
ids by depth and an ancestor-only mask over the block; :meth:`TargetModel.keep` then compacts
the accepted root-to-node path's K/V in place (``KVPool.compact``).
"""

from __future__ import annotations

import json
import logging
import operator
import os
import threading
from pathlib import Path
from typing import ClassVar, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from dflash.core.checkpoint import target_fingerprint
from dflash.core.device import DeviceError, checkpoint_dtype, resolve_device, resolve_dtype, to_device
from dflash.core.kv_pool import KVPool, PoolSeq, PoolStep
from dflash.core.taps import hidden_state_indices
from kernels.invariant import register_attention
from kernels.skinny_linear import (
    AUTO,
    DEFAULT_MAX_ROWS,
    set_invariant,
    switch_linear,
    tune_max_rows,
    tune_products,
    tuning_summary,
)
from verifier_svc.target_layout import read_layout
from verifier_svc.tree import check_tree

log = logging.getLogger("dflash.verifier.target")


class TargetUnavailable(RuntimeError):
    """The target can no longer run (e.g. an expert-parallel rank died); maps to UNAVAILABLE."""


def grouped_kv_attention() -> None:
    """Have transformers pass grouped K/V to SDPA (``enable_gqa``) for masked multi-token
    forwards too, through its own switch ``TRANSFORMERS_SDPA_FORCE_GQA`` (set unless the
    environment already sets it).

    With a mask (every verify of more than one token, every batched step) transformers otherwise
    repeats each layer's cached K/V to the query heads (``repeat_kv``): a copy of the whole cache
    per layer and step. PyTorch's CPU flash kernel takes grouped K/V with a mask itself, with
    bit-identical logits and without that copy (figures: ``docs/bench/perf-history/README.md``,
    "verifier_svc/target.py"). CPU only: CUDA's flash kernel refuses a mask with grouped heads
    and the math fallback would be slower.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


class TargetModel:
    """A loaded target plus its card fields.

    Args:
        path: Hugging Face model directory (config.json + safetensors). ``trust_remote_code`` is
            never set and ``use_safetensors=True`` refuses pickled weights.
        dtype: "float32" | "bfloat16" | "float16" | "auto" (``dflash.core.device.resolve_dtype``: the
            checkpoint's dtype on a GPU, float32 on a CPU) or a torch dtype.
        device: "cpu" | "cuda" | "cuda:N" | "auto" or a torch device
            (``dflash.core.device.resolve_device``). Weights, the batch KV pool and every tensor a
            forward creates live there; inputs are built on the host and copied once per
            forward (``dflash.core.device.to_device``), outputs stay on the device.
        cuda_graphs: replay decode and verify forwards from CUDA graphs captured per batch
            shape (``verifier_svc.graphs``); CUDA only, off by default.
        skinny_max_rows: linear layers with 2..N input rows use the transposed product
            (``kernels.skinny_linear``; CPU only); 0 = plain ``F.linear`` everywhere.
        packed_linear: "on": the linear layers (LM head included) take oneDNN products on
            prepacked weights (``kernels.packed_linear``; CPU only); "auto": measured against
            the other paths by :meth:`tune_skinny`; "off" (default) never.
        panel_linear: the same choices for the float32 panel product on AVX-512 CPUs
            (``kernels.panel_linear``), tuned after the other two.
        batch_invariant: linear layers and attention take :mod:`kernels.invariant` (a verify
            of k rows is k decodes bit for bit; docs/batch-invariance.md). Not with graphs.

    On CPU it calls :func:`grouped_kv_attention` before loading.

    Raises:
        FileNotFoundError / OSError: no loadable checkpoint at ``path``.
        dflash.core.device.DeviceError: naming ``--device`` / ``--dtype`` / ``--cuda-graphs`` for a
            device that is not there, a dtype outside the list, graphs without CUDA or with
            ``--batch-invariant``.
        ValueError: naming the config field, for a layout the batch KV pool cannot hold
            (``verifier_svc.target_layout.read_layout``).
    """

    #: The autograd mode :meth:`forward`, :meth:`forward_batch` and :meth:`keep` run in; the
    #: pool's buffers are then inference tensors, written in place (``EPShard``: no_grad).
    _grad_mode: ClassVar[type[torch.inference_mode] | type[torch.no_grad]] = torch.inference_mode

    def __init__(self, path: str | Path, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", skinny_max_rows: int = DEFAULT_MAX_ROWS,
                 cuda_graphs: bool = False, packed_linear: str = "off", panel_linear: str = "off",
                 batch_invariant: bool = False):
        self.path = Path(path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, checkpoint_dtype(self.path), self.device)
        if cuda_graphs and self.device.type != "cuda":
            raise DeviceError("--cuda-graphs", f"needs a CUDA device, the target runs on {self.device}")
        if cuda_graphs and batch_invariant:
            raise DeviceError("--cuda-graphs", "not with --batch-invariant")
        if self.device.type == "cpu":
            grouped_kv_attention()
        self.model = self._load()
        self.skinny_max_rows = skinny_max_rows
        self.packed_linear, self.panel_linear = switch_linear(
            self.model, skinny_max_rows, packed_linear, self.device, panel_linear=panel_linear)
        self.config = self.model.config
        if self.model._is_stateful:    # a recurrent state, which the batch KV pool has no room for
            raise ValueError(f"model_type: {self.config.model_type!r} has recurrent (state-space or "
                             "linear-attention) layers; the batch KV pool holds attention K/V only")
        raw = json.loads((self.path / "config.json").read_text())
        text = raw.get("text_config", raw)
        self.hidden_size: int = self.config.hidden_size
        self.num_layers: int = self.config.num_hidden_layers
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        embed = cast(torch.Tensor, self.model.get_input_embeddings().weight)   # [V, H]
        self.fingerprint = target_fingerprint(text, _whole(embed).detach().cpu())
        layout = read_layout(self.config)
        self.max_positions: int = layout.max_positions
        self.rope_theta: float = layout.rope_theta
        self.attention = layout.attention
        self.batch_invariant = batch_invariant
        if batch_invariant:
            set_invariant(self.model, True)
            self.model.set_attn_implementation(register_attention())
        self.pool = KVPool(self.num_layers, layout.kv_heads, layout.head_dim, dtype=self.dtype,
                           device=self.device)
        self.graphs = None
        if cuda_graphs:
            from verifier_svc.graphs import GraphRunner

            self.graphs = GraphRunner(self)
        self.failure: str | None = None     # a single process never fails apart (cf. ep.py)
        self.supports_trees = True          # forward(parents=...) and keep() (module docstring)
        self.supports_fork = True           # fork() (shared prompt prefill)
        # One forward at a time: torch on CPU already uses every core for one call.
        self.lock = threading.Lock()

    def _load(self) -> PreTrainedModel:
        """The eval-mode model (``verifier_svc.ep.EPShard`` loads this rank's expert shard)."""
        return AutoModelForCausalLM.from_pretrained(
            str(self.path), dtype=self.dtype, use_safetensors=True
        ).to(self.device).eval()  # type: ignore[arg-type]  # .to's type: functools.wraps(nn.Module.to)

    def new_cache(self) -> PoolSeq:
        """A session's cache: a sequence of the batch KV pool."""
        return self.pool.new_seq()

    def forward(self, tokens: list[int], cache: PoolSeq, layer_ids: tuple[int, ...] | None,
                logits_to_keep: int = 0, parents: list[list[int] | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` at positions ``cache.get_seq_length() ..`` and append them to ``cache``.

        ``logits_to_keep``: 0 = logits for every position (verification); 1 = only the last
        (prefill: the LM head over every row of a chunk, ``chunk x V x H`` multiply-adds, is a
        large share of the chunk's cost on a CPU, for rows nobody reads).

        ``parents``: None (a chain) or ``[tree]`` (one entry per row, as in
        :meth:`forward_batch`; ``[None]`` is a chain): ``tree[j]`` is the block index of
        ``tokens[j]``'s parent, ``tree[0] == -1`` (the anchor). Query j then sits at position
        ``cached + depth(j)`` and sees the cache plus its own ancestors and itself (DDTree's
        verify forward); its K/V still go to cache slot ``cached + j`` and the cache grows by
        ``len(tokens)``, so :meth:`keep` (the accepted path) or :meth:`crop` must follow.

        Returns:
            logits: float32 [n or logits_to_keep, vocab]; row j belongs to ``tokens[j]``.
            taps: [n, len(layer_ids) * hidden] in the model dtype, or None when no layer ids.

        Raises:
            ValueError: ``parents`` malformed (:func:`check_parents`).
        """
        with self._grad_mode():
            trees = check_parents(parents, [tokens])
            pool = self.pool
            row = pool.ensure_resident(cache)
            n, q = cache.get_seq_length(), len(tokens)
            pool.reserve(n + q)
            want = hidden_state_indices(layer_ids) if layer_ids else False
            out = self._run(torch.tensor([tokens], dtype=torch.int64, device="cpu"), row, [n], want,
                            logits_to_keep, trees)
            pool.advance([cache], [q])
            taps = None
            if layer_ids:
                taps = torch.cat([out.hidden_states[j][0] for j in hidden_state_indices(layer_ids)],
                                 dim=-1)
            return out.logits[0].float(), taps

    def _run(self, ids: torch.Tensor, row0: int, lens: list[int], want: list[int] | bool,
             logits_to_keep: int = 0, trees: list[list[int] | None] | None = None):
        """One model forward over pool rows ``row0..row0+b-1``: ids [b, q] (host) with row i's
        tokens at positions ``lens[i]..``, K/V written into the pool in place (``PoolStep``),
        a boolean mask (:meth:`AttentionLayout.inputs`). The inputs are built on the host and
        copied to the device without waiting for it (``to_device``); with CUDA graphs a decode
        or verify shape replays its captured graph instead (``verifier_svc.graphs``)."""
        b, q = ids.shape
        end = max(lens) + q
        runner = (self.graphs if self.graphs is not None and self.graphs.takes(b, q, logits_to_keep, trees)
                  else None)
        pos, mask = self.attention.inputs(lens, q, self.pool.capacity if runner is not None else end,
                                          trees)
        if runner is not None:
            return runner.run(ids, pos, mask, row0, lens, want)
        dev = self.device
        mask = ({k: to_device(m, dev) for k, m in mask.items()} if isinstance(mask, dict)
                else to_device(mask, dev))
        starts = lens[0] if b == 1 else to_device(torch.tensor(lens, dtype=torch.int64,
                                                               device="cpu"), dev)
        return self.model(input_ids=to_device(ids, dev), attention_mask=mask,
                          position_ids=to_device(pos, dev),
                          cache=PoolStep(self.pool, row0, starts, end), use_cache=True,
                          output_hidden_states=want, logits_to_keep=logits_to_keep)

    def keep(self, cache: PoolSeq, start: int, offsets: list[int]) -> None:
        """After a tree forward whose block began at cache position ``start``: keep the block
        entries ``start + offsets[m]`` at ``start + m`` (the accepted root-to-node path, in
        path order) in every layer; the cache length becomes ``start + len(offsets)``. DDTree's
        commit (KV compaction), in place on the session's pool row (``KVPool.compact``).

        Raises:
            ValueError: ``start`` / ``offsets`` malformed (``dflash.core.kv_pool.check_compact``).
        """
        with self._grad_mode():
            self.pool.compact(cache, start, offsets)

    def own(self, cache: PoolSeq) -> None:
        """An idle session's K/V leaves the batch pool for tensors of its own length (its next
        turn moves it back: one copy per turn, none per step)."""
        self.pool.spill(cache)

    def fork(self, src: PoolSeq, dst: PoolSeq, length: int) -> None:
        """``dst`` takes a copy of ``src``'s first ``length`` KV positions (shared prompt
        prefill, ``KVPool.fork``). Raises ValueError for a ``length`` past ``src``'s."""
        self.pool.fork(src, dst, length)

    def close(self) -> None:
        """Nothing to stop (``DistributedTarget.close`` stops its ranks)."""

    def tune_skinny(self, context: int = 64) -> int:
        """With ``skinny_max_rows`` :data:`kernels.skinny_linear.AUTO`: time decode- and
        verify-shaped forwards (1 / 2 / 4 / 8 / 16 tokens after ``context`` cached positions)
        with and without the transposed product and keep the faster, per row count for one
        row (``kernels.skinny_linear.tune_max_rows``).
        With ``packed_linear`` "auto", then time 1 / 4 / 16 tokens with and without the
        prepacked product and keep it when faster (``kernels.skinny_linear.tune_packed``).
        With ``panel_linear`` "auto", last, time 1 / 2 / 4 / 8 / 16 tokens with and without the
        panel product (``kernels.skinny_linear.tune_panel``).
        Call on the thread that runs the forwards. Returns the row limit in use (unchanged
        when it was set explicitly, or off the CPU: the transposed product is CPU-only)."""
        tune_rows = self.skinny_max_rows == AUTO and self.device.type == "cpu"
        if self.batch_invariant or (not tune_rows and "auto" not in (self.packed_linear, self.panel_linear)):
            return self.skinny_max_rows     # invariant: every product is the invariant one
        cache = self.new_cache()
        ids = [i % self.vocab_size for i in range(1, context + 1)]
        self.forward(ids, cache, None, logits_to_keep=1)

        def probe(n: int) -> None:
            self.forward(ids[:n], cache, None)
            self.crop(cache, context)

        with self.lock:
            if tune_rows:
                self.skinny_max_rows, timings = tune_max_rows(self.model, probe, rows=(1, 2, 4, 8, 16))
                log.info("%s", tuning_summary(self.skinny_max_rows, timings))
            self.packed_linear, self.panel_linear = tune_products(
                self.model, probe, self.packed_linear, self.panel_linear)
        return self.skinny_max_rows

    def crop(self, cache: PoolSeq, length: int) -> None:
        """Keep the first ``length`` positions (a number moves; nothing is copied)."""
        self.pool.set_length(cache, length)

    def forward_batch(self, blocks: list[list[int]], caches: list[PoolSeq],
                      layer_ids: list[tuple[int, ...]],
                      parents: list[list[int] | None] | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several sessions in one target forward (continuous batching).

        The sessions are arranged onto pool rows ``0..b-1`` (``KVPool.arrange``: rows move only
        when the batch's make-up changed) and their blocks RIGHT-padded to the longest; each
        row's block K/V is written at its own length and its queries see its own positions
        only (``_run``'s mask), so no cache is gathered or copied back.

        ``layer_ids[i]``: session i's taps (sessions may use different drafters).
        ``parents``: None (every block a chain) or one entry per session, None (chain) or
        session i's tree over ``blocks[i]`` (:meth:`forward`); trees and chains share a step.
        Returns per session ``(logits [n_i, vocab] float32, taps [n_i, len(layer_ids[i]) * H]``
        or None when it taps nothing); row j of each belongs to block index j.

        Raises:
            ValueError: ``parents`` malformed (:func:`check_parents`).
        """
        with self._grad_mode():
            trees = check_parents(parents, blocks)
            if len(blocks) == 1:
                return [self.forward(blocks[0], caches[0], layer_ids[0], parents=trees)]
            pool = self.pool
            rows = pool.arrange(caches)              # session i on row rows[i] of 0..b-1
            b = len(blocks)
            lens = [0] * b
            for r, c in zip(rows, caches):
                lens[r] = c.get_seq_length()
            q = max(len(x) for x in blocks)
            pool.reserve(max(lens) + q)
            ids = torch.zeros((b, q), dtype=torch.int64, device="cpu")
            for r, blk in zip(rows, blocks):
                ids[r, :len(blk)] = torch.tensor(blk, dtype=torch.int64, device="cpu")
            by_row: list[list[int] | None] | None = None
            if trees is not None:
                by_row = [None] * b
                for r, tree in zip(rows, trees):
                    by_row[r] = tree
            want = sorted({j for ids_i in layer_ids for j in hidden_state_indices(ids_i)}) or False
            out = self._run(ids, 0, lens, want, trees=by_row)
            pool.advance(caches, [len(blk) for blk in blocks])
            results = []
            for r, blk, ids_i in zip(rows, blocks, layer_ids):
                m = len(blk)
                logits = out.logits[r, :m].float()
                taps = torch.cat([out.hidden_states[j][r, :m] for j in hidden_state_indices(ids_i)],
                                 dim=-1) if ids_i else None
                results.append((logits, taps))
            return results


def check_parents(parents: list[list[int] | None] | None, blocks: list[list[int]]
                  ) -> list[list[int] | None] | None:
    """Validate ``parents`` for ``blocks`` (one entry per block: None = chain, else a tree:
    ``len(blocks[i])`` ints, ``[0] == -1``, ``0 <= [j] < j`` for j >= 1). Returns None when
    every entry is a chain (the chain forward, unchanged), else ``parents`` as lists of ints.

    Raises:
        ValueError: naming ``parents`` and the offending row / index.
    """
    if parents is None:
        return None
    if not isinstance(parents, (list, tuple)) or len(parents) != len(blocks):
        n = len(parents) if isinstance(parents, (list, tuple)) else type(parents).__name__
        raise ValueError(f"parents: one entry per block expected ({len(blocks)}), got {n}")
    out: list[list[int] | None] = []
    for i, (tree, blk) in enumerate(zip(parents, blocks)):
        if tree is None:
            out.append(None)
            continue
        if not isinstance(tree, (list, tuple)) or len(tree) != len(blk):
            n = len(tree) if isinstance(tree, (list, tuple)) else type(tree).__name__
            raise ValueError(f"parents[{i}]: one parent per block token expected ({len(blk)}), "
                             f"got {n}")
        try:
            tree = [operator.index(p) for p in tree]
        except TypeError:
            raise ValueError(f"parents[{i}]: ints expected, got {tree!r}") from None
        check_tree(tree, len(blk) - 1, f"parents[{i}]")
        out.append(tree)
    return out if any(t is not None for t in out) else None


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` whole: a DTensor (sharded across the expert-parallel ranks) is gathered, a
    collective every rank runs; a plain tensor is returned as it is."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            return weight.full_tensor()
    return weight
