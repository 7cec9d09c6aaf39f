"""Teacher-forced acceptance probe for ``dflash diagnose``: every response position an anchor.

The target generates a greedy continuation of each prompt once (batched), keeping every layer's
hidden states; then, for each drafter *setting* (the saved config, target_layer_ids shifted,
another mask token, ...), one batched drafter pass scores every anchor ``a`` of every response:
the block ``[token a, MASK x (B-1)]`` at positions ``a .. a+B-1`` sees the taps of positions
``< a`` (the training mask, ``dflash.recipe.blocks``), and draft position ``k`` is compared with
the target's token at ``a + k``. Under greedy decoding that token is exactly what the verifier
would accept after ``k - 1`` accepted drafts, so per anchor:

* ``accepted``: the accepted drafts of a block at this anchor (a prefix, at most B - 1);
* ``hit[k]``, ``ce[k]`` for the first ``K0`` positions: whether the draft equals the target's
  token, and the drafter's cross-entropy of that token (nats). The cross-entropy is the precise
  statistic: a drafter reads best the taps it was trained on, and its log-likelihood says so
  long before its argmax changes (neighbouring layers of a small target differ little).

Walking the anchors as the decode loop would (``a -> a + accepted + 1``) gives the tau the
greedy loop measures with blocks of B; the paired tests (``dflash_app.diagnose_stats``) use all
anchors. Drafts are argmax over the draft vocabulary when the checkpoint has one, as served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dflash.core.config import DrafterConfig
from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.core.stats import AcceptanceCounter

K0 = 3          # draft positions whose cross-entropy and accuracy every anchor reports
CHUNK = 64      # anchors per drafter forward


@dataclasses.dataclass
class ProbeSeq:
    """One prompt and the target's greedy continuation."""

    domain: str
    ids: torch.Tensor           # int64 [n]: prompt + continuation (up to and with EOS)
    prompt_len: int             # P: the first anchor (the prefill's bonus token) is at P
    hidden: torch.Tensor        # float32 [layers + 1, n - 1, H]: HF hidden_states, positions 0..n-2
    ended: bool = True          # the continuation ends with EOS (else it was cut at max tokens)

    @property
    def anchors(self) -> range:
        """Anchor positions: every response token that has a next token."""
        return range(self.prompt_len, len(self.ids) - 1)


@torch.inference_mode()
def collect(model, prompts: Sequence[list[int]], domains: Sequence[str], *, max_new_tokens: int,
            eos_ids: frozenset[int], pad_id: int, batch: int = 16) -> list[ProbeSeq]:
    """Greedy continuations and all hidden states, ``batch`` prompts per ``generate`` call
    (left padded; padding changes the hidden states only by rounding).

    ``model``: a transformers causal LM (``verifier_svc.target.TargetModel.model``)."""
    out: list[ProbeSeq] = []
    for s in range(0, len(prompts), batch):
        group = [list(p) for p in prompts[s:s + batch]]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        g = model.generate(ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=sorted(eos_ids) or None,
                           output_hidden_states=True, return_dict_in_generate=True)
        steps = g.hidden_states     # [0]: prefill, per layer [b, width, H]; [t]: [b, 1, H]
        for i, p in enumerate(group):
            new = g.sequences[i, width:].tolist()
            cut = next((j for j, t in enumerate(new) if t in eos_ids), None)
            new = new[:cut + 1] if cut is not None else new
            if len(new) < 2:
                continue                       # nothing to draft after the first token
            pad = width - len(p)
            layers = []
            for layer in range(len(steps[0])):
                rows = [steps[0][layer][i, pad:]] + [steps[t][layer][i] for t in range(1, len(new))]
                layers.append(torch.cat(rows).float())
            out.append(ProbeSeq(domain=domains[s + i], ids=torch.tensor(p + new),
                                prompt_len=len(p), hidden=torch.stack(layers),
                                ended=cut is not None))
    return out


@dataclasses.dataclass(frozen=True)
class Head:
    """The rows drafts are read through: ``weight`` [N, H] and ``ids`` int64 [N] their target ids
    (None: all V rows, ids = row index)."""

    weight: torch.Tensor
    ids: torch.Tensor | None

    @classmethod
    def of(cls, lm_head: torch.Tensor, draft_vocab: torch.Tensor | None) -> "Head":
        if draft_vocab is None:
            return cls(lm_head, None)
        return cls(lm_head[draft_vocab].contiguous(), draft_vocab)

    def local(self, vocab_size: int) -> torch.Tensor:
        """int64 [V]: target id -> row, -1 for ids outside these rows."""
        if self.ids is None:
            return torch.arange(vocab_size)
        inv = torch.full((vocab_size,), -1, dtype=torch.int64)
        inv[self.ids] = torch.arange(self.ids.numel())
        return inv


@dataclasses.dataclass
class Scores:
    """Per-anchor results of one setting. Rows follow the probe's anchors (prompt by prompt)."""

    prompt: torch.Tensor        # int64 [N] prompt index
    anchor: torch.Tensor        # int64 [N] position
    drafts: torch.Tensor        # int64 [N] draft positions that have a target token (<= B - 1)
    accepted: torch.Tensor      # int64 [N] accepted drafts (prefix)
    hit: torch.Tensor           # float32 [N, K0] 1/0, NaN past the sequence end
    ce: torch.Tensor            # float32 [N, K0] nats, NaN past the end or outside the head's rows

    @property
    def anchor_ce(self) -> torch.Tensor:
        """float32 [N]: mean cross-entropy over the anchor's scored positions (NaN: none)."""
        return torch.nanmean(self.ce, dim=1)

    def position_accuracy(self) -> list[float]:
        """Unconditional accuracy of draft positions 1..K0 over all anchors."""
        return [round(float(x), 4) for x in torch.nanmean(self.hit, dim=0).tolist()]

    def mean_ce(self) -> float:
        return float(torch.nanmean(self.anchor_ce))


def walk(scores: Scores, seqs: Sequence[ProbeSeq]) -> dict[str, list[tuple[int, int]]]:
    """The greedy decode loop over the scored anchors (``a -> a + accepted + 1`` from each
    prompt's first anchor): the verified blocks ``(drafts, accepted drafts)`` per domain, plus
    ``"all"``. Needs every anchor scored (stride 1).

    A continuation cut at the token limit ends as the loop's ``max_tokens`` would end it: a
    block leaves room for its bonus token, so its drafts stop one position before the last."""
    at = {(int(p), int(a)): i for i, (p, a) in enumerate(zip(scores.prompt, scores.anchor))}
    out: dict[str, list[tuple[int, int]]] = {"all": []}
    for pi, s in enumerate(seqs):
        rows = out.setdefault(s.domain, [])
        a = s.prompt_len
        while (pi, a) in at:
            i = at[(pi, a)]
            d = int(scores.drafts[i]) if s.ended else min(int(scores.drafts[i]), len(s.ids) - 2 - a)
            block = (d, min(int(scores.accepted[i]), d))
            rows.append(block)
            out["all"].append(block)
            a += block[1] + 1
    return out


def counter(blocks: Sequence[tuple[int, int]]) -> AcceptanceCounter:
    """The blocks as the verifier's acceptance counts (tau, per-position rates)."""
    c = AcceptanceCounter()
    for d, acc in blocks:
        c.record(d, acc)
    return c


def drafter_for(base: DFlashDrafter, cfg: DrafterConfig) -> DFlashDrafter:
    """``base``'s weights under ``cfg``: the same module when only the taps or the mask token
    differ (they are inputs), a new one when rope or attention layout change."""
    same = ("rope_theta", "rope_scaling", "layer_types", "sliding_window")
    if all(getattr(base.cfg, f) == getattr(cfg, f) for f in same):
        return base
    m = DFlashDrafter(cfg).to(next(base.parameters()).dtype).eval()
    state = {k: v for k, v in base.state_dict().items() if not k.startswith("rotary_emb")}
    m.load_state_dict(state, strict=False)
    return m


@torch.inference_mode()
def score(drafter: DFlashDrafter, target_head: TargetHead, head: Head, seqs: Sequence[ProbeSeq], *,
          layer_ids: Sequence[int], mask_token_id: int, stride: int = 1) -> Scores:
    """Score every ``stride``-th anchor of every sequence under one setting.

    ``drafter``: the network under the setting's config (:func:`drafter_for`); ``layer_ids``:
    the taps to feed it; ``head``: the rows drafts are read through.
    """
    B = drafter.cfg.block_size
    inv = head.local(target_head.vocab_size)
    idx = [i + 1 for i in layer_ids]             # dflash.core.taps: id i is hidden_states[i + 1]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("prompt", "anchor", "drafts",
                                                             "accepted", "hit", "ce")}
    dtype = next(drafter.parameters()).dtype
    for pi, s in enumerate(seqs):
        n = len(s.ids)
        feats = s.hidden[idx].permute(1, 0, 2).reshape(n - 1, -1).to(dtype)   # [n-1, k*H]
        ctx_all = drafter.context_kv(feats[None], torch.arange(n - 1)[None])
        anchors = list(s.anchors)[::stride]
        for c in range(0, len(anchors), CHUNK):
            A = torch.tensor(anchors[c:c + CHUNK])
            res = _score_chunk(drafter, target_head, head, inv, s.ids, A, ctx_all, B, mask_token_id)
            parts["prompt"].append(torch.full((len(A),), pi))
            parts["anchor"].append(A)
            for k, v in zip(("drafts", "accepted", "hit", "ce"), res):
                parts[k].append(v)
    cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}
    return Scores(**cat)


def block_hidden(drafter: DFlashDrafter, target_head: TargetHead, ids: torch.Tensor,
                 A: torch.Tensor, ctx_all, B: int, mask_id: int) -> torch.Tensor:
    """One drafter forward over the blocks ``[ids[a], MASK x (B-1)]`` of anchors ``A`` (int64
    [C]), each seeing the context K/V ``ctx_all`` (``drafter.context_kv`` of the sequence's
    taps) of positions ``< a``. Returns the drafter's last hidden states [C, B, H]."""
    C = len(A)
    ctx_len = int(A.max())                         # context: positions < anchor
    kv = [(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in ctx_all]
    block = torch.full((C, B), mask_id, dtype=torch.int64)
    block[:, 0] = ids[A]
    pos = A[:, None] + torch.arange(B)                                  # [C, B]
    q = C * B
    mask = torch.zeros(C, B, ctx_len + q, dtype=torch.bool)
    mask[:, :, :ctx_len] = torch.arange(ctx_len)[None, None] < A[:, None, None]
    own = torch.arange(q).view(C, B) // B                               # block of each query
    mask[:, :, ctx_len:] = (torch.arange(q) // B)[None, None, :] == own[:, :, None]
    return drafter(target_head.embed_tokens(block.view(1, q)), pos.view(1, q), kv,
                   mask.view(1, 1, q, ctx_len + q),
                   context_positions=torch.arange(ctx_len)[None]).view(C, B, -1)


def _score_chunk(drafter, target_head, head, inv, ids, A, ctx_all, B, mask_id):
    """One drafter forward over the blocks of anchors ``A`` [C]; returns drafts, accepted,
    hit [C, K0], ce [C, K0]."""
    n = len(ids)
    h = block_hidden(drafter, target_head, ids, A, ctx_all, B, mask_id)
    C = len(A)
    pos = A[:, None] + torch.arange(B)                                  # [C, B]
    label_pos = pos[:, 1:]                                              # [C, B-1]
    valid = label_pos < n
    labels = ids[label_pos.clamp(max=n - 1)]
    drafts = valid.sum(1)
    k0 = min(K0, B - 1)
    logits = target_head.logits(h[:, 1:1 + k0], head.weight)            # [C, k0, N]
    lab = inv[labels[:, :k0]]
    lsm = torch.log_softmax(logits, -1)
    ce = -lsm.gather(-1, lab.clamp(min=0)[..., None])[..., 0]
    ce = torch.where(valid[:, :k0] & (lab >= 0), ce, torch.nan)
    pred = logits.argmax(-1)
    draft = head.ids[pred] if head.ids is not None else pred
    correct = (draft == labels[:, :k0]) & valid[:, :k0]
    hit = torch.where(valid[:, :k0], correct.float(), torch.nan)
    if k0 < K0:   # blocks shorter than K0 + 1: pad the columns
        pad = torch.full((C, K0 - k0), torch.nan)
        hit, ce = torch.cat([hit, pad], 1), torch.cat([ce, pad], 1)
    accepted = torch.cumprod(correct.long(), 1).sum(1)
    alive = correct.all(1)
    for k in range(k0 + 1, B):            # later positions only where the prefix still holds
        rows = (alive & valid[:, k - 1]).nonzero().flatten()
        if not rows.numel():
            break
        p = target_head.logits(h[rows, k], head.weight).argmax(-1)
        d = head.ids[p] if head.ids is not None else p
        ok = d == labels[rows, k - 1]
        accepted[rows[ok]] += 1
        alive = torch.zeros_like(alive)
        alive[rows[ok]] = True
    return drafts, accepted, hit, ce
