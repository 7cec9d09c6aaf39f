"""Speculation policy: how many drafts each session verifies this step (0 = no speculation).

Modes, per deployment (``--spec-mode``) and per request (``SpeculationParams.mode``):

* ``off``: never speculate (the drafter is not called; plain autoregressive steps).
* ``fixed``: always the request's block size (``block_size - 1`` drafts).
* ``adaptive``: per step, the ``k`` that maximises expected committed tokens per second of the
  whole batch::

      E_i[k]  = 1 + sum_{p <= k} rate_ip         (rate_ip: unconditional acceptance of draft
                                                  position p in request i: its own counts, with
                                                  the drafter version's EMA as a prior worth
                                                  SESSION_PRIOR_STEPS steps; session_table)
      cost(k) = verify(B, K) + draft(B, K)       (EMA seconds per step, by batch-size bucket B
                                                  and the batch's largest block K)
              + overhead                         (EMA seconds of each decode cycle spent outside
                                                  verify and draft: acceptance, events, gRPC,
                                                  the readers' turnaround; the same for every k)
      k*      = argmax_k  sum_i (1 + accuracy * (E_i[k] - 1)) / cost(k)
                                                 (accuracy: committed / expected drafted tokens
                                                  of recent speculative steps, EMA)

  Leaving the per-step overhead out would favour short blocks and no speculation: it is paid
  once per step whatever k is, so it is amortised over more tokens by longer accepted blocks.

  ``k = 0`` is "no speculation": the drafter still receives the new context features (a block
  of size 1 = context update only), so its context stays current and acceptance does not
  collapse when speculation resumes. A (bucket, k) cell not measured yet is estimated by least
  squares over every measured cell, step seconds ~ a + per_session * B + per_token * B * (k + 1),
  floored by the dearest confirmed cell (measured twice or more) with no more sessions and no
  more drafts (until two token counts were measured, candidates are simply tried in order);
  a neighbour of the best k is re-measured every ``explore_every`` steps so the estimates
  follow load and acceptance (a cell starts from the faster of its first two steps, then is a
  running mean turning into an EMA, so one stalled step does not price a k out; ``_Cell``).
  In each batch bucket ``k = 0`` is measured
  first: it is the baseline the others must beat, and the cheapest step to try.

  While prompts wait for prefill, adaptive sessions do not speculate: the scheduler runs one
  prefill chunk per step, so a longer step holds every waiting request out of the batch for
  longer, and a bigger batch decodes each token more cheaply than speculation on a smaller one
  (32 HumanEval clients arriving at once, SmolLM2, 2 cores: adaptive 0.82x of no speculation
  when it speculated through the ramp, 0.99x when it yields; see README).

The inputs of every decision (``Decision``) travel on the step's ``StepEvent`` to metrics and
spans. Thread model: only the scheduler thread calls ``choose`` / ``observe_*``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("off", "fixed", "adaptive")
# Candidate draft counts: dense where acceptance changes fastest, sparse in the tail.
CANDIDATES = (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 15, 23, 31, 47, 63)
# How many steps of its own a request's acceptance needs to weigh as much as the drafter's EMA.
SESSION_PRIOR_STEPS = 4.0


def bucket(batch: int) -> int:
    """Batch-size bucket: 1, 2, 4, 8, ... (the power of two at or above ``batch``)."""
    b = 1
    while b < batch:
        b *= 2
    return b


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's choice and the figures it was made from (for metrics and spans)."""

    mode: str                       # the mode of the adaptive sessions, else of the batch
    k: int                          # drafts chosen for adaptive sessions (-1: none adaptive)
    batch: int
    expected_tokens: float = 0.0    # sum over adaptive sessions of E_i[k]
    cost_seconds: float = 0.0       # estimated step seconds at k
    explored: bool = False
    waiting: int = 0                # prompts waiting for prefill (adaptive: no speculation)


def session_table(prior: list[float], stats, strength: float = SESSION_PRIOR_STEPS) -> list[float]:
    """``[E[0], ..., E[top]]`` for one request: ``prior`` (the drafter's table, same form) moved
    towards the request's own acceptance.

    Per position p (1-based) the request's rate is ``(accepted_p + strength * prior_p) /
    (drafted_p + strength)`` from its ``AcceptanceCounter`` (``accepted_per_position``,
    ``drafted_per_position``): the prior counts as ``strength`` steps (a shrinkage estimate, as a
    Beta prior on each position's rate would give). Positions the request never drafted scale
    the last one it did by the prior's decay from there; no rate exceeds the one before it.

    Why per request: acceptance differs several-fold between prompts (HumanEval in process:
    tau 1.19-3.15 per prompt) and falls within an answer. The drafter-wide EMA lags a batch whose
    sessions move in step: a c=16 log had the policy expect 2,686 tokens over its speculative
    steps and commit 2,108 (k = 7: +16%), so it kept speculating where it lost to no
    speculation. ``stats`` None (or without per-position counts) returns ``prior``."""
    acc = getattr(stats, "accepted_per_position", None)
    tried = getattr(stats, "drafted_per_position", None)
    if not tried:
        return prior
    table, total, last, last_prior = [1.0], 1.0, None, None
    for p in range(len(prior) - 1):
        base = prior[p + 1] - prior[p]
        n = tried[p] if p < len(tried) else 0
        if n:
            a = acc[p] if p < len(acc) else 0
            r = (a + strength * base) / (n + strength)
        else:
            r = last * base / last_prior if last_prior else base
        if last is not None:
            r = min(r, last)      # unconditional rates never rise with the position
        last, last_prior = r, base
        total += r
        table.append(total)
    return table


class _EMA:
    """Exponential moving average that starts as a running mean: the i-th observation (from 1)
    weighs ``max(alpha, 1 / i)``, so the first one is not a starting value that only decays by
    ``1 - alpha`` per step. A cell first measured on a slow step (the first draft of a request
    carries its whole prompt's context to the drafter) otherwise kept adaptive from choosing
    it: in a HumanEval bench at batch 1 the policy stayed at k = 0 for six prompts (576 tokens),
    0.98x of no speculation, where another run at k = 3 made 1.24x."""

    def __init__(self, alpha: float):
        self.alpha, self.value, self.n = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(self.alpha, 1.0 / self.n) * (x - self.value)


class _Cell(_EMA):
    """Step seconds of one (batch bucket, drafts) cell: an :class:`_EMA` whose first two
    observations are screened for a one-off stall.

    Timing noise on a shared CPU is one-sided (another process, a collection, a big context
    upload only ever add time), so the cell starts from the *faster* of its first two steps,
    then continues as a running mean / EMA over the later ones. Until its second step a cell is
    ``provisional``: the policy prices it no dearer than the cost model predicts and it bounds
    no other cell (:meth:`SpeculationPolicy._estimate`). Session 20 (c=4, SmolLM2, Xeon): the
    single steps measured at k = 3 and 4 were stalls (391 and 373 ms against ~150 ms expected
    and 224 ms measured at k = 11); as the floor of every longer block they kept k = 3-9 out,
    and the batch ran k = 11 for 28 steps at 35 tokens/s where k = 1 ran at 50."""

    def add(self, x: float) -> None:
        self.n += 1
        if self.n <= 2:
            self.value = x if self.n == 1 else min(self.value, x)
        else:   # the two first steps count as one
            self.value += max(self.alpha, 1.0 / (self.n - 1)) * (x - self.value)

    @property
    def provisional(self) -> bool:
        return self.n < 2


class SpeculationPolicy:
    """Chooses per-step block lengths; learns acceptance and step cost online.

    Args:
        mode: the deployment default ("off" | "fixed" | "adaptive").
        alpha: EMA weight of a new observation.
        explore_every: adaptive steps between re-measurements of a neighbouring k.
    """

    def __init__(self, mode: str = "fixed", *, alpha: float = 0.05, explore_every: int = 25):
        if mode not in MODES:
            raise ValueError(f"spec_mode: {mode!r} not one of {', '.join(MODES)}")
        self.mode = mode
        self.alpha = alpha
        self.explore_every = explore_every
        self._drafted: dict[str, list[_EMA]] = {}    # label -> per-position "was drafted" weight
        self._accepted: dict[str, list[float]] = {}  # label -> per-position EMA acceptance
        self._cost: dict[tuple[int, int], _Cell] = {}  # (bucket, K) -> step seconds
        self._overhead = _EMA(alpha)                 # seconds per cycle outside verify + draft
        # calibration: drafted tokens the adaptive sessions' speculative steps were expected to
        # add (uncalibrated) and what they committed beyond the bonus token (EMAs per step)
        self._expected_extra = _EMA(alpha)
        self._committed_extra = _EMA(alpha)
        self._pending: tuple[list[int], float] | None = None   # (adaptive job indices, expected)
        self._steps = 0
        self.last_decision: Decision | None = None

    # ------------------------------------------------------------------ inputs
    def observe_acceptance(self, label: str, blocks: list[tuple[int, int]]) -> None:
        """One step's verified blocks of drafter ``label``: ``(drafts, accepted drafts)`` each.

        One EMA update per position per step, with the fraction of the step's blocks that
        accepted it: the EMA then remembers a number of steps whatever the batch size (updated
        per block, one step of 32 sessions moved it as far as 32 steps of one session, so the
        rates, and the policy's choice, followed whichever sessions the last step held)."""
        blocks = [(d, a) for d, a in blocks if d > 0]
        if not blocks:
            return
        rates = self._accepted.setdefault(label, [])
        seen = self._drafted.setdefault(label, [])
        top = max(d for d, _ in blocks)
        while len(rates) < top:
            rates.append(0.0)
            seen.append(_EMA(self.alpha))
        for p in range(top):
            drafted = [a for d, a in blocks if d > p]
            hit = sum(a > p for a in drafted) / len(drafted)
            e = seen[p]
            rates[p] = hit if e.n == 0 else rates[p] + max(self.alpha, 1.0 / (e.n + 1)) * (hit - rates[p])
            e.n += 1

    def observe_step(self, batch: int, k: int, verify_s: float, draft_s: float) -> None:
        """One step of ``batch`` sessions whose largest block had ``k`` drafts."""
        self._cost.setdefault((bucket(batch), k), _Cell(self.alpha)).add(verify_s + draft_s)

    def observe_overhead(self, seconds: float) -> None:
        """Seconds of one decode cycle (step end to step end, no prefill in between) spent
        outside verify and draft."""
        self._overhead.add(max(0.0, seconds))

    def observe_outcome(self, committed: list[int]) -> None:
        """Tokens each job of the step just chosen emitted (bonus token included). Speculative
        adaptive steps feed the calibration :attr:`accuracy`; other steps are ignored."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        idx, expected = pending
        self._expected_extra.add(expected)
        self._committed_extra.add(sum(max(committed[i] - 1, 0) for i in idx))

    @property
    def accuracy(self) -> float:
        """Committed / expected drafted tokens of recent speculative adaptive steps (1.0 until 5
        were seen), clamped to [0.25, 1.5]. Every request's expected drafted tokens are scaled
        by it: a c=16 log had the per-request estimates still 5-10% above what the steps
        committed (acceptance falls within an answer faster than its counts follow), which
        is the whole margin between speculating and not at that load."""
        if self._expected_extra.n < 5 or self._expected_extra.value <= 0:
            return 1.0
        return min(1.5, max(0.25, self._committed_extra.value / self._expected_extra.value))

    @property
    def overhead_seconds(self) -> float:
        return self._overhead.value

    def acceptance_table(self) -> dict[str, list[float]]:
        """drafter label -> per-position EMA acceptance (a copy, for metrics)."""
        return {k: list(v) for k, v in list(self._accepted.items())}

    def cost_table(self) -> dict[tuple[int, int], float]:
        """(batch bucket, drafts) -> EMA step seconds (a copy, for metrics)."""
        return {k: e.value for k, e in list(self._cost.items())}

    def rates(self, label: str) -> list[float]:
        """Per-position unconditional acceptance rates (EMA) of drafter ``label``."""
        return list(self._accepted.get(label, []))

    def expected_tokens(self, label: str, k: int) -> float:
        """E[committed tokens] of one step with ``k`` drafts: 1 + sum of the first k rates.

        Positions never measured extrapolate geometrically from the last measured conditional
        rate (optimistic 0.9 before anything was measured)."""
        return self.expected_table(label, k)[k]

    def expected_table(self, label: str, top: int) -> list[float]:
        """``[E[0], E[1], ..., E[top]]`` for drafter ``label`` in one pass."""
        rates = self._accepted.get(label, [])
        table, total, prev, cond = [1.0], 1.0, 1.0, 0.9
        for p in range(top):
            if p < len(rates):
                r = rates[p]
                cond = r / prev if prev > 0 else 0.0
            else:
                r = prev * min(cond, 1.0)
            prev = r
            total += r
            table.append(total)
        return table

    def _cost_model(self) -> tuple[float, float, float] | None:
        """``(a, per_session, per_token)`` with step seconds ~ a + per_session * B + per_token *
        B * (K + 1), least squares over the confirmed (bucket B, drafts K) cells once they span two
        buckets and two block sizes (before that over every measured cell, so one stalled step
        moves the fit only while nothing better is known); None until two token counts were
        measured.

        Two slopes because a batched step pays per session (each session's KV cache is gathered
        into the batch and scattered back) as well as per verified token; a line in tokens
        alone cannot tell 16 sessions x 1 token from 1 session x 16 tokens. Until the cells
        separate the two (two batch buckets and two block sizes), per_session is 0."""
        cells = [(b, b * (k + 1), e.value) for (b, k), e in self._cost.items() if not e.provisional]
        if len({b for b, _, _ in cells}) < 2 or len({t / b for b, t, _ in cells}) < 2:
            # the confirmed cells cannot separate the three terms: cells measured once count too
            cells = [(b, b * (k + 1), e.value) for (b, k), e in self._cost.items()]
        if len({t for _, t, _ in cells}) < 2:
            return None
        y = np.array([c for _, _, c in cells])
        x = np.array([[1.0, b, t] for b, t, _ in cells])
        if np.linalg.matrix_rank(x) == 3:
            a, per_session, per_token = np.linalg.lstsq(x, y, rcond=None)[0]
            if min(a, per_session, per_token) >= 0:
                return float(a), float(per_session), float(per_token)
        a, per_token = np.linalg.lstsq(x[:, [0, 2]], y, rcond=None)[0]
        per_token = max(float(per_token), 0.0)
        a = max(float(np.mean(y - per_token * x[:, 2])), 0.0)
        return a, 0.0, per_token

    def _estimate(self, b: int, k: int, model) -> float:
        """Step seconds at (bucket ``b``, ``k`` drafts): measured, else from the fitted model,
        but never below a confirmed cell (two steps or more, :class:`_Cell`) with no more
        sessions and no more drafts (a step with more work never costs less; this keeps a noisy
        or under-fitted model from making an unmeasured large-batch cell look cheap, and trying
        one costs seconds). A cell measured once is priced at the lower of its step and that
        estimate: one stalled step neither prices the cell out nor every cell above it."""
        e = self._cost.get((b, k))
        if e is not None and (not e.provisional or model is None):
            return e.value + self._overhead.value
        a, per_session, per_token = model
        floor = max((c.value for (b2, k2), c in self._cost.items()
                     if b2 <= b and k2 <= k and not c.provisional), default=0.0)
        est = max(a + per_session * b + per_token * b * (k + 1), floor)
        if e is not None:
            est = min(est, e.value)
        return est + self._overhead.value

    # ------------------------------------------------------------------ choice
    def choose(self, jobs, waiting: int = 0) -> list[int]:
        """Drafts per job this step. ``jobs``: objects with ``mode``, ``block_limit``,
        ``req.max_tokens``, ``emitted`` and ``req.proposer`` (the scheduler's jobs);
        ``waiting``: requests whose prompts wait for prefill behind this step."""
        self._pending = None
        limits = [max(0, min(j.block_limit - 1, j.req.max_tokens - j.emitted - 1)) for j in jobs]
        modes = [j.mode if j.req.proposer is not None else "off" for j in jobs]
        ks = [lim if m == "fixed" else 0 for m, lim in zip(modes, limits)]
        adaptive = [i for i, m in enumerate(modes) if m == "adaptive"]
        if not adaptive:
            self.last_decision = Decision(mode=modes[0] if len(set(modes)) == 1 else "mixed",
                                          k=-1, batch=len(jobs))
            return ks
        if waiting:
            self.last_decision = Decision(mode="adaptive", k=0, batch=len(jobs), waiting=waiting)
            return ks
        b = bucket(len(jobs))
        floor = max(ks)                       # fixed sessions' blocks set the batch's shape
        top = max(limits[i] for i in adaptive)
        cands = [k for k in CANDIDATES if k <= top] + ([top] if top not in CANDIDATES else [])
        top_all = max(limits)
        priors: dict[str, list[float]] = {}   # drafter label -> its E table
        tables: dict[int, list[float]] = {}   # job index -> the request's E table

        accuracy = self.accuracy

        def raw(i: int, k: int) -> float:
            if i not in tables:
                label = jobs[i].req.proposer.card.label
                if label not in priors:
                    priors[label] = self.expected_table(label, top_all)
                tables[i] = session_table(priors[label], getattr(jobs[i], "stats", None))
            return tables[i][k]

        def e(i: int, k: int) -> float:
            return 1.0 + accuracy * (raw(i, k) - 1.0)

        fixed_tokens = sum(e(i, ks[i]) for i in range(len(jobs)) if modes[i] == "fixed") + \
            sum(1.0 for m in modes if m == "off")

        def gain(k):
            return fixed_tokens + sum(e(i, min(k, limits[i])) for i in adaptive)

        model = self._cost_model()
        unmeasured = [k for k in cands if (b, max(k, floor)) not in self._cost]
        explored = False
        if unmeasured and model is None:
            best, explored = unmeasured[0], True
        elif (b, floor) not in self._cost:
            # The step without (further) speculation is the baseline every other k must beat
            # and the cheapest step to try: measure it first in every batch bucket instead of
            # extrapolating it (a logged c=32 level ran k = 1-2 at every step of bucket 32
            # without k = 0 ever being measured there).
            best, explored = 0, True
        else:
            best = max(cands, key=lambda k: gain(k) / max(self._estimate(b, max(k, floor), model), 1e-9))
            explored = best in unmeasured
            self._steps += 1
            if self.explore_every and self._steps % self.explore_every == 0:
                # alternately the next longer and the next shorter block; at either end of the
                # candidates the one neighbour every time (from k = 0 the alternation made every
                # other exploration a plain k = 0 step)
                i = cands.index(best)
                up = (self._steps // self.explore_every) % 2 == 1 or i == 0
                nb = cands[min(i + 1, len(cands) - 1)] if up and i + 1 < len(cands) \
                    else cands[max(i - 1, 0)]
                best, explored = nb, nb != best
        cost = self._estimate(b, max(best, floor), model) if model or (b, max(best, floor)) in self._cost else 0.0
        self.last_decision = Decision(mode="adaptive", k=best, batch=len(jobs),
                                      expected_tokens=gain(best), cost_seconds=cost,
                                      explored=explored)
        for i in adaptive:
            ks[i] = min(best, limits[i])
        if best > 0:
            self._pending = (adaptive, sum(raw(i, ks[i]) - 1.0 for i in adaptive))
        return ks
