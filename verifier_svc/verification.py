"""One decode step's verification for the whole batch, as a pure function of tensors.

:func:`verify_batch` takes, per request (row) of the step, the drafts, the target's logits for
the verified block and the drafter's probabilities, plus the request's sampling parameters,
random generator, stop ids and remaining room, and returns what the row commits.

Math (via the :mod:`kernels` entry points, which pick the Triton kernel on CUDA and the torch
reference elsewhere; see :mod:`kernels.reference`):

* greedy rows (temperature < ``GREEDY_EPS``): longest prefix with ``draft[j] ==
  argmax(logits[j])``, then the bonus token ``argmax(logits[accepted])`` (z-lab/dflash
  ``dflash_generate`` greedy acceptance, ``kernels.greedy_accept``);
* seeded sampled rows (``sampling.seed`` set): coupled sampling. The target's token at block
  position j is ``argmax(p_j / e_j)`` with ``e_j = position_noise(seed, position + j)``
  (:func:`dflash.core.sampling.position_noise`, keyed by sequence index), so an exact draw from
  ``p_j``; the drafts are accepted while they equal those tokens (``kernels.greedy_accept`` on
  the scores ``p / e``), then that token is the bonus. The output is the one of decoding
  without speculation whatever the drafts: the seeded drafter drafts ``argmax(q_j / e_j)`` with
  the same noise, so a draft is accepted as often as the two races agree;
* unseeded sampled rows: speculative (rejection) sampling, Leviathan et al. 2023 Alg. 1 / Chen
  et al. 2023 (``kernels.rejection_sample``): draft ``d_j`` accepted when ``u_j * q_j(d_j) <=
  p_j(d_j)`` with ``p_j(d_j) > 0`` and ``q_j(d_j) > 0``, the recovered token drawn from
  ``max(p - q, 0)`` at the first rejection, else the bonus token from ``p_K``. ``p =
  probs_from_logits(logits, sampling)``; ``q`` is the drafter's probabilities (checked finite,
  non-negative and positive on each draft by ``DrafterSync.malformed``), or the one-hot of the
  drafts when the drafter sent none.

Shapes and dtypes (row ``i`` with ``k_i`` drafts, vocabulary ``V``, same for every row):

* ``drafts[i]``: integer (int64) ``[k_i]``;
* ``logits[i]``: float (float32 from the target) ``[k_i + 1, V]``; row ``j`` scores the token
  after block position ``j`` of ``[anchor, d_1..d_k]``, after the request's penalties and logit
  bias with that row's own state (the engine applies them, ``dflash.core.logits_processors``);
* ``draft_probs[i]``: float ``[k_i, V]`` or ``None`` (shape checked always, values only read
  for sampled rows);
* kernel inputs per group of ``n`` rows: drafts ``[n, k]`` int64, logits / p ``[n, k + 1, V]``,
  q ``[n, k, V]`` float32, uniforms ``[n, k]`` float32, exponential noise ``[n, k + 1, V]``
  float32.

Batching: rows are grouped by (greedy or sampled, k) and each group is ONE kernel call over its
rows stacked; in the usual step every row has the same k, so there is one call per mode. Grouping
by k keeps the result exact: every row of a group is computed exactly as alone (the kernels are
row-independent). Padding a shorter block up to a common k instead would need the padded drafts
to be rejected with probability 1 (and their random numbers not drawn), which the kernels do not
express.

Randomness: each unseeded sampled row draws from its own generator exactly as the per-session
loop did (``VerifierEngine._verify``): ``u = rand((1, k))`` first, then ``e = Exp(1)`` noise
shaped like ``p`` ``[1, k + 1, V]`` (:func:`dflash.core.sampling.exp_noise`), rows in order, so
a generator shared by rows is consumed as by a loop over them. A
uniform of exactly 0 becomes 1 (:func:`_uniforms_open_closed`): ``u`` lies in (0, 1] and no
other draw changes. The numbers are drawn on the generator's device and moved to the logits'
device. Greedy and seeded rows draw nothing from a generator.

Commit cut per row (:func:`commit_cut`, shared with tree verification): the accepted drafts
plus the bonus/recovered token, cut after the first token in ``stops`` (finish ``"stop"``), then
to ``room`` tokens (finish ``"stop"`` if already set, else ``"length"``); ``accepted`` counts the
accepted drafts among the committed tokens.
"""

from __future__ import annotations

import dataclasses

import torch

import kernels
from dflash.core.finish import FINISH_LENGTH, FINISH_STOP
from dflash.core.sampling import Sampling, exp_noise, position_noise, probs_from_logits

__all__ = ["RowParams", "Verified", "commit_cut", "verify_batch"]


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-request parameters of one row.

    ``generator`` is required when ``sampling`` is sampled and unseeded; ``room`` is how many
    tokens the request may still emit (``max_tokens - emitted``, >= 1); ``position`` is the
    sequence index (prompt included, 0-based) of the token after the anchor: the index a
    seeded row's noise is keyed by (:func:`dflash.core.sampling.position_noise`).
    """

    sampling: Sampling
    generator: torch.Generator | None
    stops: frozenset[int]
    room: int
    position: int = 0

    def __post_init__(self):
        if self.room < 1:
            raise ValueError(f"room must be >= 1, got {self.room}")
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")
        if self.coupled is False and self.generator is None:
            raise ValueError("generator is required for an unseeded sampled row")

    @property
    def coupled(self) -> bool | None:
        """None for a greedy row, True for a seeded sampled row (coupled sampling), False for
        an unseeded one (rejection sampling)."""
        if self.sampling.greedy:
            return None
        return self.sampling.seed is not None


@dataclasses.dataclass(frozen=True)
class Verified:
    """What one row commits this step.

    ``tokens``: committed after the stop/length cut; ``accepted``: accepted drafts among them
    (``min(accepted, len(tokens))``); ``drafted``: k of the row; ``finish``: ``"stop"``,
    ``"length"`` or None.
    """

    tokens: list[int]
    accepted: int
    drafted: int
    finish: str | None


def verify_batch(drafts: list[torch.Tensor], logits: list[torch.Tensor],
                 draft_probs: list[torch.Tensor | None], params: list[RowParams]
                 ) -> list[Verified]:
    """Verify every row of a step; see the module docstring for shapes, math and randomness.

    Raises:
        ValueError: naming the argument, when the lists differ in length or a row's shapes do
            not agree (logits rows != k + 1, vocab sizes differ, draft_probs not [k, V], ...).
    """
    n = len(drafts)
    for name, seq in (("logits", logits), ("draft_probs", draft_probs), ("params", params)):
        if len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} rows, but drafts has {n}")
    if n == 0:
        return []
    vocab = _check_rows(drafts, logits, draft_probs, params)
    # drawn per row in row order, not per group: a shared generator is consumed as by a row loop
    noise = _draw_noise(drafts, params, vocab)

    groups: dict[tuple[bool | None, int], list[int]] = {}
    for i, par in enumerate(params):
        groups.setdefault((par.coupled, drafts[i].shape[0]), []).append(i)

    raw: list[tuple[int, list[int]] | None] = [None] * n
    for (coupled, k), rows in groups.items():
        device = logits[rows[0]].device
        d = torch.stack([drafts[i].to(device=device, dtype=torch.int64) for i in rows])  # [m, k]
        if coupled is None:
            acc, out = kernels.greedy_accept(d, torch.stack([logits[i] for i in rows]))
        elif coupled:
            scores = torch.stack([_coupled_scores(logits[i], params[i], k) for i in rows])
            acc, out = kernels.greedy_accept(d, scores)
        else:
            p = torch.stack([probs_from_logits(logits[i], params[i].sampling) for i in rows])
            q = torch.stack([
                qi.to(device=device, dtype=torch.float32)
                if (qi := draft_probs[i]) is not None else
                torch.nn.functional.one_hot(d[j], vocab).float()
                for j, i in enumerate(rows)])                                       # [m, k, V]
            u = torch.cat([noise[i][0] for i in rows]).to(device)                    # [m, k]
            e = torch.cat([noise[i][1] for i in rows]).to(device)                    # [m, k+1, V]
            acc, out = kernels.rejection_sample(d, q, p, u, e)
        for i, a, o in zip(rows, acc.tolist(), out.tolist()):
            raw[i] = (a, o[:a + 1])

    results = []
    for i, par in enumerate(params):
        row = raw[i]
        assert row is not None                    # every row is in one group
        new, accepted, finish = commit_cut(row[1], row[0], par)
        results.append(Verified(tokens=new, accepted=accepted, drafted=drafts[i].shape[0],
                                finish=finish))
    return results


def _draw_noise(drafts: list[torch.Tensor], params: list[RowParams], vocab: int
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each unseeded sampled row's random numbers by row index: uniforms ``u`` ``[1, k]`` in
    (0, 1], then Exp(1) noise ``e`` ``[1, k + 1, V]``, float32 on the generator's device (the
    module docstring, Randomness), drawn rows in order. Greedy and seeded rows draw nothing and
    are absent."""
    noise: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, par in enumerate(params):
        if par.coupled is not False:       # greedy and seeded rows draw nothing
            continue
        k, gen = drafts[i].shape[0], par.generator
        assert gen is not None                # RowParams requires one for a sampled row
        u = _uniforms_open_closed(torch.rand((1, k), generator=gen, device=gen.device))
        e = exp_noise((1, k + 1, vocab), gen)
        noise[i] = (u, e)
    return noise


def _coupled_scores(logits: torch.Tensor, par: RowParams, k: int) -> torch.Tensor:
    """``p / e`` [k + 1, V] of a seeded row: block position j races against the noise of
    sequence index ``par.position + j``; its argmax is the target's token there."""
    assert par.sampling.seed is not None                  # coupled rows are the seeded ones
    noise = position_noise(par.sampling.seed, range(par.position, par.position + k + 1),
                           logits.shape[-1], logits.device)
    return probs_from_logits(logits, par.sampling) / noise


def commit_cut(tokens: list[int], accepted: int, params: RowParams
               ) -> tuple[list[int], int, str | None]:
    """The commit cut of one row, shared by chains (:func:`verify_batch`) and trees
    (``verifier_svc.tree.verify_trees``).

    ``tokens``: the accepted drafts then the bonus/recovered token; ``accepted``: how many of
    them are accepted drafts. Cut after the first token in ``params.stops`` (finish ``"stop"``),
    then to ``params.room`` tokens (finish ``"stop"`` if already set, else ``"length"``).
    Returns ``(committed tokens, accepted drafts among them, finish or None)``.
    """
    finish = None
    for j, tok in enumerate(tokens):
        if tok in params.stops:
            tokens, finish = tokens[:j + 1], FINISH_STOP
            break
    if len(tokens) >= params.room:
        tokens, finish = tokens[:params.room], finish or FINISH_LENGTH
    return tokens, min(accepted, len(tokens)), finish


def _uniforms_open_closed(u: torch.Tensor) -> torch.Tensor:
    """Uniforms from ``torch.rand`` (any shape, float32, in [0, 1)) moved to (0, 1], in place.

    ``torch.rand`` draws float32 from the grid ``{0, 2^-24, ..., 1 - 2^-24}`` on the CPU; a 0
    (once in 2^24 draws) would make ``u * q(d) <= p(d)`` hold for ``p(d) = 0``. Mapping 0 to 1
    gives the grid ``{2^-24, ..., 1}``, the same law as ``1 - u`` (on CUDA, where torch turns
    curand's (0, 1] draws of 1 into 0, it puts them back), while every other draw, and so every
    seeded output, is unchanged (``1 - u`` would change them all); it draws nothing.
    """
    return u.masked_fill_(u == 0, 1.0)


def _check_rows(drafts, logits, draft_probs, params) -> int:
    """Validate every row's shapes (at least one row); return the (common) vocabulary size."""
    vocab: int | None = None
    for i, (d, lg, q, par) in enumerate(zip(drafts, logits, draft_probs, params)):
        if not isinstance(par, RowParams):
            raise ValueError(f"params[{i}]: expected RowParams, got {type(par).__name__}")
        if d.dim() != 1 or d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ValueError(f"drafts[{i}]: expected a 1-D integer tensor [k], got "
                             f"{d.dtype} {tuple(d.shape)}")
        k = d.shape[0]
        if lg.dim() != 2 or lg.shape[0] != k + 1:
            raise ValueError(f"logits[{i}]: expected [k + 1 = {k + 1}, V], got {tuple(lg.shape)}")
        if vocab is None:
            vocab = lg.shape[1]
        elif lg.shape[1] != vocab:
            raise ValueError(f"logits[{i}]: vocab size {lg.shape[1]} != {vocab} of row 0")
        if q is not None and tuple(q.shape) != (k, vocab):
            raise ValueError(f"draft_probs[{i}]: expected [k = {k}, V = {vocab}], got "
                             f"{tuple(q.shape)}")
    assert vocab is not None
    return vocab
