"""The target model: any transformers causal LM, loaded from safetensors only.

One call, :meth:`TargetModel.forward`, runs new tokens through the model with a KV cache and
returns the logits and the tapped hidden states (``dflash.taps`` convention).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash.checkpoint import target_fingerprint, torch_dtype
from dflash.growable import ROOM, append_into
from dflash.taps import hidden_state_indices
from kernels.skinny_linear import (AUTO, DEFAULT_MAX_ROWS, tune_max_rows, tuning_summary,
                                   use_skinny_linear)

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
    bit-identical results (SmolLM2, 300 cached positions, 2 cores, interleaved medians: verify of
    5 / 9 / 16 tokens 102 / 158 / 147 -> 94 / 134 / 133 ms; logits equal). CPU only: CUDA's
    flash kernel refuses a mask with grouped heads and the math fallback would be slower.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


class TargetModel:
    """A loaded target plus its card fields.

    Args:
        path: Hugging Face model directory (config.json + safetensors). ``trust_remote_code`` is
            never set and ``use_safetensors=True`` refuses pickled weights.
        dtype: "float32" | "bfloat16" | "float16".
        skinny_max_rows: linear layers with 2..N input rows use the transposed product
            (``kernels.skinny_linear``: a verify of 3 tokens 118 -> 77 ms for SmolLM2 on 2 CPU
            cores); 0 = plain ``F.linear`` everywhere.

    On CPU it calls :func:`grouped_kv_attention` before loading.

    Raises:
        FileNotFoundError / OSError: no loadable checkpoint at ``path``.
    """

    def __init__(self, path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 skinny_max_rows: int = DEFAULT_MAX_ROWS):
        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        if self.device.type == "cpu":
            grouped_kv_attention()
        self.model = self._load()
        self.skinny_max_rows = skinny_max_rows
        use_skinny_linear(self.model, skinny_max_rows)
        self.config = self.model.config
        raw = json.loads((self.path / "config.json").read_text())
        text = raw.get("text_config", raw)
        self.hidden_size: int = self.config.hidden_size
        self.num_layers: int = self.config.num_hidden_layers
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_positions: int = getattr(self.config, "max_position_embeddings", 1 << 30)
        rp = getattr(self.config, "rope_parameters", None) or {}
        self.rope_theta = float(rp.get("rope_theta", getattr(self.config, "rope_theta", 0.0)) or 0.0)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        embed = self.model.get_input_embeddings().weight
        if hasattr(embed, "full_tensor"):  # a sharded DTensor (expert parallel): gather, all ranks
            embed = embed.full_tensor()
        self.fingerprint = target_fingerprint(text, embed.detach().cpu())
        # One forward at a time: torch on CPU already uses every core for one call.
        self.lock = threading.Lock()

    def _load(self) -> torch.nn.Module:
        """The eval-mode model (``verifier_svc.ep.EPShard`` loads this rank's expert shard)."""
        return AutoModelForCausalLM.from_pretrained(
            str(self.path), dtype=self.dtype, use_safetensors=True).to(self.device).eval()

    def new_cache(self) -> DynamicCache:
        """A session's cache; its full-attention layers append in place (:class:`_AppendLayer`)."""
        cache = DynamicCache(config=self.config)
        cache.layers = [_AppendLayer() if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
        return cache

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: DynamicCache, layer_ids: tuple[int, ...] | None,
                logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` at positions ``cache.get_seq_length() ..`` and append them to ``cache``.

        ``logits_to_keep``: 0 = logits for every position (verification); 1 = only the last
        (prefill: the LM head over a 256-token chunk is 256 x 49152 x 576 multiply-adds for
        SmolLM2, most of a chunk's time on a CPU, for rows nobody reads).

        Returns:
            logits: float32 [n or logits_to_keep, vocab].
            taps: [n, len(layer_ids) * hidden] in the model dtype, or None when no layer ids.
        """
        ids = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        want = hidden_state_indices(layer_ids) if layer_ids else False
        out = self.model(input_ids=ids, cache=cache, use_cache=True,
                         output_hidden_states=want, logits_to_keep=logits_to_keep)
        logits = out.logits[0].float()
        taps = None
        if layer_ids:
            taps = torch.cat([out.hidden_states[j][0] for j in want], dim=-1)
        return logits, taps

    @staticmethod
    def own(cache: DynamicCache) -> None:
        """Copy a cache whose layers are views of a batched cache (``forward_batch``) into
        tensors of its own, so an idle session does not keep a whole batch's K/V alive (nor
        its own append room)."""
        for layer in getattr(cache, "layers", ()):
            if isinstance(layer, _AppendLayer):
                layer.release_buffers()
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()

    def tune_skinny(self, context: int = 64) -> int:
        """With ``skinny_max_rows`` :data:`kernels.skinny_linear.AUTO`: time decode- and
        verify-shaped forwards (1 / 2 / 4 / 8 / 16 tokens after ``context`` cached positions)
        with and without the transposed product and keep the faster, per row count for one
        row (``kernels.skinny_linear.tune_max_rows``).
        Call on the thread that runs the forwards. Returns the row limit in use (unchanged
        when it was set explicitly)."""
        if self.skinny_max_rows != AUTO:
            return self.skinny_max_rows
        cache = self.new_cache()
        ids = [i % self.vocab_size for i in range(1, context + 1)]
        self.forward(ids, cache, None, logits_to_keep=1)

        def probe(n: int) -> None:
            self.forward(ids[:n], cache, None)
            self.crop(cache, context)

        with self.lock:
            self.skinny_max_rows, timings = tune_max_rows(self.model, probe, rows=(1, 2, 4, 8, 16))
        log.info("%s", tuning_summary(self.skinny_max_rows, timings))
        return self.skinny_max_rows

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Keep the first ``length`` positions (transformers 5: crop takes a negative count)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    @torch.inference_mode()
    def forward_batch(self, blocks: list[list[int]], caches: list[DynamicCache],
                      layer_ids: list[tuple[int, ...]]
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several sessions in one target forward (continuous batching).

        Each session's cache is LEFT-padded to the longest and its block RIGHT-padded to the
        longest; a 2D attention mask hides the left padding and explicit ``position_ids`` give
        each row its own positions. Right padding needs no mask: it comes after every real
        token, which attends causally. Each session's cache then becomes a view of its row of
        the batched cache (its real positions plus its block): no second copy of its K/V per
        step (:meth:`own` turns views back into owned tensors when a session is kept idle).

        ``layer_ids[i]``: session i's taps (sessions may use different drafters).
        Returns per session ``(logits [n_i, vocab] float32, taps [n_i, len(layer_ids[i]) * H]``
        or None when it taps nothing).
        """
        if len(blocks) == 1:
            return [self.forward(blocks[0], caches[0], layer_ids[0])]
        b = len(blocks)
        lens = [c.get_seq_length() for c in caches]                      # cached positions
        ctx, q = max(lens), max(len(x) for x in blocks)
        ids = torch.zeros((b, q), dtype=torch.int64)
        mask = torch.zeros((b, ctx + q), dtype=torch.int64)
        pos = torch.zeros((b, q), dtype=torch.int64)
        for i, (blk, n) in enumerate(zip(blocks, lens)):
            ids[i, :len(blk)] = torch.tensor(blk)
            mask[i, ctx - n:] = 1
            pos[i] = torch.arange(n, n + q)
        batched = DynamicCache(config=self.config)
        for layer in range(len(caches[0].layers)):
            ks = [c.layers[layer].keys for c in caches]
            vs = [c.layers[layer].values for c in caches]
            room = q if type(batched.layers[layer]) is DynamicLayer else 0
            k = ks[0].new_empty((b, ks[0].shape[1], ctx + room, ks[0].shape[3]))
            v = vs[0].new_empty((b, vs[0].shape[1], ctx + room, vs[0].shape[3]))
            for i, n in enumerate(lens):
                if n < ctx:                       # left padding: masked, but must be finite
                    k[i, :, :ctx - n] = 0
                    v[i, :, :ctx - n] = 0
                k[i, :, ctx - n:ctx] = ks[i][0]
                v[i, :, ctx - n:ctx] = vs[i][0]
            if room:
                batched.layers[layer] = _AppendLayer(k, v, ctx)
            else:
                batched.update(k, v, layer)
        want = sorted({j for ids_i in layer_ids for j in hidden_state_indices(ids_i)}) or False
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), cache=batched, use_cache=True,
                         output_hidden_states=want)
        results = []
        for i, (blk, cache) in enumerate(zip(blocks, caches)):
            m = len(blk)
            start = ctx - lens[i]
            for dst, bl in zip(cache.layers, batched.layers):
                if isinstance(dst, _AppendLayer):
                    dst.release_buffers()
                dst.keys = bl.keys[i:i + 1, :, start:ctx + m]
                dst.values = bl.values[i:i + 1, :, start:ctx + m]
            logits = out.logits[i, :m].float()
            taps = torch.cat([out.hidden_states[j][i, :m] for j in hidden_state_indices(layer_ids[i])],
                             dim=-1) if layer_ids[i] else None
            results.append((logits, taps))
        return results


class _AppendLayer(DynamicLayer):
    """A cache layer that appends in place instead of concatenating (sessions' caches and the
    batched cache of :meth:`TargetModel.forward_batch`).

    ``DynamicLayer.update`` concatenates: every forward copied the whole K/V once more per layer
    (SmolLM2, 300 cached positions: 60 copies, 14 MB per step, growing with the context; at
    ~320 positions, interleaved medians on 2 cores: decode 71.7 / 67.7 -> 70.6 / 67.7 ms, verify
    of 4 tokens 81.0 / 75.3 -> 79.3 / 67.1 ms; the batched cache of 32 sessions x 1 token: 87 of
    340 ms).
    Here ``keys`` / ``values`` are views ``[:, :, :n]`` of buffers with up to :attr:`ROOM`
    spare positions; ``update`` writes the new positions after ``n`` and re-views,
    ``crop`` (inherited) only shortens the views, so a rejected draft's positions are simply
    overwritten by the next step. When the views are not this layer's buffer any more (a batched
    step or :meth:`TargetModel.own` replaced them) or the room is used up, the next update copies
    once into a new buffer, as ``DynamicLayer`` did every time.

    Args:
        keys, values: optional buffers [batch, kv_heads, length + room, head_dim] (model dtype)
            whose first ``length`` positions are filled (the batched cache allocates the step's
            block as its room); None = empty, allocated by the first update.
    """

    #: Spare positions allocated per growth (a copy of the cache every ROOM appended tokens).
    ROOM = ROOM

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 length: int = 0):
        super().__init__()
        self._kbuf, self._vbuf = keys, values
        if keys is not None:
            self.device = keys.device
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.is_initialized = True

    def release_buffers(self) -> None:
        """Forget the buffers before ``keys`` / ``values`` are replaced from outside."""
        self._kbuf = self._vbuf = None

    def _holds(self, n: int, new: torch.Tensor) -> bool:
        """``keys`` is still a prefix view of this layer's buffer and ``n`` positions fit."""
        b = self._kbuf
        return (b is not None and self.keys.data_ptr() == b.data_ptr()
                and self.keys.stride() == b.stride() and b.shape[:2] == new.shape[:2]
                and b.dtype == new.dtype and n <= b.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cur = self.keys.shape[-2] if self.keys.numel() else 0
        end = cur + key_states.shape[-2]
        # Not (or no longer) our buffer: append_into copies the current views into a new one.
        kb, vb = (self._kbuf, self._vbuf) if self._holds(end, key_states) else (self.keys, self.values)
        self._kbuf = append_into(kb, cur, key_states, 2, self.ROOM)
        self._vbuf = append_into(vb, cur, value_states, 2, self.ROOM)
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values
