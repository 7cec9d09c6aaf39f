"""The release gate: a candidate drafter is released only if it beats the serving version on
the held-out conversations, by a margin, in a paired test.

Both drafters are scored on the same held-out conversations, by one of two measures:

* ``served`` (the default): the chain serving would take through each conversation, replayed
  on its stored taps (``dflash.learn.walk.chain_walk``, the serving version's draft
  vocabulary): verify steps and the drafts they accept. This is the τ a release would serve.
* ``teacher_forced``: the trainer's held-out measure (``dflash.recipe.loss.batch_loss`` over
  the full vocabulary) at fixed anchors seeded by the conversation's number, accepted drafts
  per block. Cheaper, but its uniform anchors overstate a served gain: they fall as often on
  easy stretches as on the positions right after a miss, where a served step starts
  (docs/learning.md, "The gate").

The statistic is the relative gain
in τ = 1 + accepted / blocks over all conversations, each drafter over its own blocks (a
served walk takes fewer steps where it accepts more); a paired bootstrap over conversations
(resampling whole conversations, both drafters together) gives its one-sided lower bound. The
candidate is released only if the gain is at least ``margin`` and the lower bound is above 0:
the gain must be worth a release, and the test must show it is real (docs/learning.md, "The
gate").
"""

from __future__ import annotations

import dataclasses
import random
from enum import StrEnum

import numpy as np
import torch

from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.learn.walk import chain_walk
from dflash.recipe.blocks import build_batch, sample_anchors, valid_anchors
from dflash.recipe.loss import batch_loss


class GateMetric(StrEnum):
    """What the gate's acceptance figures measure (module docstring): the served chain
    replayed, or teacher-forced blocks."""

    SERVED = "served"
    TEACHER_FORCED = "teacher_forced"


METRICS = tuple(GateMetric)


@dataclasses.dataclass(frozen=True)
class ConvScore:
    """One conversation's acceptance: ``accepted`` drafts over ``blocks`` blocks (verify steps)."""

    seq: int
    accepted: float
    blocks: int


def score(drafter: DFlashDrafter, head: TargetHead, convs: list[dict[str, torch.Tensor]], *,
          metric: GateMetric = GateMetric.SERVED, vocab: torch.Tensor | None = None, anchors_per_conv: int = 8,
          gamma: float = 7.0, chunk: int = 1024) -> list[ConvScore]:
    """Acceptance of ``drafter`` on each conversation (dicts of
    ``dflash.learn.store.CaptureStore.read``) that has a valid anchor, by ``metric`` (see the
    module docstring), on the device of the drafter. ``vocab``: the draft vocabulary the walk
    drafts over (``served`` only; None = the full vocabulary). Teacher-forced anchors are seeded
    by the conversation's ``seq``, so two drafters meet the same blocks.

    Raises ValueError naming ``metric`` for an unknown one."""
    if metric == GateMetric.SERVED:
        return [ConvScore(w.seq, float(w.accepted), w.steps)
                for w in chain_walk(drafter, head, convs, vocab=vocab) if w.steps]
    if metric != GateMetric.TEACHER_FORCED:
        raise ValueError(f"metric: {metric!r} is not one of {', '.join(METRICS)}")
    return _teacher_forced(drafter, head, convs, anchors_per_conv=anchors_per_conv, gamma=gamma,
                           chunk=chunk)


@torch.no_grad()
def _teacher_forced(drafter: DFlashDrafter, head: TargetHead, convs: list[dict[str, torch.Tensor]], *,
                    anchors_per_conv: int, gamma: float, chunk: int) -> list[ConvScore]:
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
    wins: int              # conversations where the candidate accepts more drafts per block
    losses: int
    margin: float
    confidence: float
    metric: GateMetric = GateMetric.SERVED  # what the figures measure (``score``'s metric)
    replay: float | None = None   # the serving version's replayed / served τ (:func:`replay_check`)
    replay_conversations: int = 0


#: The serving version's replayed τ on the conversations it served must be at least this
#: fraction of the τ it served there: a healthy store replays the served chain itself, so only
#: numerics separate the two (docs/learning.md, "The gate").
REPLAY_TOLERANCE = 0.9


def replay_check(convs: list[dict], serving: list[ConvScore], label: str, *,
                 min_conversations: int = 5) -> tuple[float, int] | None:
    """Does the store replay what was served? Over the conversations that ``label`` (the
    serving version, ``name@version``) served with greedy chains (their ``served`` record,
    ``dflash.learn.store.Served``): its replayed τ (``serving``: served-metric scores, by
    ``seq``) over the τ the capture recorded. A store whose labels do not follow its taps
    (corrupted, misaligned, poisoned) replays far below what was served; a healthy one
    replays it (the walk is the served chain). Returns (ratio, conversations), or None with
    fewer than ``min_conversations`` such conversations."""
    by_seq = {s.seq: s for s in serving}
    rec = [(c["served"], by_seq[int(c["seq"])]) for c in convs
           if getattr(c.get("served"), "by", None) == label and int(c["seq"]) in by_seq]
    if len(rec) < min_conversations:
        return None
    served = sum(r.tokens for r, _ in rec) / max(1, sum(r.steps for r, _ in rec))
    replayed = sum(s.accepted + s.blocks for _, s in rec) / max(1, sum(s.blocks for _, s in rec))
    return replayed / served, len(rec)


def gate(serving: list[ConvScore], candidate: list[ConvScore], *, margin: float = 0.02,
         confidence: float = 0.95, min_conversations: int = 5, resamples: int = 2000,
         seed: int = 0, metric: GateMetric = GateMetric.SERVED) -> GateResult:
    """Paired bootstrap over conversations (see the module docstring): release when the gain
    is at least ``margin`` and its one-sided ``confidence`` lower bound is above 0; ``metric``
    names the measure the scores were taken by, for the log.

    Raises ValueError when the two score lists are not of the same conversations."""
    if [s.seq for s in serving] != [c.seq for c in candidate]:
        raise ValueError("candidate: scored on other conversations than the serving version")
    n = len(serving)
    # Each drafter's own blocks: a served walk takes fewer steps where it accepts more.
    b_s = np.array([s.blocks for s in serving], dtype=np.float64)
    b_c = np.array([c.blocks for c in candidate], dtype=np.float64)
    a_s = np.array([s.accepted for s in serving])
    a_c = np.array([c.accepted for c in candidate])
    tau_s = 1 + a_s.sum() / max(1.0, b_s.sum())
    tau_c = 1 + a_c.sum() / max(1.0, b_c.sum())
    gain = tau_c / tau_s - 1
    per_s, per_c = a_s / np.maximum(b_s, 1), a_c / np.maximum(b_c, 1)
    wins, losses = int((per_c > per_s).sum()), int((per_c < per_s).sum())
    base = GateResult(release=False, reason="", conversations=n, tau_serving=round(float(tau_s), 4),
                      tau_candidate=round(float(tau_c), 4), gain=round(float(gain), 4),
                      gain_lower=float("nan"), wins=wins, losses=losses, margin=margin,
                      confidence=confidence, metric=metric)
    if n < min_conversations:
        return dataclasses.replace(
            base, reason=f"{n} held-out conversations, fewer than {min_conversations}")
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = ((1 + a_c[idx].sum(1) / np.maximum(b_c[idx].sum(1), 1))
            / (1 + a_s[idx].sum(1) / np.maximum(b_s[idx].sum(1), 1)) - 1)
    lower = float(np.quantile(boot, 1 - confidence))
    # Worth a release (the gain clears the margin) and surely better (the bound clears 0): a
    # bound held to the margin itself needs a gain of about twice it on a few dozen conversations.
    worth, sure = bool(gain >= margin), lower > 0
    reason = (f"gain {gain:+.2%} {'>=' if worth else '<'} margin {margin:.2%}, "
              f"lower bound {lower:+.2%} {'>' if sure else '<='} 0")
    return dataclasses.replace(base, release=worth and sure, reason=reason, gain_lower=round(lower, 4))
