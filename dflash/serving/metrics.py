"""Prometheus metrics of the three services, each on the registry it is given.

The speculative-decoding counters mean what vLLM's ``vllm:spec_decode_*`` counters mean
(definitions in :mod:`dflash.core.stats`). Derived with PromQL over a window ``w``::

    tau (mean acceptance length) = 1 + rate(dflash_spec_decode_num_accepted_tokens_total[w])
                                     / rate(dflash_spec_decode_num_drafts_total[w])
    per-position rate i          = rate(dflash_spec_decode_num_accepted_tokens_per_pos_total{position="i"}[w])
                                     / rate(dflash_spec_decode_num_drafts_total[w])
    draft acceptance rate        = rate(..._num_accepted_tokens_total[w]) / rate(..._num_draft_tokens_total[w])

Every spec-decoding series carries ``drafter_version`` (the drafter card's ``name@version``;
``none`` for steps without a drafter). ``position`` i is draft position i + 1 in the block.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

V = "drafter_version"
NO_DRAFTER = "none"
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0)
STEP_LENGTHS = tuple(range(1, 17)) + (20, 24, 32, 48, 64)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0,
               24.0, 32.0, 64.0)
BYTES = tuple(float(1 << i) for i in range(10, 31, 2))   # 1 KiB .. 1 GiB


class VerifierMetrics:
    """Per verify step (``step``), per prefill, fallbacks, and session gauges."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.drafts = Counter("dflash_spec_decode_num_drafts",
                              "Verify steps that carried a draft block (vLLM num_drafts).", [V], registry=r)
        self.draft_tokens = Counter("dflash_spec_decode_num_draft_tokens",
                                    "Draft tokens proposed and verified.", [V], registry=r)
        self.accepted = Counter("dflash_spec_decode_num_accepted_tokens",
                                "Draft tokens accepted and emitted (bonus token excluded).", [V], registry=r)
        self.accepted_per_pos = Counter(
            "dflash_spec_decode_num_accepted_tokens_per_pos",
            "Steps whose draft position (position + 1) was accepted and emitted.", [V, "position"],
            registry=r)
        self.acceptance_length = Histogram(
            "dflash_spec_decode_acceptance_length",
            "Tokens committed per drafted step, bonus included (1 + accepted).", [V],
            buckets=STEP_LENGTHS, registry=r)
        self.fallbacks = Counter("dflash_spec_decode_fallback_steps",
                                 "Steps that ran without speculation because the drafter failed.",
                                 [V, "reason"], registry=r)
        self.draft_seconds = Histogram("dflash_spec_decode_draft_seconds",
                                       "Drafter compute per step, as reported by the drafter.", [V],
                                       buckets=SECONDS, registry=r)
        self.wire_seconds = Histogram(
            "dflash_spec_decode_wire_seconds",
            "Draft round trip minus drafter compute: serialization, network, queueing.", [V],
            buckets=SECONDS, registry=r)
        self.verify_seconds = Histogram("dflash_spec_decode_verify_seconds",
                                        "Target forward + acceptance per decode step.", [V],
                                        buckets=SECONDS, registry=r)
        self.context_bytes = Histogram("dflash_spec_decode_context_bytes",
                                       "Hidden-state (tap) bytes sent to the drafter per step.", [V],
                                       buckets=BYTES, registry=r)
        self.generation_tokens = Counter("dflash_verifier_generation_tokens",
                                         "Tokens committed (prefill's first token included).",
                                         registry=r)
        self.prompt_tokens = Counter("dflash_verifier_prompt_tokens", "Prompt tokens received.",
                                     registry=r)
        self.cached_prompt_tokens = Counter("dflash_verifier_cached_prompt_tokens",
                                            "Prompt tokens reused from a session's KV cache.",
                                            registry=r)
        # vLLM's names and meaning (tokens): prompt tokens looked up, and of those found cached
        # (the prefix cache, the session's own K/V, or a sample of the same request)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the KV caches.", registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found cached (not prefilled).", registry=r)
        self.prefill_seconds = Histogram("dflash_verifier_prefill_seconds",
                                         "Prefill (prompt forward + first token).", buckets=SECONDS,
                                         registry=r)
        self.running = Gauge("dflash_verifier_running_requests", "Requests generating now.",
                             registry=r)
        self.batch_size = Histogram(
            "dflash_verifier_step_batch_size",
            "Sessions verified in the same target forward, observed once per session-step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.policy_drafts = Histogram(
            "dflash_spec_decode_policy_drafts",
            "Drafts the speculation policy chose per session-step (0 = no speculation).",
            [V, "mode"], buckets=(0,) + STEP_LENGTHS, registry=r)
        self.tree_drafts = Counter(
            "dflash_spec_decode_num_tree_drafts",
            "Drafted steps verified as a tree (DDTree); they count in num_drafts too, with the "
            "tree's depth as draft tokens.", [V], registry=r)
        self.tree_nodes = Counter("dflash_spec_decode_num_tree_nodes",
                                  "Tree nodes verified (the root/bonus token not counted).", [V],
                                  registry=r)
        self.accepted_by_source = Counter(
            "dflash_spec_decode_num_accepted_tokens_by_source",
            "Accepted draft tokens by who proposed them: drafter (a candidate the suffix index "
            "or the grammar also proposed included), suffix (the suffix index alone) or grammar "
            "(forced by the request's grammar alone; a series only once one was); they sum to "
            "num_accepted_tokens.", [V, "source"], registry=r)
        self.suffix_nodes = Counter("dflash_spec_decode_num_suffix_nodes",
                                    "Suffix candidates verified (tree nodes from the suffix index).",
                                    [V], registry=r)
        self._pos_children: dict[tuple[str, int], object] = {}

    def step(self, label: str, *, drafted: int, accepted: int, fallback: str | None,
             verify_s: float, draft_s: float | None, wire_s: float | None,
             context_bytes: int | None, tree_nodes: int = 0, suffix_nodes: int = 0,
             suffix_accepted: int = 0, grammar_accepted: int = 0) -> None:
        """One decode step. ``accepted`` counts drafts accepted and emitted (stop-aware); a tree
        step (``tree_nodes`` > 0) gives its depth as ``drafted`` and its path as ``accepted``;
        ``suffix_nodes`` of its nodes were suffix candidates, ``suffix_accepted`` of ``accepted``
        only the suffix index proposed, ``grammar_accepted`` only the request's grammar."""
        if tree_nodes:
            self.tree_drafts.labels(label).inc()
            self.tree_nodes.labels(label).inc(tree_nodes)
        if suffix_nodes:
            self.suffix_nodes.labels(label).inc(suffix_nodes)
        if drafted > 0:
            self.drafts.labels(label).inc()
            self.draft_tokens.labels(label).inc(drafted)
            self.accepted.labels(label).inc(accepted)
            self.accepted_by_source.labels(label, "drafter").inc(
                accepted - suffix_accepted - grammar_accepted)
            self.accepted_by_source.labels(label, "suffix").inc(suffix_accepted)
            if grammar_accepted:
                self.accepted_by_source.labels(label, "grammar").inc(grammar_accepted)
            self.acceptance_length.labels(label).observe(1 + accepted)
            for i in range(drafted):
                child = self._pos_children.get((label, i))
                if child is None:  # create every position's series so rates read 0, not "no data"
                    child = self._pos_children[(label, i)] = self.accepted_per_pos.labels(label, str(i))
                if i < accepted:
                    child.inc()
        if fallback:
            self.fallback(fallback, label)
        self.verify_seconds.labels(label).observe(verify_s)
        if draft_s is not None:
            self.draft_seconds.labels(label).observe(draft_s)
        if wire_s is not None:
            self.wire_seconds.labels(label).observe(wire_s)
        if context_bytes is not None:
            self.context_bytes.labels(label).observe(context_bytes)

    def prefill(self, *, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefill_seconds.observe(seconds)

    def fallback(self, reason: str, label: str) -> None:
        self.fallbacks.labels(label or NO_DRAFTER, reason).inc()


class PolicyGauges:
    """The adaptive speculation policy's inputs, read at scrape time from ``engine().policy``:

    * ``dflash_spec_policy_acceptance_rate{drafter_version, position}``: EMA of the
      unconditional acceptance rate of draft position ``position + 1``;
    * ``dflash_spec_policy_step_seconds{batch_bucket, drafts}``: EMA of verify + draft seconds
      per step at that batch-size bucket and largest block;
    * ``dflash_spec_policy_overhead_seconds``: EMA of each decode cycle's seconds outside
      verify and draft (added to every candidate's cost);
    * ``dflash_spec_policy_tree_tokens{drafter_version, budget}``: EMA of the tokens one tree
      step of ``budget`` nodes commits (bonus included; the value adaptive gives that tree);
    * ``dflash_spec_policy_accuracy``: committed / expected drafted tokens of recent
      speculative adaptive steps (the factor on every expected gain);
    * ``dflash_spec_policy_hybrid_factor{drafter_version}``: realized / predicted gain of the
      suffix candidates in recent hybrid trees (the factor on every predicted suffix gain);
    * ``dflash_spec_policy_race_tokens_per_second{batch_bucket, arm}``: the mode race's
      estimate of each arm (``verifier_svc/mode_race.py``), and
      ``dflash_spec_policy_race_leader{batch_bucket, arm}`` 1 for each bucket's leader;
    * ``dflash_spec_policy_race_steps_total{arm}``, ``..._race_explored_steps_total``,
      ``..._race_explored_seconds_total``, ``..._race_seconds_total`` and the gauge
      ``..._race_explore_cost_tokens``: the steps the race chose, those that explored,
      their seconds, and the tokens exploring cost against each bucket's best arm;
    * ``dflash_verifier_batch_sessions``: sessions in the decode batch now.
    """

    def __init__(self, registry: CollectorRegistry, engine: Callable[[], object]):
        self.engine = engine
        registry.register(self)

    def describe(self):
        return []

    @staticmethod
    def _race(race):
        est = GaugeMetricFamily("dflash_spec_policy_race_tokens_per_second",
                                "Mode race: measured tokens/s of each arm per batch bucket.",
                                labels=["batch_bucket", "arm"])
        lead = GaugeMetricFamily("dflash_spec_policy_race_leader",
                                 "Mode race: 1 for each batch bucket's leading arm.",
                                 labels=["batch_bucket", "arm"])
        for b in sorted(list(race.buckets)):
            for arm, v in race.estimates(b).items():
                est.add_metric([str(b), arm], v)
            if (leader := race.leader(b)) is not None:
                lead.add_metric([str(b), leader], 1.0)
        yield est
        yield lead
        st = race.stats
        steps = CounterMetricFamily("dflash_spec_policy_race_steps",
                                    "Mode race: adaptive steps per arm played.", labels=["arm"])
        for arm, n in sorted(list(st.steps.items())):
            steps.add_metric([arm], n)
        yield steps
        for c, v in ((CounterMetricFamily("dflash_spec_policy_race_explored_steps",
                                          "Mode race: steps that explored (not the leader)."),
                      st.explored_steps),
                     (CounterMetricFamily("dflash_spec_policy_race_explored_seconds",
                                          "Mode race: seconds of the steps that explored."),
                      st.explored_seconds),
                     (CounterMetricFamily("dflash_spec_policy_race_seconds",
                                          "Mode race: seconds of every raced step."), st.total_seconds)):
            c.add_metric([], v)
            yield c
        # a gauge: exploring can pay (negative cost) when the best arm's rate is stale
        cost = GaugeMetricFamily("dflash_spec_policy_race_explore_cost_tokens",
                                 "Mode race: tokens exploring cost against the best arm on the same text, so far.")
        cost.add_metric([], st.explore_cost_tokens)
        yield cost

    def collect(self):
        e = self.engine()
        policy = getattr(e, "policy", None)
        if policy is None:
            return
        rates = GaugeMetricFamily("dflash_spec_policy_acceptance_rate",
                                  "EMA unconditional acceptance rate per draft position (policy input).",
                                  labels=[V, "position"])
        for label, rs in policy.acceptance_table().items():
            for i, r in enumerate(rs):
                rates.add_metric([label, str(i)], r)
        yield rates
        cost = GaugeMetricFamily("dflash_spec_policy_step_seconds",
                                 "EMA verify + draft seconds per step (policy input).",
                                 labels=["batch_bucket", "drafts"])
        for (b, k), sec in policy.cost_table().items():
            cost.add_metric([str(b), str(k)], sec)
        yield cost
        over = GaugeMetricFamily("dflash_spec_policy_overhead_seconds",
                                 "EMA seconds per decode cycle outside verify and draft (policy input).")
        over.add_metric([], policy.overhead_seconds)
        yield over
        trees = GaugeMetricFamily("dflash_spec_policy_tree_tokens",
                                  "EMA tokens committed per tree step of a node budget (policy input).",
                                  labels=[V, "budget"])
        for (label, budget), tokens in policy.acceptance.tree_table().items():
            trees.add_metric([label, str(budget)], tokens)
        yield trees
        acc = GaugeMetricFamily("dflash_spec_policy_accuracy",
                                "Committed / expected drafted tokens of recent speculative adaptive "
                                "steps (policy input).")
        acc.add_metric([], policy.accuracy)
        yield acc
        hyb = GaugeMetricFamily("dflash_spec_policy_hybrid_factor",
                                "Realized / predicted gain of the suffix candidates in recent hybrid "
                                "trees (policy input).", labels=[V])
        for label, f in policy.acceptance.hybrid_table().items():
            hyb.add_metric([label], f)
        yield hyb
        if getattr(policy, "race", None) is not None:
            yield from self._race(policy.race)
        g = GaugeMetricFamily("dflash_verifier_batch_sessions", "Sessions in the decode batch now.")
        g.add_metric([], float(e.scheduler.batch_size))
        yield g


class AdmissionMetrics:
    """The verifier's admission control (``verifier_svc.scheduler.Admission``):

    * ``dflash_verifier_waiting_requests``: requests admitted and not in the batch yet (vLLM's
      ``num_requests_waiting``), and ``dflash_verifier_waiting_prompt_tokens``, their prompt
      tokens not prefilled yet, read at scrape time from ``engine().scheduler``;
    * ``dflash_verifier_queue_wait_seconds``: admission to first prefill chunk, per request
      (``observe_queue_wait``, a ``Scheduler.queue_wait_listeners`` entry);
    * ``dflash_verifier_rejected_requests_total{reason}``: requests refused with
      RESOURCE_EXHAUSTED (``max_waiting``, ``max_waiting_tokens``).
    """

    def __init__(self, registry: CollectorRegistry, engine: Callable[[], object]):
        self.engine = engine
        self.queue_wait = Histogram("dflash_verifier_queue_wait_seconds",
                                    "Seconds from admission to the first prefill chunk.",
                                    buckets=SECONDS, registry=registry)
        registry.register(self)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def describe(self):
        return []

    def collect(self):
        e = self.engine()
        scheduler = getattr(e, "scheduler", None)
        if scheduler is None:
            return
        g = GaugeMetricFamily("dflash_verifier_waiting_requests",
                              "Requests admitted and waiting for a batch slot or their prefill.")
        g.add_metric([], float(scheduler.waiting))
        yield g
        g = GaugeMetricFamily("dflash_verifier_waiting_prompt_tokens",
                              "Prompt tokens of waiting requests not prefilled yet.")
        g.add_metric([], float(scheduler.waiting_tokens))
        yield g
        c = CounterMetricFamily("dflash_verifier_rejected_requests",
                                "Requests refused by admission control (RESOURCE_EXHAUSTED).",
                                labels=["reason"])
        for reason, n in sorted(scheduler.refused.items()):
            c.add_metric([reason], float(n))
        yield c


# The Model Server Protocol (Gateway API Inference Extension, proposal 003): the gauges an
# inference-aware router scores a model server by, under vLLM's names. name -> (LoadReport field, help)
MODEL_SERVER_GAUGES = {
    "vllm:num_requests_waiting": ("waiting", "Requests admitted and waiting for a batch slot or "
                                  "their prefill (as vLLM's)."),
    "vllm:num_requests_running": ("running", "Requests in the decode batch (as vLLM's)."),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", "Fraction of the batch's K/V room its "
                                 "requests may hold, 0..1 (prompt + max_tokens each over "
                                 "max_batch x the context window; as vLLM's, 1 = full)."),
}


class ModelServerGauges:
    """The Model Server Protocol's gauges (:data:`MODEL_SERVER_GAUGES`), read at scrape time
    from ``load()`` (a ``dflash.v1.verifier_pb2.LoadReport``, or None while loading: no
    series), so the GIE endpoint picker and llm-d's router can score this replica."""

    def __init__(self, registry: CollectorRegistry, load: Callable[[], object | None]):
        self.load = load
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        report = self.load()
        if report is None:
            return
        for name, (field, text) in MODEL_SERVER_GAUGES.items():
            g = GaugeMetricFamily(name, text)
            g.add_metric([], float(getattr(report, field)))
            yield g


class BreakerGauges:
    """Each drafter's circuit breaker and deadline, read at scrape time from ``proposers()``
    (objects with ``card.label``, ``address``, ``breaker``, ``latency`` and
    ``last_deadline_s``: ``verifier_svc.drafter_client.RemoteProposer``), labelled
    ``drafter_version`` and ``address``:

    * ``dflash_spec_decode_drafter_circuit_open``: 1 while the breaker keeps the drafter out of
      the step path, else 0;
    * ``dflash_spec_decode_drafter_circuit_trips_total{reason}``: times it opened, by reason
      (``slow``: later than speculating was worth; ``failing``: past ``--draft-timeout``,
      errors, the stream down);
    * ``dflash_spec_decode_drafter_latency_seconds``: EMA of its answered draft calls' round
      trips (late replies included);
    * ``dflash_spec_decode_drafter_deadline_seconds``: how long its last draft call could wait.
    """

    REASONS = ("slow", "failing")

    def __init__(self, registry: CollectorRegistry, proposers: Callable[[], list]):
        self.proposers = proposers
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        labels = [V, "address"]
        g = GaugeMetricFamily("dflash_spec_decode_drafter_circuit_open",
                              "1 while the drafter is out of the step path (circuit breaker open).",
                              labels=labels)
        c = CounterMetricFamily("dflash_spec_decode_drafter_circuit_trips",
                                "Times the drafter's circuit breaker opened, by reason.",
                                labels=labels + ["reason"])
        lat = GaugeMetricFamily("dflash_spec_decode_drafter_latency_seconds",
                                "EMA round trip of the drafter's answered draft calls.", labels=labels)
        dl = GaugeMetricFamily("dflash_spec_decode_drafter_deadline_seconds",
                               "Seconds the drafter's last draft call could wait (what speculating "
                               "was worth, floored, capped by --draft-timeout).", labels=labels)
        for p in self.proposers():
            key = [p.card.label, p.address]
            g.add_metric(key, 1.0 if p.breaker.is_open else 0.0)
            for reason in self.REASONS:
                c.add_metric(key + [reason], float(p.breaker.trips_by_reason.get(reason, 0)))
            lat.add_metric(key, p.latency.value)
            dl.add_metric(key, p.last_deadline_s)
        yield g
        yield c
        yield lat
        yield dl


class RoutedRequests:
    """``dflash_gateway_routed_requests_total{verifier}``: requests the gateway sent to each
    verifier replica (a retry or a resume counts again, where it went), read at scrape time
    from ``routed()`` (address -> count: ``gateway.replicas.ReplicaSet.routed_counts``). How
    the router splits the load, and that a drained replica gets nothing new."""

    def __init__(self, registry: CollectorRegistry, routed: Callable[[], dict[str, int]]):
        self.routed = routed
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        c = CounterMetricFamily("dflash_gateway_routed_requests",
                                "Requests sent to each verifier replica (retries and resumes "
                                "included).", labels=["verifier"])
        for address, n in sorted(self.routed().items()):
            c.add_metric([address], float(n))
        yield c


class ResentAnswersSpliced:
    """``dflash_gateway_resent_answers_spliced_total``: chat requests whose prompt ids began
    with a remembered turn's (the ids the target generated for a resent answer;
    ``gateway.resent``), read at scrape time from ``spliced()``."""

    def __init__(self, registry: CollectorRegistry, spliced: Callable[[], int]):
        self.spliced = spliced
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        c = CounterMetricFamily("dflash_gateway_resent_answers_spliced",
                                "Chat requests tokenized from a remembered answer's ids.")
        c.add_metric([], float(self.spliced()))
        yield c


class GatewayMetrics:
    """Per request, as the gateway's client sees it."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter("dflash_requests", "Finished requests.", [V, "finish_reason"], registry=r)
        self.ttft = Histogram("dflash_request_ttft_seconds", "Time to first token.", [V],
                              buckets=SECONDS, registry=r)
        self.itl = Histogram("dflash_request_inter_token_latency_seconds",
                             "Inter-token latency: gap between streamed chunks / tokens in the chunk "
                             "(observed once per token).", [V], buckets=SECONDS, registry=r)
        self.e2e = Histogram("dflash_request_e2e_seconds", "End-to-end request latency.", [V],
                             buckets=SECONDS, registry=r)
        self.tau = Histogram("dflash_request_acceptance_length",
                             "Per-request mean acceptance length tau (requests with drafts).", [V],
                             buckets=TAU_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dflash_request_prompt_tokens", "Prompt tokens.", [V], registry=r)
        self.completion_tokens = Counter("dflash_request_completion_tokens", "Completion tokens.",
                                         [V], registry=r)
        self.running = Gauge("dflash_gateway_running_requests", "Requests streaming now.", registry=r)


class DrafterMetrics:
    """Per draft batch on the Draft stream."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.batch_seconds = Histogram("dflash_drafter_batch_seconds",
                                       "Drafter compute per DraftBatch.", [V], buckets=SECONDS, registry=r)
        self.items = Counter("dflash_drafter_items", "Draft items (one session-step each).", [V],
                             registry=r)
        self.errors = Counter("dflash_drafter_errors", "Draft items answered with an error.",
                              [V, "reason"], registry=r)
        self.context_bytes = Counter("dflash_drafter_context_bytes",
                                     "Hidden-state bytes received.", [V], registry=r)


class SessionGauges:
    """``<prefix>_active_sessions`` and ``<prefix>_cached_tokens`` read from an engine at scrape.

    ``engine()`` returns the current engine or None (still loading); engines without
    ``num_sessions`` / ``cached_tokens`` (test doubles) read as 0.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str, engine: Callable[[], object],
                 label: Callable[[object], str] | None = None,
                 extra: tuple[tuple[str, str, str], ...] = ()):
        self.prefix = prefix
        self.engine = engine
        self.label = label
        self.gauges = (("active_sessions", "num_sessions", "Sessions holding state."),
                       ("cached_tokens", "cached_tokens", "Context positions held for sessions."),
                       *extra)
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        e = self.engine()
        if e is None:
            return
        labels, values = ([V], [self.label(e)]) if self.label else ([], [])
        for name, attr, doc in self.gauges:
            g = GaugeMetricFamily(f"{self.prefix}_{name}", doc, labels=labels)
            g.add_metric(values, float(getattr(e, attr, 0) or 0))
            yield g
