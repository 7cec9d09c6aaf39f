"""Drafter circuit breaker: a drafter that keeps missing its deadline is taken out of the step
path (steps stop waiting for it, output unchanged), probed in the background, and used again
once it answers in time."""

from __future__ import annotations

import statistics
import time

from prometheus_client import CollectorRegistry

from conftest import generate_ids
from dflash.metrics import BreakerGauges
from dflash.v1 import verifier_pb2
from doubles import ReferenceDrafter
from verifier_svc.drafter_client import BreakerConfig, CircuitBreaker
from verifier_svc.servicer import DrafterPool

B = 4
DEADLINE_S = 0.2
SLOW_S = 0.5            # past the deadline
N = 60
PROMPT = [3, 14, 15, 92, 65]


def test_breaker_opens_after_k_consecutive_failures_and_success_resets():
    b = CircuitBreaker(3)
    assert not b.failure() and not b.failure()
    b.success()
    assert not b.failure() and not b.failure() and not b.is_open
    assert b.failure() and b.is_open and b.trips == 1
    assert not b.failure()          # already open: one trip
    assert b.close() >= 0 and not b.is_open and b.consecutive == 0
    never = CircuitBreaker(0)
    assert not any(never.failure() for _ in range(10)) and not never.is_open


def test_breaker_config_is_checked():
    import pytest

    with pytest.raises(ValueError, match="failures"):
        BreakerConfig(failures=-1)
    with pytest.raises(ValueError, match="probe_interval_s"):
        BreakerConfig(probe_interval_s=0)


class SlowDrafter:
    """The oracle, sleeping ``delay`` seconds before each batch it answers."""

    def __init__(self, inner: ReferenceDrafter):
        self.inner, self.card = inner, inner.card
        self.delay = 0.0

    def propose(self, requests):
        if self.delay:
            time.sleep(self.delay)
        return self.inner.propose(requests)

    def release(self, ids):
        self.inner.release(ids)


def timed_generate(stub, prompt, session, spec):
    """(token ids, last chunk, arrival time of each chunk)."""
    req = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=prompt, max_tokens=N, ignore_eos=True,
                                               session_id=session, speculation=spec)
    ids, last, times = [], None, []
    for chunk in stub.Generate(req):
        times.append(time.perf_counter())
        ids += list(chunk.token_ids)
        last = chunk
    return ids, last, times


def gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def test_slow_drafter_trips_the_breaker_output_unchanged_and_speculation_resumes(stack, target_model):
    v = stack.verifier_stub()
    off_ids, _ = generate_ids(v, PROMPT, max_tokens=N, ignore_eos=True)
    _, _, off_times = timed_generate(v, PROMPT, "off", verifier_pb2.SpeculationParams())
    off_itl = statistics.median(gaps(off_times))
    refs = {s: PROMPT + off_ids for s in ("slow", "back")}
    drafter = SlowDrafter(ReferenceDrafter(target_model, refs, block_size=B))
    addr = stack.add_drafter(drafter, label="slow@1")
    pool = DrafterPool(stack.engine, timeout_s=DEADLINE_S,
                       breaker=BreakerConfig(failures=3, probe_interval_s=0.2))
    stack.verifier.servicer.pool = pool
    spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr)
    proposer = pool.get(addr)
    registry = CollectorRegistry()
    BreakerGauges(registry, pool.proposers)
    labels = {"drafter_version": proposer.card.label, "address": addr}
    try:
        drafter.delay = SLOW_S
        t0 = time.perf_counter()
        ids, last, times = timed_generate(v, PROMPT, "slow", spec)
        assert ids == off_ids                     # lossless: identical to speculation off
        assert proposer.breaker.is_open and proposer.breaker.trips == 1
        assert registry.get_sample_value("dflash_spec_decode_drafter_circuit_open", labels) == 1
        assert last.stats.fallback_steps == N - 1 - 1   # every step with room for a draft
        assert last.stats.drafts == 0
        g = gaps(times)
        waited = [i for i, x in enumerate(g) if x >= DEADLINE_S * 0.9]
        assert waited == [0, 1, 2], [round(x, 3) for x in g]   # only the 3 misses waited
        after = g[3:]
        trip_s = times[3] - t0
        print(f"breaker tripped {trip_s:.2f}s into the request; ITL after the trip: median "
              f"{1e3 * statistics.median(after):.2f} ms, max {1e3 * max(after):.2f} ms; "
              f"speculation off: median {1e3 * off_itl:.2f} ms")
        assert max(after) < DEADLINE_S                 # no step waited for the open breaker
        assert statistics.median(after) <= 2 * off_itl + 0.002

        drafter.delay = 0.0                            # the drafter recovers
        deadline = time.monotonic() + 20
        while proposer.breaker.is_open:
            assert time.monotonic() < deadline, "breaker did not close within 20 s"
            time.sleep(0.02)
        assert registry.get_sample_value("dflash_spec_decode_drafter_circuit_open", labels) == 0
        ids, last, _ = timed_generate(v, PROMPT, "back", spec)
        assert ids == off_ids
        assert last.stats.drafts > 0 and last.stats.fallback_steps == 0
        assert last.stats.mean_acceptance_length > 1.0
    finally:
        pool.close()
