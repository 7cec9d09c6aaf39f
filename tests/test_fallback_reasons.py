"""Fallback reasons are one StrEnum whose values are Prometheus label values
(``dflash_spec_decode_fallback_steps_total{reason}``) and span attributes: pinned here, distinct,
and apart from the breaker's trip reasons (docs/observability.md)."""

from __future__ import annotations

from dflash.core.proposer import FallbackReason
from verifier_svc.breaker import TripReason
from verifier_svc.drafter_sync import LATE

REASONS = {
    "BAD_REQUEST": "bad_request", "CONTEXT_GAP": "context_gap", "NO_CONTEXT": "no_context",
    "PREFIX_MISS": "prefix_miss",
    "INTERNAL": "internal", "ERROR": "error", "TIMEOUT": "timeout", "LATE": "late",
    "UNAVAILABLE": "unavailable", "CIRCUIT_OPEN": "circuit_open", "EXCEPTION": "exception",
    "MALFORMED_BLOCK": "malformed_block", "OUT_OF_VOCAB": "out_of_vocab",
    "MALFORMED_PROBS": "malformed_probs", "MALFORMED_TOPK": "malformed_topk",
}


def test_fallback_reasons_are_pinned_and_distinct():
    assert {r.name: r.value for r in FallbackReason} == REASONS
    assert len(set(REASONS.values())) == len(REASONS)


def test_a_late_draft_is_not_a_slow_breaker():
    # "slow" named both (drafter_sync's late draft, the breaker's budget trips): two labels now
    assert LATE is FallbackReason.LATE and LATE == "late"
    assert {r.value for r in TripReason} == {"slow", "failing"}
    assert f"{FallbackReason.LATE}" == "late"        # what a metric label or log line shows
