"""Sampling parameters, their validation, and the logits -> probabilities transform.

The transform matches transformers' generate() warpers in order and semantics
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``, keeping at least
one token), so that drafter and target distributions are processed identically and the sampled
output follows the target's processed distribution exactly (speculative sampling is lossless for
whatever distribution both sides use).
"""

from __future__ import annotations

import dataclasses
import math
import secrets

import torch

from dflash.errors import FieldError

GREEDY_EPS = 1e-5  # temperatures below this are greedy (z-lab ``sample()`` threshold)


class InvalidParam(FieldError):
    """A request parameter is invalid. ``field`` names it; maps to gRPC INVALID_ARGUMENT."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """Validated sampling parameters (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidParam("temperature", f"must be a finite number >= 0, got {t!r}")
        if self.top_k < 0:
            raise InvalidParam("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        p = self.top_p
        if math.isnan(p) or not 0.0 < p <= 1.0:
            raise InvalidParam("top_p", f"must be in (0, 1], got {p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidParam("seed", "must fit in an unsigned 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh generator: seeded from ``seed`` (reproducible) or from the OS."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed % 2**63 if self.seed is not None else secrets.randbits(63))
        return g


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V] after temperature, top-k, top-p.

    Greedy sampling returns the one-hot of the argmax (first index on ties).
    """
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if s.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - s.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, -math.inf)
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Draw one index per row of ``probs`` [..., V] (exponential race, same rule as kernels)."""
    e = torch.empty_like(probs).exponential_(generator=g)
    return (probs / e).argmax(-1)
