"""The one table from what the Generate core raises to gRPC status codes and HTTP statuses.

The core (:meth:`gateway.servicer.GatewayServicer.stream`) raises :class:`InvalidParam`,
:class:`NotOwner` or :class:`UpstreamError` (the verifier's status passed on); the gRPC servicer
aborts with :func:`grpc_status`, the HTTP front answers with :func:`http_status` and OpenAI's
error shape ``{"error": {"message", "type", "param", "code"}}`` (:func:`openai_error`).
"""

from __future__ import annotations

import dataclasses
import re

import grpc

from dflash.core.errors import FieldFault
from dflash.core.sampling import InvalidParam
from gateway.auth import AuthError
from gateway.inputs import NotOwner

RETRY_AFTER = "retry-after-ms"      # the verifier's admission hint, passed on to the client


@dataclasses.dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    type: str       # OpenAI's error.type
    code: str       # OpenAI's error.code


# gRPC code -> HTTP status and OpenAI error type/code. Codes absent here are 500 server_error.
TABLE = {s.grpc: s for s in (
    Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_value"),
    Status(grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error", "failed_precondition"),
    Status(grpc.StatusCode.OUT_OF_RANGE, 400, "invalid_request_error", "invalid_value"),
    Status(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "invalid_api_key"),
    Status(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error", "permission_denied"),
    Status(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", "not_found"),
    Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    Status(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "service_unavailable"),
    Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "timeout"),
)}
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error")
# The verifier's codes passed on as they are; any other verifier failure is UNAVAILABLE.
PASSTHROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class UpstreamError(Exception):
    """The verifier refused or failed a request: its code (:data:`PASSTHROUGH`, else
    UNAVAILABLE), details and admission hint (``retry-after-ms``, None when it gave none)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int | None = None):
        super().__init__(details)
        self.code, self.details, self.retry_after_ms = code, details, retry_after_ms

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> "UpstreamError":
        code = e.code() if e.code() in PASSTHROUGH else grpc.StatusCode.UNAVAILABLE
        hint = next((v for k, v in (e.trailing_metadata() or ()) if k == RETRY_AFTER), None)
        try:
            ms = int(hint) if hint is not None else None
        except ValueError:
            ms = None
        return cls(code, f"verifier: {e.details()}", ms)


def grpc_code(e: BaseException) -> grpc.StatusCode:
    """The gRPC status code of a core exception (INTERNAL for anything unexpected)."""
    if isinstance(e, NotOwner):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(e, FieldFault):          # InvalidParam, the other field errors, preconditions
        return grpc.StatusCode[e.status]
    if isinstance(e, (UpstreamError, AuthError)):
        return e.code
    return grpc.StatusCode.INTERNAL


def status_of(e: BaseException) -> Status:
    return TABLE.get(grpc_code(e), INTERNAL)


def http_status(e: BaseException) -> int:
    return status_of(e).http


def retry_after_ms(e: BaseException) -> int | None:
    """The ``retry-after-ms`` hint of a refusal (the two exceptions that carry one), else None."""
    return e.retry_after_ms if isinstance(e, (UpstreamError, AuthError)) else None


def openai_error(message: str, status: Status, param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": status.type, "param": param,
                      "code": code or status.code}}


# fields the verifier names, as the gateway's request calls them
VERIFIER_FIELDS = {"speculation.mode": "speculation_mode", "speculation.tree_budget": "tree_budget",
                   "prompt_token_ids": "prompt"}
_FIELD = re.compile(r"verifier: ([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


def error_body(e: BaseException) -> dict:
    """OpenAI's error body for a core exception; ``param`` is the field a FieldFault names (or
    that the verifier's INVALID_ARGUMENT names)."""
    s = status_of(e)
    param = e.field if isinstance(e, FieldFault) else None
    if isinstance(e, UpstreamError) and e.code == grpc.StatusCode.INVALID_ARGUMENT:
        m = _FIELD.match(e.details)
        param = VERIFIER_FIELDS.get(m.group(1), m.group(1)) if m else None
    message = str(e) if s is not INTERNAL else "internal error"
    return openai_error(message, s, param)


__all__ = ["AuthError", "InvalidParam", "NotOwner", "Status", "TABLE", "UpstreamError",
           "error_body", "grpc_code", "http_status", "openai_error", "retry_after_ms",
           "status_of"]
