"""The shared vocabularies: one field-error shape (``dflash.core.errors``) mapped to one gRPC
status per kind, in the verifier's servicer and the gateway's table alike; the speculation
modes and finish reasons as named constants with their wire values. Unit tests, no sockets."""

from __future__ import annotations

import json

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from dflash.core import errors, finish, speculation
from dflash.core.convert import FINISH, FINISH_NAME
from dflash.core.sampling import InvalidParam
from dflash.v1 import common_pb2, verifier_pb2
from gateway.inputs import NotOwner
from gateway.status import error_body, grpc_code
from verifier_svc import request
from verifier_svc.engine import VerifierEngine
from verifier_svc.servicer import VerifierServicer

from doubles import TargetDouble


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.ServicerContext`` the Generate path touches before streaming."""

    def abort(self, code, details):
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, md) -> None:
        pass

    def auth_context(self) -> dict:
        return {}           # a plaintext connection: no client certificate


def _servicer() -> VerifierServicer:
    # every request here is refused before the engine runs anything: a table target never forwards
    return VerifierServicer(VerifierEngine(TargetDouble(vocab_size=64)), None, require_registered=True)


def _aborted(m: verifier_pb2.VerifierGenerateRequest) -> _Aborted:
    with pytest.raises(_Aborted) as ei:
        list(_servicer().Generate(m, _Context()))
    return ei.value


def test_both_kinds_share_the_field_shape():
    for cls in (errors.FieldError, errors.PreconditionError, InvalidParam):
        e = cls("speculation.mode", "no such mode")
        assert isinstance(e, errors.FieldFault)
        assert e.field == "speculation.mode"
        assert str(e) == "speculation.mode: no such mode"
    assert request.PreconditionError is errors.PreconditionError   # one class, two import paths


def test_a_precondition_is_never_a_value_error():
    """An ``except ValueError`` (INVALID_ARGUMENT paths) must let a precondition through."""
    assert not issubclass(errors.PreconditionError, ValueError)
    with pytest.raises(errors.PreconditionError):
        try:
            raise errors.PreconditionError("hidden_size", "drafter has 64, target has 576")
        except ValueError:
            pytest.fail("a PreconditionError was caught as a ValueError")


def test_gateway_table_maps_each_kind():
    assert grpc_code(InvalidParam("top_p", "bad")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_code(errors.PreconditionError("session_id", "busy")) == grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_code(NotOwner("session_id", "belongs to another client")) == grpc.StatusCode.PERMISSION_DENIED
    body = error_body(errors.PreconditionError("session_id", "busy"))["error"]
    assert (body["param"], body["code"]) == ("session_id", "failed_precondition")
    body = error_body(InvalidParam("top_p", "bad"))["error"]
    assert (body["param"], body["code"]) == ("top_p", "invalid_value")


def test_verifier_maps_invalid_and_precondition():
    spec = verifier_pb2.SpeculationParams(enabled=True)
    e = _aborted(verifier_pb2.VerifierGenerateRequest(prompt_token_ids=[1], max_tokens=1, speculation=spec))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details.startswith("speculation.drafter_address: ")
    spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address="127.0.0.1:1")
    e = _aborted(verifier_pb2.VerifierGenerateRequest(prompt_token_ids=[1], max_tokens=1, speculation=spec))
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION      # not registered through CheckDrafter
    assert e.details.startswith("speculation.drafter_address: ")


def test_mode_constants_keep_their_wire_values():
    assert speculation.MODES == ("off", "fixed", "adaptive", "tree", "suffix", "hybrid")
    assert [m.value for m in speculation.SpecMode] == list(speculation.MODES)
    # a member is its wire string wherever it goes: compared, formatted, in JSON
    assert speculation.SpecMode("tree") is speculation.SpecMode.TREE == "tree"
    assert f"{speculation.SpecMode.HYBRID}" == str(speculation.SpecMode.HYBRID) == "hybrid"
    assert json.dumps({speculation.SpecMode.OFF: [speculation.SpecMode.SUFFIX]}) == '{"off": ["suffix"]}'
    # ... on the wire (the gateway sets a member into SpeculationParams.mode) and in a label
    wire = verifier_pb2.SpeculationParams(mode=speculation.SpecMode.OFF).SerializeToString()
    assert wire == verifier_pb2.SpeculationParams(mode="off").SerializeToString()
    registry = CollectorRegistry()
    Counter("steps", "steps by mode", ["mode"], registry=registry).labels(speculation.SpecMode.ADAPTIVE).inc()
    assert 'steps_total{mode="adaptive"} 1.0' in generate_latest(registry).decode()
    assert set(speculation.TREE_MODES) == {"tree", "adaptive", "suffix", "hybrid"}
    assert set(speculation.SUFFIX_MODES) == {"suffix", "hybrid", "adaptive"}


def test_the_other_vocabularies_keep_their_values():
    # metric labels, span attributes, capture-file metadata and log lines carry these strings
    from dflash.learn.gate import METRICS, GateMetric
    from dflash.learn.store import SPLITS, Split, split_of
    from verifier_svc.acceptance import ARM_FAMILIES, Family
    from verifier_svc.decision import StepMode
    from verifier_svc.suffix_drafts import DraftSource

    assert ARM_FAMILIES == ("chain", "tree", "suffix") and Family("tree") is Family.TREE
    assert StepMode.MIXED == "mixed"
    assert METRICS == ("served", "teacher_forced") and GateMetric("served") is GateMetric.SERVED
    assert SPLITS == ("train", "heldout") and [split_of(s) for s in (0, 1, 20)] == ["heldout", "train", "heldout"]
    assert split_of(7) is Split.TRAIN
    # a node's sources are bits: several may propose one node, the root has none
    assert (DraftSource.DRAFTER, DraftSource.SUFFIX, DraftSource.GRAMMAR) == (1, 2, 4)
    both = DraftSource(0) | DraftSource.DRAFTER | DraftSource.SUFFIX
    assert both == 3 and both & DraftSource.SUFFIX and not both & DraftSource.GRAMMAR


def test_finish_reasons_and_the_wire_table_agree():
    assert finish.FINISH_REASONS == ("length", "stop", "cancelled")
    assert set(FINISH) - {None} == set(finish.FINISH_REASONS)
    assert FINISH[finish.FINISH_STOP] == common_pb2.FINISH_REASON_STOP
    assert FINISH[finish.FINISH_LENGTH] == common_pb2.FINISH_REASON_LENGTH
    assert FINISH[finish.FINISH_CANCELLED] == common_pb2.FINISH_REASON_CANCELLED
    assert all(FINISH_NAME[FINISH[r]] == r for r in finish.FINISH_REASONS)
