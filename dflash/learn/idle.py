"""The learner inside the drafter process: it trains only while the drafter is idle.

A daemon thread (``SCHED_IDLE`` on Linux: it runs only on a core nothing else wants, with its
own ``threads`` torch threads) waits until no draft request came for ``idle_s`` seconds, then
runs the learner's optimizer steps one at a time until a request arrives (the engine stamps
``last_draft`` at every call's arrival): a request waits at most for the step in flight
(``tests/test_learn_gate.py::test_learner_stops_within_one_step_of_a_request``). Progress and the
held-out curve are Prometheus gauges (``dflash_learn_*``) on the drafter's registry.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from dflash.learn.store import SPLITS, Split
from dflash.serving.threads import claim

log = logging.getLogger("dflash.learn")


class IdleLearner:
    """Args:
        engine: the drafter engine (its ``last_draft`` is the idle clock).
        learner: a :class:`dflash.learn.learner.Learner`.
        idle_s: seconds without a draft request before training starts.
        threads: torch threads of the learning thread (>= 1).
        registry: where the ``dflash_learn_*`` gauges go (None = none).
        steps_per_round: optimizer steps between re-reads of the store.
    """

    def __init__(self, engine, learner, *, idle_s: float, threads: int = 1,
                 registry: CollectorRegistry | None = None, steps_per_round: int = 25):
        self.engine, self.learner = engine, learner
        self.idle_s, self.threads, self.steps_per_round = idle_s, threads, steps_per_round
        self._stop = threading.Event()
        self.rounds = 0
        if registry is not None:
            registry.register(_Collector(self))
        self._thread = threading.Thread(target=self._loop, name="learn-idle", daemon=True)

    def start(self) -> IdleLearner:
        self._thread.start()
        return self

    def busy(self) -> bool:
        """A draft request came within ``idle_s`` (or the learner is stopping)."""
        return self._stop.is_set() or time.monotonic() - self.engine.last_draft < self.idle_s

    def _loop(self) -> None:
        claim(self.threads, others=torch.get_num_threads())   # the process default stays
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            log.warning("learner thread keeps the process's scheduling policy: %s", e)
        while not self._stop.wait(min(1.0, self.idle_s)):
            if self.busy() or self.learner.step >= self.learner.cfg.max_steps:
                continue
            try:
                if not self.learner.store.counts()[Split.TRAIN]:
                    continue
                if self.learner.run(self.steps_per_round, self.busy):
                    self.rounds += 1
                    if self.rounds % max(1, self.learner.cfg.eval_every // self.steps_per_round) == 0:
                        self.learner.log_heldout()
            except Exception:                # noqa: BLE001 -- learning must never stop serving
                log.exception("learner: a round failed")
                self._stop.wait(30.0)

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class _Collector:
    """``dflash_learn_*`` gauges read from the learner at scrape time."""

    def __init__(self, idle: IdleLearner):
        self.idle = idle

    def collect(self):
        ln = self.idle.learner
        steps = GaugeMetricFamily("dflash_learn_steps", "Optimizer steps of the current candidate.",
                                  labels=["base"])
        steps.add_metric([ln.base], ln.step)
        secs = GaugeMetricFamily("dflash_learn_train_seconds",
                                 "Seconds the current candidate has trained.", labels=["base"])
        secs.add_metric([ln.base], ln.seconds)
        tau = GaugeMetricFamily("dflash_learn_heldout_tau",
                                "Teacher-forced tau of the candidate on the held-out captured "
                                "conversations, at the last point of its curve.", labels=["base"])
        if ln.curve:
            tau.add_metric([ln.base], ln.curve[-1]["tau"])
        convs = GaugeMetricFamily("dflash_learn_store_conversations",
                                  "Captured conversations kept, per split.", labels=["split"])
        c = ln.store.counts()
        for split in SPLITS:
            convs.add_metric([split], c[split])
        size = GaugeMetricFamily("dflash_learn_store_bytes", "Bytes of the capture store.")
        size.add_metric([], c["bytes"])
        return [steps, secs, tau, convs, size]
