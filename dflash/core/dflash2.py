"""The DFlash2 drafter (torch): DFlash plus a grouped dynamic convolution and a candidate selector.

Restated from the published method (Inco AI with z-lab, 2026; the ``DFlash2DraftModel``
checkpoints and vLLM's ``qwen3_dflash2`` port were read, no code taken):

* **Grouped dynamic causal convolution** around each attention and each MLP sublayer of every
  layer. From the (normed) sublayer input ``u`` one projection gives ``2 * taps * G`` dynamic
  coefficients per row (``G = H / conv_group_size`` groups of channels): a *prepare* half and a
  *finish* half. ``conv(x)[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]``, the
  taps that reach before the row's block start dropped. The sublayer sees ``conv_prepare(u)``,
  its output goes through ``conv_finish`` before the residual add. ``base_kernel`` is
  ``[2 (prepare, finish), taps, H]``.
* **Candidate selector** over the target head's top-K per draft slot: candidate values are the
  head's logits soft-capped (``cap * tanh(z / cap)``) then times ``output_multiplier``; the edge
  from candidate ``p`` of slot ``l - 1`` (the anchor for slot 0) to candidate ``c`` of slot ``l``
  scores ``unary[l, c] + <P[tok_p] * W h_l, S[tok_c]>`` (``P``/``S`` the predecessor/successor
  codebooks ``[V, rank]``, ``W`` the hidden projection, ``h_l`` the slot's final hidden). A chain
  is the greedy walk from the anchor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from dflash.core.config import DrafterConfig
from dflash.core.modeling import DFlashAttention, DFlashDrafter, LayerKV, _and_masks, _qwen3_config


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor,
                 block_len: int) -> torch.Tensor:
    """One side of the grouped dynamic causal convolution.

    Args:
        x: [b, q, H] rows; row j sits at offset ``j % block_len`` of its block.
        delta: [b, q, taps, G] dynamic coefficients (G groups of ``H / G`` channels).
        base: [taps, H] static coefficients.
        block_len: rows per block; a tap never reaches into the previous block.
    Returns:
        [b, q, H], dtype of ``x``.
    """
    b, q, h = x.shape
    taps, groups = delta.shape[-2], delta.shape[-1]
    xs = x.view(b, q, groups, h // groups)
    coef = base.view(taps, groups, h // groups) + delta.unsqueeze(-1)    # [b, q, taps, G, gs]
    out = coef[:, :, 0] * xs
    offset = torch.arange(q, device=x.device) % block_len
    for t in range(1, taps):
        shifted = F.pad(xs[:, :q - t], (0, 0, 0, 0, t, 0))
        keep = (offset >= t).to(x.dtype).view(1, q, 1, 1)
        out = out + coef[:, :, t] * shifted * keep
    return out.reshape(b, q, h)


class GroupedConv(nn.Module):
    """``attention_conv`` / ``mlp_conv``: ``base_kernel`` [2, taps, H] and
    ``kernel_projection`` (H -> 2 * taps * G, no bias)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, u: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """u [b, q, H] -> (conv_prepare(u) [b, q, H], finish coefficients [b, q, taps, G])."""
        b, q, _ = u.shape
        coef = self.kernel_projection(u).view(b, q, 2, self.taps, self.groups)
        return grouped_conv(u, coef[:, :, 0], self.base_kernel[0], block_len), coef[:, :, 1]

    def finish(self, y: torch.Tensor, coef: torch.Tensor, block_len: int) -> torch.Tensor:
        """y [b, q, H] (the sublayer's output) -> conv_finish(y) [b, q, H]."""
        return grouped_conv(y, coef, self.base_kernel[1], block_len)

    def init_identity(self) -> None:
        """Both sides the identity (tap 0 = 1, others 0, no dynamic part)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()


class DFlash2DecoderLayer(nn.Module):
    """A DFlash layer whose two sublayers are wrapped in :class:`GroupedConv`."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(_qwen3_config(cfg))
        self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, cos, sin, ctx_kv: LayerKV, mask, block_len: int):
        u, coef = self.attention_conv.prepare(self.input_layernorm(x), block_len)
        x = x + self.attention_conv.finish(self.self_attn(u, cos, sin, ctx_kv, mask), coef, block_len)
        u, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_len)
        return x + self.mlp_conv.finish(self.mlp(u), coef, block_len)


class CandidateSelector(nn.Module):
    """``candidate_selector``: ``predecessor_codebook`` / ``successor_codebook`` [V, rank],
    ``hidden_projection`` (H -> rank, no bias)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.softcap = cfg.final_logit_softcapping
        self.multiplier = cfg.output_multiplier
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidate_values(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits [..., N] -> candidate values (soft-capped, then scaled), float32."""
        z = logits.float()
        if self.softcap > 0:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z * self.multiplier if self.multiplier != 1.0 else z

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K per slot of :meth:`candidate_values`.

        Args: logits float [L, N]. Returns (columns int64 [L, k], values float32 [L, k]),
        k = min(top_k, N), descending by value, ties by ascending column.
        """
        v = self.candidate_values(logits)
        k = min(self.top_k, v.shape[-1])
        vals, cols = v.topk(k, dim=-1)
        # ties by ascending column: sort the columns, then a stable sort by value
        cols, order = cols.sort(dim=-1)
        vals = vals.gather(-1, order)
        vals, order = vals.sort(dim=-1, descending=True, stable=True)
        return cols.gather(-1, order), vals

    def edges(self, cand_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
              anchor: torch.Tensor) -> torch.Tensor:
        """Edge scores [b, L, k, k] float32: ``[., l, p, c]`` from predecessor p (slot l - 1's
        candidate p; for l = 0 every p is the anchor) to slot l's candidate c.

        Args:
            cand_ids: int64 [b, L, k] candidate token ids (target vocabulary).
            unary: float [b, L, k] candidate values.
            hidden: [b, L, H] the slots' final hidden states.
            anchor: int64 [b] the anchor token ids.
        """
        k = cand_ids.shape[-1]
        prev = torch.cat([anchor.view(-1, 1, 1).expand(-1, 1, k), cand_ids[:, :-1]], dim=1)
        pred = self.predecessor_codebook[prev].float()                   # [b, L, k, r]
        succ = self.successor_codebook[cand_ids].float()                 # [b, L, k, r]
        proj = self.hidden_projection(hidden).float()                    # [b, L, r]
        pair = torch.einsum("blpr,blcr->blpc", pred * proj.unsqueeze(2), succ)
        return unary.float().unsqueeze(2) + pair

    def init_neutral(self, std: float = 0.02, seed: int = 0) -> None:
        """Codebooks random (so gradients reach the projection), projection zero: every pairwise
        term is 0 and the selector ranks candidates by their values alone."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for cb in (self.predecessor_codebook, self.successor_codebook):
                cb.copy_(torch.randn(cb.shape, generator=g) * std)
            self.hidden_projection.weight.zero_()


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 drafter: the DFlash state-dict names plus ``layers.N.attention_conv.*``,
    ``layers.N.mlp_conv.*`` and ``candidate_selector.*`` (z-lab DFlash2 names)."""

    def __init__(self, cfg: DrafterConfig):
        if not cfg.is_dflash2:
            raise ValueError("DFlash2Drafter needs a DFlash2DraftModel config")
        super().__init__(cfg)
        self.layers = nn.ModuleList(DFlash2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.candidate_selector = CandidateSelector(cfg)

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                ctx_kv: list[LayerKV], mask: torch.Tensor | None = None,
                context_positions: torch.Tensor | None = None,
                block_len: int | None = None) -> torch.Tensor:
        """As :meth:`DFlashDrafter.forward`; ``block_len``: rows per block for the convolution
        (training packs N blocks of ``block_size`` in a row); None = each row is one block.
        ``block_embeds`` are scaled by ``input_embedding_scale`` here."""
        cos, sin = self.rope(block_positions, block_embeds)
        x = block_embeds * self.cfg.input_embedding_scale \
            if self.cfg.input_embedding_scale != 1.0 else block_embeds
        blen = block_len or x.shape[1]
        for layer, kv in zip(self.layers, ctx_kv):
            layer_mask = mask
            if layer.self_attn.sliding_window is not None:
                layer_mask = _and_masks(mask, self._window_mask(block_positions, kv, layer,
                                                                context_positions))
            x = layer(x, cos, sin, kv, layer_mask, blen)
        return self.norm(x)

    def init_from_dflash(self, v1: DFlashDrafter) -> None:
        """Copy every DFlash tensor of ``v1`` (same shapes) and make the new modules neutral
        (:meth:`GroupedConv.init_identity`, :meth:`CandidateSelector.init_neutral`), so the
        drafter's hidden states equal ``v1``'s and its chain drafts are ``v1``'s argmax."""
        missing, unexpected = self.load_state_dict(v1.state_dict(), strict=False)
        if unexpected or any(not ("_conv." in k or k.startswith("candidate_selector.")) for k in missing):
            raise ValueError(f"not a DFlash drafter of this shape: missing {missing}, "
                             f"unexpected {unexpected}")
        for layer in self.layers:
            layer.attention_conv.init_identity()
            layer.mlp_conv.init_identity()
        self.candidate_selector.init_neutral()


def selector_rows(selector: CandidateSelector, logits: torch.Tensor, hidden: torch.Tensor,
                  anchor: int, draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """One block's draft rows along the selector's best path.

    Row l holds, on slot l's top-K candidate columns, the edge scores from the path's slot
    l - 1 token (the anchor for l = 0), ``-inf`` elsewhere: its argmax is the greedy walk's
    token (first column among ties), and a draft sampled from ``softmax(row / T)`` is drawn
    from the proposal q that the row states (the walk conditions on the greedy path, which
    is fixed before any token is sampled, so verification stays exact).

    Args:
        logits: float32 [L, N] head logits of the L draft slots (N = draft vocabulary size
            when ``draft_vocab`` int64 [N] is given, else V).
        hidden: [L, H] the slots' final hidden states.
        anchor: the anchor's target token id.
    Returns:
        float32 [L, N].
    """
    cols, vals = selector.candidates(logits)                           # [L, k]
    ids = draft_vocab[cols] if draft_vocab is not None else cols
    scores = selector.edges(ids[None], vals[None], hidden[None],
                            torch.tensor([anchor], device=logits.device))[0]   # [L, k, k]
    rows = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    prev = torch.zeros(1, dtype=torch.int64, device=logits.device)
    for lvl in range(logits.shape[0]):       # tensor indices throughout: no host round trip
        rows[lvl].scatter_(0, cols[lvl], scores[lvl].index_select(0, prev)[0])
        best = rows[lvl].argmax()
        prev = (cols[lvl] == best).to(torch.int64).argmax().view(1)
    return rows
