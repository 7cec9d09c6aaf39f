"""The DFlash2 candidate selector's training loss (for ``dflash.recipe.loss.batch_loss``).

Teacher forced: block slot k's predecessor is the true token at k - 1 (the anchor for k = 1),
which is the chain's own predecessor whenever the drafts before k were all accepted, the only
case in which slot k's draft counts. Per slot: the top-K candidates of the (frozen) head's
values, the edge scores from the true predecessor, cross-entropy to the true token where it is
among the candidates (elsewhere the selector cannot draft it). Predictions are the selector's
choice, so acceptance statistics are the chain's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.core.dflash2 import CandidateSelector


def row_ids(label_map: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """Target id of each softmax row: int64 [rows] (``label_map`` maps id -> row, -1 = none)."""
    if label_map is None:
        return torch.arange(rows, device=device)
    ids = (label_map >= 0).nonzero()[:, 0]
    out = torch.empty(rows, dtype=torch.int64, device=device)
    out[label_map[ids]] = ids
    return out


def predecessors(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int,
                 mask_token_id: int) -> torch.Tensor:
    """int64 [b, q]: the token before each block slot (the anchor for slot 1, else the slot
    before's label; the mask token where that label is excluded)."""
    prev = torch.roll(labels, 1, dims=1)
    prev = torch.where(prev >= 0, prev, mask_token_id)
    first = (torch.arange(labels.shape[1], device=labels.device) % block_size) == 1
    return torch.where(first[None], torch.roll(block_ids, 1, dims=1), prev)


def selector_loss(sel: CandidateSelector, hidden: torch.Tensor, head_w: torch.Tensor,
                  ids: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
                  weights: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_m w_m * CE_m over rows whose label is a candidate, predictions [M] as softmax rows).

    hidden [M, H] final hidden states (the selector's projection reads them; the values are
    computed without gradient); head_w [R, H]; ids int64 [R] target id of each row;
    labels [M] rows of head_w; prev [M] target ids of the predecessors; weights [M] float32.
    """
    total, preds = hidden.new_zeros((), dtype=torch.float32), []
    for i in range(0, hidden.shape[0], chunk):
        sl = slice(i, i + chunk)
        h = hidden[sl]
        with torch.no_grad():
            cols, vals = sel.candidates(F.linear(h.detach(), head_w))       # [m, k]
        scores = sel.edges(ids[cols][:, None], vals[:, None], h[:, None],
                           prev[sl])[:, 0, 0]                               # [m, k]
        hit = cols == labels[sl, None]
        has = hit.any(-1)
        ce = F.cross_entropy(scores, hit.to(torch.int64).argmax(-1), reduction="none")
        total = total + (ce * weights[sl] * has).sum()
        preds.append(cols.gather(1, scores.argmax(-1, keepdim=True))[:, 0])
    return total, torch.cat(preds) if preds else labels.new_zeros(0)
