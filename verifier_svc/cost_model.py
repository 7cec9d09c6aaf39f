"""Step cost of the speculation policy: seconds per decode step by batch bucket and block size.

* cells: ``(bucket(B), K) -> seconds`` of verify + draft of one step of ``B`` sessions whose
  largest block had ``K`` drafts (:class:`_Cell`, one per measured pair);
* overhead: seconds of each decode cycle spent outside verify and draft (acceptance, events,
  gRPC, the readers' turnaround), an :class:`EMA`; paid once per step whatever ``K`` is;
* a cell not measured yet is estimated by least squares over the measured ones::

      step seconds ~ a + per_session * B + per_token * B * (K + 1)

  floored by the dearest confirmed cell with no more sessions and no more drafts
  (:meth:`StepCostModel.fit`, :meth:`StepCostModel.estimate`);
* verify cells: ``(bucket(B), K) -> seconds`` of the target's verify alone (no draft), from
  which :meth:`StepCostModel.draft_budget` derives how long a step may wait for its drafts
  before speculating costs more than not speculating (the drafter calls' deadline), and which
  price suffix trees (:meth:`StepCostModel.verify_estimate`);
* a cell not observed in the last :data:`STALE_STEPS` steps is *stale*: priced no dearer than
  the fresh cells predict, and restarted by its next observation. A policy only re-measures
  the cells it chooses, so a price learned in a transient (start-up, another process) would
  otherwise keep its shape from being chosen, and so re-measured, for the life of the process
  (docs/bench/suffix-history/README.md, "What split them").

How the policy weighs these costs against expected tokens: ``verifier_svc/policy.py``.
"""

from __future__ import annotations

import numpy as np


def relative_rows(k: int) -> float:
    """Verify cost of ``k`` rows after the anchor relative to a decode step, before any is
    measured: one more row costs a fifth (a CPU's packed products start at two rows), each
    further row 2.5% (a line through the tree verify costs in
    docs/bench/trees-history/README.md, "Measurements")."""
    return 1.0 if k <= 0 else 1.2 + 0.025 * k


def bucket(batch: int) -> int:
    """Batch-size bucket: 1, 2, 4, 8, ... (the power of two at or above ``batch``)."""
    b = 1
    while b < batch:
        b *= 2
    return b


class EMA:
    """Exponential moving average that starts as a running mean: the i-th observation (from 1)
    weighs ``max(alpha, 1 / i)``, so the first one is not a starting value that only decays by
    ``1 - alpha`` per step (a slow first step kept a cell priced out for hundreds of tokens).
    Shared with ``verifier_svc/acceptance.py``."""

    def __init__(self, alpha: float):
        self.alpha, self.value, self.n = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(self.alpha, 1.0 / self.n) * (x - self.value)


#: Steps (verify observations) after which a cell's own price is no longer trusted over what
#: the fresh cells predict: several seconds of decoding.
STALE_STEPS = 256


class _Cell(EMA):
    """Step seconds of one (batch bucket, drafts) cell: an :class:`EMA` whose first two
    observations are screened for a one-off stall.

    Timing noise on a shared CPU is one-sided (another process, a collection, a big context
    upload only add time), so the cell starts from the *faster* of its first two steps, then
    continues as a running mean / EMA over the later ones. Until its second step a cell is
    ``provisional``: it is priced no dearer than the fit predicts and bounds no other cell
    (:meth:`StepCostModel.estimate`): a single stalled step would otherwise floor every longer
    block and steer the batch to a slower one (``docs/bench/perf-history/README.md``,
    "verifier_svc/cost_model.py")."""

    #: the cost model's step clock at the cell's last observation
    last: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.n <= 2:
            self.value = x if self.n == 1 else min(self.value, x)
        else:   # the two first steps count as one
            self.value += max(self.alpha, 1.0 / (self.n - 1)) * (x - self.value)

    @property
    def provisional(self) -> bool:
        return self.n < 2

    def stale(self, clock: int) -> bool:
        """Not observed in the last :data:`STALE_STEPS` steps of ``clock``."""
        return clock - self.last > STALE_STEPS

    def trusted(self, clock: int) -> bool:
        """Its own value is its price: observed twice, and recently."""
        return not self.provisional and not self.stale(clock)


def _between(known: list[tuple[int, float]], k: int) -> float | None:
    """Verify seconds at ``k`` rows from ``known`` ``(rows, seconds)`` cells (sorted by rows,
    ``k`` not among them): linear between the nearest below and above, else the nearest one
    scaled by :func:`relative_rows` (never below a cell with fewer rows, never above one with
    more); None when ``known`` is empty."""
    if not known:
        return None
    below = [kv for kv in known if kv[0] < k]
    above = [kv for kv in known if kv[0] > k]
    if below and above:
        (k1, v1), (k2, v2) = below[-1], above[0]
        return v1 + (v2 - v1) * (k - k1) / (k2 - k1)
    k1, v1 = below[-1] if below else above[0]
    est = v1 * relative_rows(k) / relative_rows(k1)
    return max(est, v1) if below else min(est, v1)


# (a, per_session, per_token), seconds: step seconds ~ a + per_session * B + per_token * B * (K + 1)
Fit = tuple[float, float, float]


class StepCostModel:
    """Measured step seconds per ``(bucket, K)`` cell, the per-cycle overhead, and estimates for
    cells not measured yet.

    Args:
        alpha: EMA weight of a new observation.
    """

    def __init__(self, alpha: float = 0.05):
        self.alpha = alpha
        self.cells: dict[tuple[int, int], _Cell] = {}   # (bucket, K) -> step seconds
        self.verify_cells: dict[tuple[int, int], _Cell] = {}   # (bucket, K) -> verify seconds
        self._overhead = EMA(alpha)                    # seconds per cycle outside verify + draft
        self.clock = 0                                 # verify observations so far (steps)

    # ------------------------------------------------------------------ inputs
    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """One step of ``batch`` sessions whose largest block had ``k`` drafts took ``seconds``
        (verify + draft)."""
        self._add(self.cells, (bucket(batch), k), seconds)

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        """The target's verify of one step of ``batch`` sessions whose largest block had ``k``
        drafts took ``seconds`` (no draft time: what the drafter costs is not in it). Every
        step is one, so these advance the step clock staleness is counted in."""
        self.clock += 1
        self._add(self.verify_cells, (bucket(batch), k), seconds)

    def _add(self, cells: dict[tuple[int, int], _Cell], key: tuple[int, int], seconds: float) -> None:
        """One observation of cell ``key``; a stale cell starts over (its old steps may have
        been a transient, and nothing re-measured it since)."""
        cell = cells.get(key)
        if cell is None or cell.stale(self.clock):
            cell = cells[key] = _Cell(self.alpha)
        cell.add(seconds)
        cell.last = self.clock

    def observe_overhead(self, seconds: float) -> None:
        """Seconds of one decode cycle (step end to step end, no prefill in between) spent
        outside verify and draft; negative values (clock jitter) count as 0."""
        self._overhead.add(max(0.0, seconds))

    # ------------------------------------------------------------------ outputs
    @property
    def overhead_seconds(self) -> float:
        return self._overhead.value

    def measured(self, b: int, k: int) -> bool:
        """Whether cell (bucket ``b``, ``k`` drafts) has at least one step."""
        return (b, k) in self.cells

    def verify_seconds(self, b: int, k: int) -> float | None:
        """Verify seconds of a step at (bucket ``b``, ``k`` drafts): its verify cell; unmeasured,
        the dearest measured cell of bucket ``b`` with fewer drafts (a lower bound: more drafts
        never verify faster); None when bucket ``b`` has no verify cell at or below ``k``."""
        e = self.verify_cells.get((b, k))
        if e is not None:
            return e.value
        return max((c.value for (b2, k2), c in self.verify_cells.items() if b2 == b and k2 < k),
                   default=None)

    def verify_estimate(self, b: int, k: int) -> float | None:
        """Verify seconds at (bucket ``b``, ``k`` rows after the anchor): its verify cell when
        trusted (:meth:`_Cell.trusted`); otherwise the prediction of the bucket's trusted cells
        (linear between the nearest two, or the nearest one scaled by :func:`relative_rows`),
        capped by the cell's own value where it has one (a cell measured once or long ago is
        priced no dearer than the fresh cells predict); None when the bucket has no verify
        cell."""
        e = self.verify_cells.get((b, k))
        if e is not None and e.trusted(self.clock):
            return e.value
        cells = [(k2, c) for (b2, k2), c in list(self.verify_cells.items()) if b2 == b and k2 != k]
        fresh = [(k2, c.value) for k2, c in cells if c.trusted(self.clock)]
        guess = _between(sorted(fresh), k) if fresh else None
        if e is not None:
            return e.value if guess is None else min(e.value, guess)
        return guess if guess is not None else _between(sorted((k2, c.value) for k2, c in cells), k)

    def draft_budget(self, batch: int, k: int, tokens: float) -> float | None:
        """Seconds the drafter calls of one step may take before the step costs more than the
        tokens it is expected to commit would cost without speculation::

            budget = tokens * (verify(B, 0) + overhead) - (verify(B, K) + overhead)

        ``batch`` sessions whose largest block has ``k`` verified drafts, ``tokens`` the mean
        expected committed tokens per session (bonus included; 1 for a session not
        speculating). A step without speculation emits one token per session for
        ``verify(B, 0) + overhead`` seconds; a speculative one pays ``verify(B, K) + draft +
        overhead`` for ``tokens``. Where a verify cell is not measured the budget errs long:
        ``verify(B, 0)`` is then bounded above by the cheapest cell of the bucket and
        ``verify(B, K)`` below by :meth:`verify_seconds`. None until the bucket has a verify
        cell. May be negative (speculating does not pay even with an instant drafter)."""
        b = bucket(batch)
        known = [c.value for (b2, _), c in self.verify_cells.items() if b2 == b]
        if not known:
            return None
        v0 = self.verify_seconds(b, 0)
        if v0 is None:
            v0 = min(known)
        vk = self.verify_seconds(b, k)
        vk = v0 if vk is None else max(vk, v0)
        over = self._overhead.value
        return tokens * (v0 + over) - (vk + over)

    def cost_table(self) -> dict[tuple[int, int], float]:
        """(batch bucket, drafts) -> EMA step seconds (a copy, for metrics)."""
        return {k: e.value for k, e in list(self.cells.items())}

    def fit(self) -> Fit | None:
        """``(a, per_session, per_token)`` seconds, least squares over the confirmed cells once
        they span two buckets and two block sizes (before that over every measured cell, so one
        stalled step moves the fit only while nothing better is known), stale cells left out
        while the fresh ones span two token counts; None until two token counts ``B * (K + 1)``
        were measured.

        Two slopes because a batched step pays per session (each session's KV cache is gathered
        into the batch and scattered back) as well as per verified token; a line in tokens
        alone cannot tell 16 sessions x 1 token from 1 session x 16 tokens. Until the cells
        separate the two, or when the three-term fit has a negative term, per_session is 0."""
        every = [(b, b * (k + 1), e) for (b, k), e in self.cells.items()]
        fresh = [c for c in every if not c[2].stale(self.clock)]
        if len({t for _, t, _ in fresh}) >= 2:      # stale cells only while the fresh cannot fit
            every = fresh
        cells = [(b, t, e.value) for b, t, e in every if not e.provisional]
        if len({b for b, _, _ in cells}) < 2 or len({t / b for b, t, _ in cells}) < 2:
            # the confirmed cells cannot separate the three terms: cells measured once count too
            cells = [(b, t, e.value) for b, t, e in every]
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

    def estimate(self, b: int, k: int, model: Fit | None) -> float:
        """Seconds of one cycle at (bucket ``b``, ``k`` drafts), overhead included.

        A trusted cell (two steps or more, the last one recent: :meth:`_Cell.trusted`), or any
        measured cell while there is no fit, is its own price. Otherwise ``model`` (from
        :meth:`fit`; must not be None for a cell never measured), floored by the dearest
        trusted cell with no more sessions and no more drafts (a step with more work never
        costs less, so a noisy fit cannot make an unmeasured large-batch cell look cheap); a
        cell measured once or long ago is priced at the lower of its value and that estimate,
        so one stalled step neither prices the cell out nor bounds every cell above it."""
        e = self.cells.get((b, k))
        if e is not None and (e.trusted(self.clock) or model is None):
            return e.value + self._overhead.value
        assert model is not None, "a cell measured never is priced by the fit"
        a, per_session, per_token = model
        floor = max((c.value for (b2, k2), c in self.cells.items()
                     if b2 <= b and k2 <= k and c.trusted(self.clock)), default=0.0)
        est = max(a + per_session * b + per_token * b * (k + 1), floor)
        if e is not None:
            est = min(est, e.value)
        return est + self._overhead.value
