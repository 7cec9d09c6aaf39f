"""A drafter's refusal crosses the wire as a DraftErrorCode; the verifier reads the code, never
the message."""

from __future__ import annotations

import pytest

from dflash.core.convert import DRAFT_ERROR, draft_error_from_proto, draft_error_to_proto
from dflash.core.proposer import DraftError
from dflash.v1 import drafter_pb2


@pytest.mark.parametrize("reason", sorted(DRAFT_ERROR))
def test_each_reason_round_trips_through_its_code(reason):
    r = draft_error_to_proto("s", DraftError(reason, "details here"))
    assert r.error_code == DRAFT_ERROR[reason] != drafter_pb2.DRAFT_ERROR_UNSPECIFIED
    back = draft_error_from_proto(r)
    assert back.reason == reason and "details here" in str(back)


def test_the_message_is_never_parsed_for_a_reason():
    # an old drafter's "reason: message" text without a code is an unnamed error
    old = drafter_pb2.DraftResult(session_id="s", error="context_gap: have 3 positions")
    assert draft_error_from_proto(old).reason == "error"
    # the code decides, whatever the text says
    r = drafter_pb2.DraftResult(session_id="s", error="bad_request: no",
                                error_code=drafter_pb2.DRAFT_ERROR_CONTEXT_GAP)
    assert draft_error_from_proto(r).reason == "context_gap"


def test_reasons_without_a_code_are_internal_and_success_is_none():
    r = draft_error_to_proto("s", DraftError("exception", "boom"))
    assert r.error_code == drafter_pb2.DRAFT_ERROR_INTERNAL
    assert draft_error_from_proto(r).reason == "internal"
    unknown = drafter_pb2.DraftResult(session_id="s", error="x", error_code=99)
    assert draft_error_from_proto(unknown).reason == "internal"
    assert draft_error_from_proto(drafter_pb2.DraftResult(session_id="s", tokens=[1])) is None
