"""The release gate: a candidate drafter is released only if it beats the serving version on
the held-out conversations, by a margin, in a paired test.

Both drafters are scored teacher-forced on the same blocks (the trainer's held-out measure,
``dflash.recipe.loss.batch_loss`` over the full vocabulary): per held-out conversation, fixed
anchors (seeded by its number), accepted drafts per block. The statistic is the relative gain
in τ = 1 + accepted / blocks over all conversations; a paired bootstrap over conversations
(resampling whole conversations, both drafters together) gives its one-sided lower bound, and
the candidate is released only if that bound exceeds ``margin``.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.recipe.blocks import build_batch, sample_anchors, valid_anchors
from dflash.recipe.loss import batch_loss


@dataclasses.dataclass(frozen=True)
class ConvScore:
    """One conversation's teacher-forced acceptance: accepted drafts over ``blocks`` blocks."""

    seq: int
    accepted: float
    blocks: int


@torch.no_grad()
def score(drafter: DFlashDrafter, head: TargetHead, convs: list[dict[str, torch.Tensor]], *,
          anchors_per_conv: int = 8, gamma: float = 7.0, chunk: int = 1024) -> list[ConvScore]:
    """Teacher-forced acceptance of ``drafter`` on each conversation (dicts of
    ``dflash.learn.store.CaptureStore.read``) that has a valid anchor, on the device of the
    drafter; anchors are seeded by the conversation's ``seq``, so two drafters meet the same
    blocks."""
    was = drafter.training
    drafter.eval()
    dev = next(drafter.parameters()).device
    cfg = drafter.cfg
    out = []
    for c in convs:
        if not len(valid_anchors(c["loss_mask"])):
            continue
        seq = int(c["seq"])
        anchors = [sample_anchors(c["loss_mask"], anchors_per_conv, random.Random(1234 + seq))]
        batch = build_batch([c], anchors, block_size=cfg.block_size,
                            mask_token_id=cfg.mask_token_id, gamma=gamma).to(dev)
        _, st = batch_loss(drafter, head, batch, head.lm_head, None, chunk)
        out.append(ConvScore(seq, float(st["accepted_sum"]), int(st["blocks"])))
    drafter.train(was)
    return out


@dataclasses.dataclass(frozen=True)
class GateResult:
    """The decision and its figures (all JSON-able, logged as they are)."""

    release: bool
    reason: str
    conversations: int
    tau_serving: float
    tau_candidate: float
    gain: float            # tau_candidate / tau_serving - 1
    gain_lower: float      # one-sided lower confidence bound of ``gain``
    wins: int              # conversations where the candidate accepts more per block
    losses: int
    margin: float
    confidence: float


def gate(serving: list[ConvScore], candidate: list[ConvScore], *, margin: float = 0.02,
         confidence: float = 0.95, min_conversations: int = 5, resamples: int = 2000,
         seed: int = 0) -> GateResult:
    """Paired bootstrap over conversations (see the module docstring).

    Raises ValueError when the two score lists are not of the same conversations."""
    if [s.seq for s in serving] != [c.seq for c in candidate]:
        raise ValueError("candidate: scored on other conversations than the serving version")
    n = len(serving)
    blocks = np.array([s.blocks for s in serving], dtype=np.float64)
    a_s = np.array([s.accepted for s in serving])
    a_c = np.array([c.accepted for c in candidate])
    tau_s = 1 + a_s.sum() / max(1.0, blocks.sum())
    tau_c = 1 + a_c.sum() / max(1.0, blocks.sum())
    gain = tau_c / tau_s - 1
    wins, losses = int((a_c > a_s).sum()), int((a_c < a_s).sum())
    base = GateResult(release=False, reason="", conversations=n, tau_serving=round(float(tau_s), 4),
                      tau_candidate=round(float(tau_c), 4), gain=round(float(gain), 4),
                      gain_lower=float("nan"), wins=wins, losses=losses, margin=margin,
                      confidence=confidence)
    if n < min_conversations:
        return dataclasses.replace(
            base, reason=f"{n} held-out conversations, fewer than {min_conversations}")
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    b = blocks[idx].sum(1)
    boot = (1 + a_c[idx].sum(1) / b) / (1 + a_s[idx].sum(1) / b) - 1
    lower = float(np.quantile(boot, 1 - confidence))
    ok = lower > margin
    reason = (f"gain {gain:+.2%}, lower bound {lower:+.2%} {'>' if ok else '<='} margin {margin:.2%}")
    return dataclasses.replace(base, release=ok, reason=reason, gain_lower=round(lower, 4))
