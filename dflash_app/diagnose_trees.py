"""Teacher-forced tree acceptance for ``dflash diagnose``: what a DDTree step of each node
budget commits, walked over the probe's anchors as the greedy decode loop would walk them.

At each anchor ``a`` the drafter's block ``[token a, MASK x (B-1)]`` (the same forward as
``dflash_app.diagnose_tf``) gives a distribution per draft position; its top-k per position
(``drafter_svc.drafts.top_k_logprobs`` over the rows drafts are read through, what the
drafter serves) goes to the verifier's own ``verifier_svc.tree.build_tree``.
Under greedy decoding the target's token after a path equals its continuation's next token, so
the walk from the root follows the child carrying ``ids[a + d + 1]`` at depth ``d``; the step
commits the path and the bonus token, and the next anchor is ``a + path + 1``. The depth a tree
may reach is the verifier's: ``min(B - 1, budget)`` drafts, and at a continuation cut at the
token limit one position less than is left (room for the bonus token, as
``diagnose_tf.walk``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash_app.diagnose_tf import CHUNK, Head, ProbeSeq, block_hidden

#: anchor -> (top ids int64 [depth, K], their log-probabilities float32 [depth, K]): the
#: drafter's top-k per draft position of its block at that anchor, as served
Tops = dict[int, tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def drafter_tops(drafter: DFlashDrafter, target_head: TargetHead, head: Head,
                 seqs: Sequence[ProbeSeq], budgets: Sequence[int], *, layer_ids: Sequence[int],
                 mask_token_id: int) -> list[Tops]:
    """Per sequence, the drafter's top-k at every anchor (``K`` = the largest budget, ``depth`` =
    ``min(B - 1, K)`` positions): what a tree of any of ``budgets`` is built from. ``drafter`` /
    ``layer_ids`` / ``mask_token_id``: the saved setting (what is served); ``head``: the rows
    drafts are read through (the draft vocabulary, if any)."""
    from drafter_svc.drafts import top_k_logprobs

    top_k = max(budgets)
    B = drafter.cfg.block_size
    depth = min(B - 1, top_k)
    idx = [i + 1 for i in layer_ids]             # dflash.core.taps: id i is hidden_states[i + 1]
    dtype = next(drafter.parameters()).dtype
    out: list[Tops] = []
    for s in seqs:
        n_ids = len(s.ids)
        feats = s.hidden[idx].permute(1, 0, 2).reshape(n_ids - 1, -1).to(dtype)
        ctx_all = drafter.context_kv(feats[None], torch.arange(n_ids - 1)[None])
        anchors = list(s.anchors)
        tops: Tops = {}
        for c in range(0, len(anchors), CHUNK):
            A = torch.tensor(anchors[c:c + CHUNK])
            h = block_hidden(drafter, target_head, s.ids, A, ctx_all, B, mask_token_id)
            logits = target_head.logits(h[:, 1:1 + depth], head.weight)    # [C, depth, N]
            rows, vals = top_k_logprobs(logits.reshape(-1, logits.shape[-1]), top_k)
            rows, vals = rows.view(len(A), depth, -1), vals.view(len(A), depth, -1)
            ids = head.ids[rows] if head.ids is not None else rows
            for j, a in enumerate(A.tolist()):
                tops[a] = (ids[j], vals[j])
        out.append(tops)
    return out


def tree_steps(drafter: DFlashDrafter, target_head: TargetHead, head: Head,
               seqs: Sequence[ProbeSeq], budgets: Sequence[int], *, layer_ids: Sequence[int],
               mask_token_id: int, tops: Sequence[Tops] | None = None
               ) -> dict[str, dict[int, list[int]]]:
    """Tokens committed per tree step (path + bonus), per domain (and ``"all"``) and budget.

    Arguments as :func:`drafter_tops`; ``tops``: its result, when already computed. Empty
    ``budgets``: ``{}``."""
    from verifier_svc.tree import build_tree

    budgets = sorted(set(budgets))
    if not budgets:
        return {}
    B = drafter.cfg.block_size
    if tops is None:
        tops = drafter_tops(drafter, target_head, head, seqs, budgets, layer_ids=layer_ids,
                            mask_token_id=mask_token_id)
    out: dict[str, dict[int, list[int]]] = {"all": {n: [] for n in budgets}}
    for s, seq_tops in zip(seqs, tops):
        n_ids = len(s.ids)
        dom = out.setdefault(s.domain, {n: [] for n in budgets})
        for n in budgets:
            a = s.prompt_len
            while a in seq_tops:
                left = n_ids - 1 - a if s.ended else n_ids - 2 - a   # draft positions available
                limit = min(B - 1, n, left)
                if limit <= 0:          # no room to draft: a plain step, not a tree step
                    a += 1
                    continue
                got = _committed(build_tree, seq_tops[a], s.ids, a, limit, n)
                dom[n].append(got)
                out["all"][n].append(got)
                a += got
    return out


def _committed(build_tree, top, ids: torch.Tensor, a: int, limit: int, budget: int) -> int:
    """Tokens one greedy tree step at anchor ``a`` commits: the accepted path and the bonus."""
    top_ids, top_lp = top
    tree = build_tree(top_ids[:limit], top_lp[:limit], budget)
    children: dict[tuple[int, int], int] = {}       # (parent block index, token) -> block index
    for j, (tok, par) in enumerate(zip(tree.tokens, tree.parents[1:]), start=1):
        children.setdefault((par, tok), j)
    node, path = 0, 0
    while (node, int(ids[a + path + 1])) in children:
        node = children[(node, int(ids[a + path + 1]))]
        path += 1
        if a + path + 1 >= len(ids):
            break
    return path + 1


def tree_summary(steps: dict[int, list[int]]) -> dict[int, float]:
    """Budget -> mean tokens per tree step (bonus included); budgets without steps left out."""
    return {n: sum(v) / len(v) for n, v in steps.items() if v}
