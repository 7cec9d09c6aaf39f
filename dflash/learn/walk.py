"""The served chain, replayed: the steps a drafter's blocks take through a captured conversation.

A captured conversation holds the tokens the target committed and the taps the drafter saw.
Served greedily with chain speculation of blocks of ``B``, it is a deterministic walk: at the
anchor ``a`` (the last committed token) the drafter proposes the argmax tokens of its block for
positions ``a+1 .. a+B-1``, seeing the taps of positions before ``a``; the target accepts the
longest prefix equal to its own tokens and adds one (the bonus token), so the next anchor is
``a + accepted + 1``. Replaying that walk on the stored taps gives the τ the drafter would serve
on that traffic, which teacher-forced scoring at uniform anchors does not: its anchors fall as
often on stock phrases, where any drafter does well, as on the positions right after a miss,
where a served step starts (docs/learning.md, "The gate", has how closely it agrees with
serving). Requests that were sampled are walked as if greedy (the drafts are argmax), an
approximation of what they served.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.core.modeling import DFlashDrafter, TargetHead


@dataclasses.dataclass(frozen=True)
class Walk:
    """One conversation's replayed chain: ``steps`` verify steps committed ``tokens`` tokens
    (accepted drafts plus one bonus token each); ``anchors`` holds each step's anchor position."""

    seq: int
    steps: int
    tokens: int
    anchors: tuple[int, ...]

    @property
    def accepted(self) -> int:
        return self.tokens - self.steps


@torch.no_grad()
def chain_walk(drafter: DFlashDrafter, head: TargetHead, convs: list[dict[str, torch.Tensor]], *,
               vocab: torch.Tensor | None = None, batch: int = 32) -> list[Walk]:
    """Replay greedy chain speculation of ``drafter`` over each conversation (dicts of
    ``dflash.learn.store.CaptureStore.read``: ``input_ids`` int64 [n], ``loss_mask`` [n],
    ``taps`` [n, kH], ``seq``), from its first answer token to its last.

    ``vocab`` (int64 [N], the serving drafter's ``draft_vocab``) restricts the drafts to those
    ids as serving does; None drafts over the full vocabulary. The context's K/V is computed once
    per conversation (taps do not change as the walk advances); each step is one block forward of
    the conversations still walking, ``batch`` at a time. Returns one :class:`Walk` per
    conversation, in order (``steps`` 0 for one with no answer token to draft)."""
    was = drafter.training
    drafter.eval()
    dev = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    B, mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
    head_w = head.lm_head if vocab is None else head.lm_head[vocab.to(dev)]
    out: list[Walk] = []
    for s in range(0, len(convs), batch):
        out += _walk_chunk(drafter, head, head_w, vocab, convs[s:s + batch], B, mask_id, dev, dtype)
    drafter.train(was)
    return out


def answer_runs(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """Each maximal run of known answer positions as ``(first, last)``, runs of two or more
    only (a walk needs a token after its anchor). A capture leaves holes where its ids are
    unknown (``dflash.learn.capture``) and between turns."""
    m = loss_mask.bool().tolist() + [False]
    runs, start = [], None
    for p, known in enumerate(m):
        if known and start is None:
            start = p
        elif not known and start is not None:
            if p - 1 > start:
                runs.append((start, p - 1))
            start = None
    return runs


def _walk_chunk(drafter, head, head_w, vocab, convs, B, mask_id, dev, dtype) -> list[Walk]:
    b = len(convs)
    n = max(len(c["input_ids"]) for c in convs)
    feats = torch.zeros(b, n, convs[0]["taps"].shape[-1], dtype=dtype, device=dev)
    for i, c in enumerate(convs):
        feats[i, :len(c["input_ids"])] = c["taps"].to(dev, dtype)
    ctx_pos = torch.arange(n, device=dev).expand(b, n)
    kv_all = drafter.context_kv(feats, ctx_pos)
    # One walk item per answer run; its targets padded with -1 past the run's end (and B-1
    # beyond the sequence), so a draft never matches an unknown or absent token.
    owner, first, last = [], [], []
    ids = torch.full((b, n + B), -1, dtype=torch.int64, device=dev)
    for i, c in enumerate(convs):
        known = torch.where(c["loss_mask"].bool(), c["input_ids"], -1)
        ids[i, :len(known)] = known.to(dev)
        for f, l in answer_runs(c["loss_mask"]):
            owner.append(i), first.append(f), last.append(l)
    conv = torch.tensor(owner, dtype=torch.int64, device=dev)
    anchor = torch.tensor(first, dtype=torch.int64, device=dev)
    end = torch.tensor(last, dtype=torch.int64, device=dev)
    steps = torch.zeros(len(owner), dtype=torch.int64, device=dev)
    tokens = torch.zeros_like(steps)
    anchors: list[list[int]] = [[] for _ in owner]
    k = torch.arange(B, device=dev)
    cols = torch.arange(n + B, device=dev)
    while True:
        act = torch.nonzero(anchor < end).flatten()
        if not len(act):
            break
        a, ci = anchor[act], conv[act]
        kv = [(kk[ci], vv[ci]) for kk, vv in kv_all]
        pos = a[:, None] + k                                                       # [m, B]
        block = torch.full((len(act), B), mask_id, dtype=torch.int64, device=dev)
        block[:, 0] = ids[ci, a]
        # Context columns before the anchor, and the whole block.
        mask = ((cols[None, :] < a[:, None]) | (cols[None, :] >= n))[:, None, None, :].expand(-1, 1, B, -1)
        h = drafter(head.embed_tokens(block).to(dtype), pos, kv, mask, ctx_pos[ci])
        pred = torch.nn.functional.linear(h[:, 1:], head_w.to(h.dtype)).argmax(-1)
        if vocab is not None:
            pred = vocab.to(dev)[pred]
        truth = ids[ci[:, None], pos[:, 1:]]                                       # [m, B-1]
        truth = torch.where(pos[:, 1:] <= end[act, None], truth, -1)
        accepted = torch.cumprod((pred == truth).long(), dim=1).sum(1)
        gen = torch.minimum(accepted + 1, end[act] - a)
        for r, i in enumerate(act.tolist()):
            anchors[i].append(int(a[r]))
        steps[act] += 1
        tokens[act] += gen
        anchor[act] = a + gen
    out = []
    for i, c in enumerate(convs):
        mine = [j for j, o in enumerate(owner) if o == i]
        out.append(Walk(int(c.get("seq", -1)), sum(int(steps[j]) for j in mine),
                        sum(int(tokens[j]) for j in mine), tuple(x for j in mine for x in anchors[j])))
    return out


def walk_tau(walks: list[Walk]) -> float:
    """τ over all walks: committed tokens per verify step (0.0 when no step was taken)."""
    steps = sum(w.steps for w in walks)
    return sum(w.tokens for w in walks) / steps if steps else 0.0
