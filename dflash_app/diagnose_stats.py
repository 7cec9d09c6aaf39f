"""Paired statistics for ``dflash diagnose``: one drafter setting against the saved one, on the
same anchors.

Every anchor of the teacher-forced probe (``dflash_app.diagnose_tf``) is scored under each setting,
so two settings differ anchor by anchor and the comparison is paired: most of the variance
between prompts and positions cancels. Neighbouring anchors are not independent (anchor ``a``'s
draft position 2 is anchor ``a + 1``'s position 1, and they share their context), so the
resampling unit is a run of ``block`` consecutive anchors of one prompt (a moving-block
bootstrap, Kuensch 1989, with non-overlapping blocks), not the anchor.
"""

from __future__ import annotations

import dataclasses

import torch

REPS = 5000     # bootstrap resamples: a one-sided p-value resolves down to 1 / 5001


@dataclasses.dataclass(frozen=True)
class Paired:
    """Mean of ``x - y`` over the anchors both settings scored, and its uncertainty.

    ``lo``/``hi``: the 95% percentile interval; ``p_below``/``p_above``: one-sided bootstrap
    p-values of "the mean is below 0" / "above 0" being a fluke (``(count + 1) / (reps + 1)``
    of the resamples on the other side of 0)."""

    mean: float
    lo: float
    hi: float
    p_below: float
    p_above: float
    anchors: int
    blocks: int

    def as_dict(self) -> dict:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in vars(self).items()}


def paired(x: torch.Tensor, y: torch.Tensor, prompt: torch.Tensor, *, block: int,
           reps: int = REPS, seed: int = 0, sign: bool = False) -> Paired:
    """Block bootstrap of ``mean(x - y)``, or with ``sign`` of ``mean(sign(x - y))`` (the
    share of anchors where x is above y minus the share where it is below: a paired sign
    test, blind to how far a few anchors move, which the cross-entropy's heavy tails make
    the more powerful test).

    Args:
        x, y: float [N] per-anchor values of the two settings (NaN: not scored, e.g. a label
            outside the draft vocabulary; such anchors leave both sides).
        prompt: int64 [N] the prompt each anchor belongs to; anchors of one prompt are
            consecutive and in position order.
        block: anchors per resampling block (the block size B: a draft block spans B positions).
    Raises:
        ValueError: shapes differ or ``block`` < 1.
    """
    if x.shape != y.shape or x.shape != prompt.shape or x.dim() != 1:
        raise ValueError(f"x, y, prompt: expected equal 1-D shapes, got {list(x.shape)}, "
                         f"{list(y.shape)}, {list(prompt.shape)}")
    if block < 1:
        raise ValueError(f"block: must be >= 1, got {block}")
    d = (x - y).double()
    ok = ~torch.isnan(d)
    d, prompt = d[ok], prompt[ok]
    if sign:
        d = torch.sign(d)
    n = d.numel()
    if n == 0:
        return Paired(0.0, 0.0, 0.0, 1.0, 1.0, 0, 0)
    # block id: a new block every `block` anchors and at every prompt boundary
    first = torch.ones(n, dtype=torch.bool)
    first[1:] = prompt[1:] != prompt[:-1]
    start_of_prompt = torch.cummax(torch.where(first, torch.arange(n), 0), 0).values
    within = torch.arange(n) - start_of_prompt
    new_block = first | (within % block == 0)
    bid = torch.cumsum(new_block.long(), 0) - 1
    nb = int(bid[-1]) + 1
    sums = torch.zeros(nb, dtype=torch.float64).index_add_(0, bid, d)
    counts = torch.zeros(nb, dtype=torch.float64).index_add_(0, bid, torch.ones_like(d))
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, nb, (reps, nb), generator=g)
    means = sums[pick].sum(1) / counts[pick].sum(1)
    mean = float(d.mean())
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    below = int((means >= 0).sum())      # resamples that contradict "below 0"
    above = int((means <= 0).sum())
    return Paired(mean, float(lo), float(hi), (below + 1) / (reps + 1), (above + 1) / (reps + 1),
                  n, nb)
