"""``position_noise``: the Exp(1) noise a seeded request samples with (coupled sampling), keyed by
(seed, sequence index) only, and ``coupled_choice``, the race that turns it into a draw from p."""

from __future__ import annotations

import torch
from scipy import stats

from dflash.core.sampling import coupled_choice, position_noise


def test_a_row_depends_on_seed_and_position_only():
    rows = position_noise(5, [10, 11, 12], 300)
    assert rows.shape == (3, 300) and rows.dtype == torch.float32
    assert torch.equal(position_noise(5, [12], 300)[0], rows[2])          # asked alone or not
    assert torch.equal(position_noise(5, [11, 10], 300), rows[[1, 0]])
    assert not torch.equal(rows[0], rows[1])                              # another index
    assert not torch.equal(position_noise(6, [10], 300)[0], rows[0])      # another seed
    assert position_noise(5, [], 300).shape == (0, 300)


def test_the_noise_is_exp1_finite_and_positive():
    e = position_noise(2**64 - 1, range(100), 2000).flatten()
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0
    assert stats.kstest(e[::7].double().numpy(), "expon").pvalue > 1e-3


def test_a_drawn_zero_gives_finite_noise(monkeypatch):
    """torch.rand returns 0 about once in 2^24 draws; -log(0) = inf would make p / e = 0 and
    exclude a token (and 0 noise would pick one of probability 0 as 0 / 0)."""
    monkeypatch.setattr(torch, "rand", lambda n, generator, device: torch.zeros(n, device=device))
    e = position_noise(1, [0], 8)
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0


def test_coupled_choice_is_a_draw_from_p():
    """Over many seeds, the race at one index picks each token with its probability (chi-square,
    alpha 1e-3), and never a token of probability 0."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 6000
    picks = torch.stack([coupled_choice(p, position_noise(s, [3], 5)[0]) for s in range(n)])
    counts = torch.bincount(picks, minlength=5)
    assert int(counts[4]) == 0
    assert stats.chisquare(counts[:4].numpy(), (n * p[:4]).numpy()).pvalue > 1e-3
