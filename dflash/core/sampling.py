"""Sampling parameters, their validation, and the logits -> probabilities transform.

The transform matches transformers' generate() warpers in order and semantics
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` ->
``MinPLogitsWarper``, keeping at least one token), so that drafter and target distributions are
processed identically and the sampled output follows the target's processed distribution exactly
(speculative sampling is lossless for whatever distribution both sides use). The logits
processors that come before it (repetition, frequency/presence penalties, logit bias) are applied
to the target's logits only, in :mod:`dflash.core.logits_processors`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping

import torch

from dflash.core.errors import FieldError

GREEDY_EPS = 1e-5  # temperatures below this are greedy (z-lab ``sample()`` threshold)
MAX_PENALTY = 2.0            # presence / frequency penalty range [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0       # bias range [-100, 100] (OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound on logit_bias entries
MAX_TOP_LOGPROBS = 20         # OpenAI chat's bound


class InvalidParam(FieldError):
    """A request parameter is invalid. ``field`` names it; maps to gRPC INVALID_ARGUMENT."""


def _finite(name: str, v, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
            or not lo <= v <= hi:
        raise InvalidParam(name, f"must be a number in [{lo:g}, {hi:g}], got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """Validated sampling parameters (temperature 0 = greedy).

    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (0 = off), over the tokens this
    request generated; ``repetition_penalty`` in (0, 10] (0 and 1 = off; 0 is stored as 1),
    over prompt and generated tokens; ``logit_bias``: token id -> bias in [-100, 100], at most
    300 entries, given as a mapping or pairs and stored as ``((id, bias), ...)`` sorted by id
    (ids are checked against the vocabulary where the request is validated,
    ``verifier_svc.request.validate``); ``min_p`` in [0, 1] (0 = off); ``logprobs``: return the
    target's log-probability of each emitted token, with ``top_logprobs`` (0..20, needs
    ``logprobs``) alternatives. Semantics and order: :mod:`dflash.core.logits_processors`.

    Raises:
        InvalidParam: naming the field, for a value out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

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
        _finite("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _finite("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _finite("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0:
            object.__setattr__(self, "repetition_penalty", 1.0)
        _finite("min_p", self.min_p, 0.0, 1.0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not isinstance(self.logprobs, bool):
            raise InvalidParam("logprobs", f"must be a bool, got {self.logprobs!r}")
        n = self.top_logprobs
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidParam("top_logprobs", f"must be an int in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
        if n and not self.logprobs:
            raise InvalidParam("top_logprobs", "needs logprobs to be set")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        """Whether a logits processor (penalty or bias) changes the target's logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)

    def for_drafter(self) -> "Sampling":
        """The parameters a drafter needs to draw its drafts and their probabilities q: these,
        without the penalties, bias and logprobs (rejection sampling is lossless for any q, and
        the drafter is not sent hundreds of bias entries every step)."""
        if not (self.penalised or self.logprobs):
            return self
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        seed=self.seed, min_p=self.min_p)

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh generator: seeded from ``seed`` (reproducible) or from the OS. Unseeded
        requests sample from it; seeded ones use :func:`position_noise` instead."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed % 2**63 if self.seed is not None else secrets.randbits(63))
        return g


def _bias_pairs(bias: Mapping[int, float] | Iterable[tuple[int, float]]
                ) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``((id, bias), ...)``; raises InvalidParam naming the field."""
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParam("logit_bias", f"{len(items)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for entry in items:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise InvalidParam("logit_bias", f"expected (token id, bias) pairs, got {entry!r}")
        tok, b = entry
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise InvalidParam("logit_bias", f"token id {tok!r} is not an integer >= 0")
        if tok in out:
            raise InvalidParam("logit_bias", f"token id {tok} given twice")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) \
                or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"bias of token {tok} must be a number in "
                               f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r}")
        out[tok] = float(b)
    return tuple(sorted(out.items()))


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V] after temperature, top-k, top-p, min-p.

    Greedy sampling returns the one-hot of the argmax (first index on ties); top-k, top-p and
    min-p never remove the most likely token, so they cannot change it. min-p (transformers'
    ``MinPLogitsWarper``, after top-p as there) drops the tokens whose probability, after
    temperature, is below ``min_p`` times the most likely token's.
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
    if s.min_p > 0.0:
        probs = logits.softmax(-1)
        cut = s.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < cut, -math.inf)
    return logits.softmax(-1)


def exp_noise(shape: tuple[int, ...], g: torch.Generator,
              device: str | torch.device | None = None) -> torch.Tensor:
    """Exp(1) noise, float32 ``shape``, from ``g`` on ``device`` (default ``g.device``): every
    exponential race's noise (sampling, rejection sampling's recovered and bonus tokens,
    :func:`position_noise`).

    ``-log(u)`` with ``u`` from ``torch.rand`` ([0, 1) on a 2^-24 grid), a drawn 0 raised to
    2^-25 so the noise is finite and > 0 (an inf would exclude a token, a 0 would pick one of
    probability 0 as 0 / 0). A third of ``exponential_``'s time on a CPU (16 x 49,152: 6.6 vs
    22.6 ms with two threads), and a sampled step draws (k + 1) x V of it.
    """
    u = torch.rand(shape, generator=g, device=device if device is not None else g.device)
    return u.clamp_(min=2.0 ** -25).log_().neg_()


def sample_from(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Draw one index per row of ``probs`` [..., V] (exponential race, same rule as kernels),
    the noise drawn on ``g``'s device and moved to ``probs``'."""
    e = exp_noise(tuple(probs.shape), g).to(probs.device)
    return (probs / e).argmax(-1)


def position_noise(seed: int, positions: Iterable[int], vocab: int,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """The Exp(1) noise float32 ``[len(positions), V]`` a seeded request samples with: row i
    belongs to sequence index ``positions[i]`` (0-based, prompt included) and depends on
    ``(seed, position)`` only.

    A seeded request chooses the token at index t as ``argmax(p_t / noise_t)``
    (:func:`coupled_choice`), an exponential race, so an exact draw from ``p_t`` (the noise of
    t is independent of ``p_t``, which depends on earlier indices only). Verifier and drafter
    compute the same rows: the drafter drafts ``argmax(q_t / noise_t)`` and a draft is accepted
    iff it equals the target's own choice, so the output does not depend on the drafts, the
    block length, the batch or a late drafter: it equals the output without speculation.
    Drawn by a generator on ``device`` (CPU and CUDA generators draw different numbers for the
    same seed, so verifier and drafter agree when both are on the same kind of device).
    """
    rows = []
    for t in positions:
        h = hashlib.blake2b(f"dflash-sample/{seed}/{t}".encode(), digest_size=8).digest()
        g = torch.Generator(device=device).manual_seed(int.from_bytes(h, "little") >> 1)
        rows.append(exp_noise((vocab,), g))
    if not rows:
        return torch.empty((0, vocab), dtype=torch.float32, device=device)
    return torch.stack(rows)


def coupled_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / noise)`` per row of ``probs`` [..., V] (any float; noise broadcast to
    it, moved to its device): a seeded request's token, or a seeded draft (with q for p)."""
    return (probs.float() / noise.to(probs.device)).argmax(-1)
