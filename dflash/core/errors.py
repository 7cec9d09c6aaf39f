"""One error shape for everything that names the field at fault.

:class:`FieldFault` carries ``field`` (a dotted path) and a message that starts with it, and
names the gRPC status it maps to (``status``, a ``grpc.StatusCode`` member name: this module
imports no grpc), so every service maps each kind through the same lookup,
``grpc.StatusCode[e.status]``:

* :class:`FieldError` (a ``ValueError``): the value is missing or invalid -> INVALID_ARGUMENT.
* :class:`PreconditionError` (a ``RuntimeError``, never a ``ValueError``, so no ``except
  ValueError`` turns it into INVALID_ARGUMENT): the value is well formed but does not fit this
  deployment (a drafter for another target, a session already generating) ->
  FAILED_PRECONDITION.
"""

from __future__ import annotations

from typing import ClassVar


class FieldFault(Exception):
    """``field`` is at fault; ``str(e)`` is ``"<field>: <message>"``. Subclasses set
    ``status``."""

    status: ClassVar[str] = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class FieldError(FieldFault, ValueError):
    """``field`` (a dotted path) is missing or invalid; maps to INVALID_ARGUMENT."""

    status: ClassVar[str] = "INVALID_ARGUMENT"


class PreconditionError(FieldFault, RuntimeError):
    """``field`` is valid but does not fit this target or deployment; maps to
    FAILED_PRECONDITION."""

    status: ClassVar[str] = "FAILED_PRECONDITION"
