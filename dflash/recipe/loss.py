"""The drafter's training loss, shared by the offline trainer (``dflash.train.trainer``) and the
online learner (``dflash.learn``): the block cross-entropy weighted by position, computed over
the target's LM head in chunks, and the acceptance statistics of a batch.

Recipe: docs/training.md ("Recipe"); dflash.md section 5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.recipe.blocks import BlockBatch
from dflash.recipe.selector_loss import predecessors, row_ids, selector_loss


def weighted_ce(hidden: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, chunk: int, soft_ids: torch.Tensor | None = None,
                soft_p: torch.Tensor | None = None, kl_weight: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the weighted loss and argmax predictions, logits computed ``chunk`` rows at a time.

    hidden [M, H]; head_w [V', H]; labels [M] in [0, V'); weights [M] (float32).
    With ``kl_weight`` w > 0, soft_ids [M, K] (rows of head_w, -1 = not in the softmax) and
    soft_p [M, K] (float32, the target's top-k probabilities renormalised, 0 where unused) add
    self-logit distillation: per row ``(1-w) CE(label) + w * (-sum_k p_k log q(id_k))``, the
    cross-entropy to the target's distribution (KL up to the target's constant entropy).
    Returns (sum_m w_m * loss_m, predictions [M]). Chunks are recomputed in backward
    (activation checkpointing), so peak memory holds one chunk of logits.
    """
    soft = kl_weight > 0 and soft_ids is not None

    def part(h, y, w, si=None, sp=None):
        logits = F.linear(h, head_w).float()
        lsm = torch.log_softmax(logits, -1)
        loss = -lsm.gather(1, y[:, None])[:, 0]
        if si is not None:
            kl = -(sp * lsm.gather(1, si.clamp_min(0))).sum(-1)
            loss = (1 - kl_weight) * loss + kl_weight * kl
        return (loss * w).sum(), logits.argmax(-1)

    total, preds = hidden.new_zeros((), dtype=torch.float32), []
    for i in range(0, hidden.shape[0], chunk):
        sl = slice(i, i + chunk)
        args = (hidden[sl], labels[sl], weights[sl]) + ((soft_ids[sl], soft_p[sl]) if soft else ())
        if torch.is_grad_enabled():
            loss, p = checkpoint(part, *args, use_reentrant=False)
        else:
            loss, p = part(*args)
        total, preds = total + loss, preds + [p]
    return total, torch.cat(preds) if preds else labels.new_zeros(0)


def batch_loss(drafter: DFlashDrafter, head: TargetHead, batch: BlockBatch, head_w: torch.Tensor,
               label_map: torch.Tensor | None, chunk: int, kl_weight: float = 0.0,
               selector_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Normalised weighted loss for one :class:`BlockBatch` and accuracy statistics.

    A DFlash2 drafter adds ``selector_weight`` times its selector's loss
    (``dflash.recipe.selector_loss``) and is scored by its selector's choices."""
    B = drafter.cfg.block_size
    sel_mod = getattr(drafter, "candidate_selector", None)
    ctx_kv = drafter.context_kv(batch.ctx_features.float(), batch.ctx_positions)
    kw = {"block_len": B} if sel_mod is not None else {}
    out = drafter(head.embed_tokens(batch.block_ids), batch.block_positions, ctx_kv, batch.mask, **kw)
    sel = batch.labels >= 0                                             # [b, q]
    labels = batch.labels[sel]
    if label_map is not None:
        labels = label_map[labels]
    w = batch.weights[sel]
    soft_ids = soft_p = None
    if kl_weight > 0:
        if batch.soft_ids is None:
            raise ValueError("kl_weight: the batch has no target distribution (feature cache without top-k)")
        soft_ids, soft_p = batch.soft_ids[sel], batch.soft_p[sel]
        if label_map is not None:
            soft_ids = label_map[soft_ids]
            soft_p = torch.where(soft_ids >= 0, soft_p, 0.0)
            soft_p = soft_p / soft_p.sum(-1, keepdim=True).clamp_min(1e-9)
    loss_sum, preds = weighted_ce(out[sel], head_w, labels, w, chunk, soft_ids, soft_p, kl_weight)
    if sel_mod is not None:
        prev = predecessors(batch.block_ids, batch.labels, B, drafter.cfg.mask_token_id)[sel]
        ids = row_ids(label_map, head_w.shape[0], head_w.device)
        s_sum, preds = selector_loss(sel_mod, out[sel], head_w, ids, labels, prev, w, chunk)
        loss_sum = loss_sum + selector_weight * s_sum
    loss = loss_sum / w.sum().clamp_min(1e-9)
    # per-position accuracy and accepted prefix length (drafts accepted per block)
    correct = torch.zeros_like(batch.labels, dtype=torch.bool)
    correct[sel] = preds == labels
    correct = correct.view(correct.shape[0], -1, B)[:, :, 1:]           # [b, N, B-1]
    valid = sel.view(sel.shape[0], -1, B)[:, :, 1:]
    has_block = valid[:, :, 0]
    acc_pos = (correct & valid).sum((0, 1)).float() / valid.sum((0, 1)).clamp_min(1)
    accepted = torch.cumprod(correct.int(), dim=-1).sum(-1)[has_block].float()
    stats = {"acc_pos": acc_pos.tolist(), "accept_len": accepted.mean().item() if accepted.numel() else 0.0,
             "correct": (correct & valid).sum((0, 1)).cpu(), "valid": valid.sum((0, 1)).cpu(),
             "accepted_sum": accepted.sum().item(), "blocks": int(accepted.numel())}
    return loss, stats
