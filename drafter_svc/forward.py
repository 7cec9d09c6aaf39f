"""The drafter's two forwards over a batch of sessions (for ``engine.py``): new context rows
into the KV pool, then every session's block in one pass. Pure torch.

``sessions`` / ``items`` are ``(ProposalRequest, session)`` pairs; a session has ``seq``
(its ``dflash.core.kv_pool.PoolSeq``) and ``length`` (cached positions).
"""

from __future__ import annotations

import torch

from dflash.core.device import to_device
from dflash.core.dflash2 import selector_rows
from dflash.core.kv_pool import KVPool
from dflash.core.modeling import DFlashDrafter, TargetHead


def append_context(drafter: DFlashDrafter, pool: KVPool, sessions: list, dtype: torch.dtype,
                   dev: torch.device) -> None:
    """New context rows of every session through ``fc``/``k_proj``/``v_proj`` in one call
    (per-position work: the rows of all sessions form one sequence with their own positions),
    each session's slice then written into its pool row at its length."""
    parts = [(r, sess) for r, sess in sessions if r.context.shape[0]]
    if not parts:
        return
    feats = to_device(torch.cat([r.context for r, _ in parts]), dev).to(dtype)[None]
    pos = torch.cat([torch.arange(s.length, s.length + r.context.shape[0], device="cpu")
                     for r, s in parts])[None]
    new_kv = drafter.context_kv(feats, to_device(pos, dev))   # per layer [1, kvh, sum n, d]
    for _, sess in parts:
        pool.ensure_resident(sess.seq)
    pool.reserve(max(s.length + r.context.shape[0] for r, s in parts))
    start = 0
    for r, sess in parts:
        n = r.context.shape[0]
        for layer, (k, v) in enumerate(new_kv):
            pool.write(layer, sess.seq.row, sess.length,
                       k[:, :, start:start + n], v[:, :, start:start + n])
        pool.advance([sess.seq], [n])
        start += n

def draft_blocks(drafter: DFlashDrafter, head: TargetHead, pool: KVPool, items: list,
                 draft_head: torch.Tensor | None,
                 draft_vocab: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Logits [block_size - 1, V] per item (V = draft vocabulary size when there is one,
    ``draft_vocab`` int64 [V] its target ids), all blocks in one drafter forward. A DFlash2
    drafter's rows are its selector's scores along the best path, ``-inf`` off the candidates
    (``dflash.core.dflash2.selector_rows``).

    The items' sessions go onto pool rows ``0..b-1`` (``KVPool.arrange``: only sessions
    not there yet move) and the drafter reads ``K[:b, :, :n_max]`` in place;
    row i's context fills columns ``[0, length_i)`` and the mask hides the rest of them
    (stale or zero, always finite) and the padding of shorter blocks."""
    cfg = drafter.cfg
    b = len(items)
    order = list(range(b))
    if b > 1:                                # row r holds items[order[r]]
        slots = pool.arrange([s.seq for _, s in items])
        order = sorted(range(b), key=slots.__getitem__)
        items = [items[i] for i in order]
    n_max = max(s.length for _, s in items)
    q = max(r.block_size for r, _ in items)
    dev, host = next(drafter.parameters()).device, "cpu"           # built on the host, copied once (to_device)
    block = torch.full((b, q), cfg.mask_token_id, dtype=torch.int64, device=host)
    positions = torch.empty((b, q), dtype=torch.int64, device=host)
    for i, (r, s) in enumerate(items):
        block[i, 0] = r.anchor_token
        positions[i] = torch.arange(s.length, s.length + q, device=host)
    if b == 1:                               # the row's own context: attend everywhere
        kv = pool.views(pool.ensure_resident(items[0][1].seq), 1, n_max)
        mask = ctx_pos = None
    else:
        kv = pool.views(0, b, n_max)
        keys = torch.arange(n_max + q, device=host)
        lens = torch.tensor([s.length for _, s in items], device=host)[:, None]       # [b, 1]
        blocks = torch.tensor([r.block_size for r, _ in items], device=host)[:, None]  # [b, 1]
        ok = torch.where(keys < n_max, keys < lens, keys - n_max < blocks)    # [b, n+q]
        mask = to_device(ok, dev)[:, None, None, :].expand(b, 1, q, n_max + q)
        # column = position (sliding layers)
        ctx_pos = torch.arange(n_max, device=dev).expand(b, n_max)
    hidden = drafter(head.embed_tokens(to_device(block, dev)),
                          to_device(positions, dev), kv, mask, context_positions=ctx_pos)
    # One LM-head product for every block's rows: a product per block would stream the
    # whole head (N x H) once per block, for a few rows each.
    sizes = [r.block_size - 1 for r, _ in items]
    rows = torch.cat([hidden[i, 1:1 + n] for i, n in enumerate(sizes)])
    by_row = head.logits(rows, draft_head).split(sizes)
    selector = drafter.candidate_selector
    if selector is not None:
        hid = rows.split(sizes)
        by_row = tuple(selector_rows(selector, lg, hid[j], r.anchor_token, draft_vocab)
                       for j, (lg, (r, _)) in enumerate(zip(by_row, items)))
    out: list[torch.Tensor] = [by_row[0]] * b
    for row, i in enumerate(order):
        out[i] = by_row[row]
    return out
