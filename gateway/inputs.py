"""The gateway's input checks that run before tokenisation: bounds (:class:`InputLimits`),
session ids, the client's identity (session ownership), and :class:`DecodeGuard` (a request
protobuf cannot parse, e.g. invalid UTF-8, becomes INVALID_ARGUMENT naming the field). Errors
quote at most :data:`ECHO_CHARS` characters of a value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError

from dflash.core.errors import FieldError
from dflash.core.sampling import InvalidParam
from gateway.peers import address_identity, peer_identity

ROLES = ("system", "user", "assistant", "tool")
SESSION_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]+")
CLIENT_KEY = "x-dflash-client"      # metadata naming the client until API keys exist
MAX_CLIENT_CHARS = 128
ECHO_CHARS = 32                     # an error quotes at most this much of a bad value


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputLimits:
    """Bounds on a Generate request, checked before tokenisation. The defaults are far above
    what a normal client sends; ``gateway/server.py`` exposes each as a flag."""

    max_prompt_chars: int = 1_000_000     # the prompt, or all chat contents together
    max_chat_messages: int = 1024
    max_stop_strings: int = 64
    max_stop_chars: int = 256             # per stop string
    max_stop_token_ids: int = 256
    max_session_id_chars: int = 128       # of [A-Za-z0-9._:-]
    max_name_chars: int = 256             # drafter ("name@version")
    max_n: int = 16                       # samples of one request (each its own verifier stream)


class NotOwner(FieldError):
    """The session belongs to another client; maps to PERMISSION_DENIED."""


def short(value: str) -> str:
    """``value`` quoted for an error message: at most ECHO_CHARS characters, then its length."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def client_identity(context) -> str:
    """Who is calling: metadata ``x-dflash-client`` if present, else the peer address without
    its port in one form per address (``gateway.peers.peer_identity``: ``ipv4:127.0.0.1``,
    ``ipv6:::1``), the form :func:`http_identity` gives the same client, so a session is its
    owner's on both ports. Raises InvalidParam for an over-long client name."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_KEY:
            if not value or len(value) > MAX_CLIENT_CHARS:
                raise InvalidParam(CLIENT_KEY, f"must be 1 to {MAX_CLIENT_CHARS} characters")
            return f"client:{value}"    # its own namespace: a name cannot pose as an address
    return peer_identity(context.peer() or "")


def http_identity(headers, host: str) -> str:
    """:func:`client_identity` for an HTTP request: header ``x-dflash-client`` if present,
    else the client's address (``gateway.peers.address_identity``: ``ipv4:127.0.0.1``,
    ``ipv6:::1``, an IPv4-mapped address as its IPv4 one), the form :func:`client_identity`
    gives the same client over gRPC, so one client owns its sessions on both ports. Raises
    InvalidParam for an over-long client name."""
    value = headers.get(CLIENT_KEY)
    if value is not None:
        if not value or len(value) > MAX_CLIENT_CHARS:
            raise InvalidParam(CLIENT_KEY, f"must be 1 to {MAX_CLIENT_CHARS} characters")
        return f"client:{value}"
    return address_identity(host)


#: Characters :func:`verifier_session_id` adds to a client's session_id (the verifier allows 1024).
OWNER_PREFIX_CHARS = 17


def verifier_session_id(owner: str, session_id: str) -> str:
    """The verifier's id for ``owner``'s session ``session_id``: 16 hex digits of the owner's
    sha256, ``:``, the session_id (``""`` stays ``""``, a one-shot request).

    The verifier's sessions are shared by every gateway in front of it, and a gateway knows
    only the sessions it served, so ownership is carried in the id itself: a client can only
    ever name verifier state under its own prefix, whichever replica it reaches (another
    client's ``xg1`` is another session). Each replica derives the same id for the same client.
    """
    if not session_id:
        return ""
    return f"{hashlib.sha256(owner.encode()).hexdigest()[:16]}:{session_id}"


def check_session_id(session_id: str, limit: int) -> None:
    """Raises InvalidParam("session_id") unless it is 1..``limit`` chars of [A-Za-z0-9._:-]."""
    if len(session_id) > limit:
        raise InvalidParam("session_id", f"{len(session_id)} characters, more than {limit}")
    if not SESSION_ID_CHARS.fullmatch(session_id):
        raise InvalidParam("session_id", f"{short(session_id)}: use only A-Z a-z 0-9 . _ : -")


class DecodeGuard(grpc.ServerInterceptor):
    """A request protobuf cannot parse gets INVALID_ARGUMENT naming the field, not INTERNAL.

    proto3 strings must be valid UTF-8; grpc's own handling of the parser's DecodeError is
    INTERNAL "Exception deserializing request!". Unary-request methods get a deserializer that
    hands a failure to the handler, which aborts with the field found by :func:`bad_utf8_field`.
    """

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        try:
            name = details.method.lstrip("/").replace("/", ".")
            desc = descriptor_pool.Default().FindMethodByName(name).input_type
        except KeyError:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError:
                return _Undecodable(bad_utf8_field(desc, data))

        def guarded(behavior):
            def run(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return behavior(request, context)
            return run

        if handler.response_streaming:
            return handler._replace(request_deserializer=deserialize,
                                    unary_stream=guarded(handler.unary_stream))
        return handler._replace(request_deserializer=deserialize,
                                unary_unary=guarded(handler.unary_unary))


@dataclasses.dataclass
class _Undecodable:
    field: str | None

    @property
    def message(self) -> str:
        if self.field:
            return f"{self.field}: not valid UTF-8"
        return "request: not a valid protobuf message"


def bad_utf8_field(desc, data: bytes, prefix: str = "") -> str | None:
    """The path (``chat.messages[1].content``) of the first string field of message ``desc``
    whose bytes in ``data`` (wire format) are not valid UTF-8; None when there is none or the
    bytes are malformed."""
    seen: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                n, i = _varint(data, i)
                value, i = data[i:i + n], i + n
                f = desc.fields_by_number.get(number)
                if f is None:
                    continue
                name = prefix + f.name
                if f.is_repeated:
                    seen[number] = seen.get(number, -1) + 1
                    name += f"[{seen[number]}]"
                if f.type == f.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif f.type == f.TYPE_MESSAGE:
                    found = bad_utf8_field(f.message_type, value, name + ".")
                    if found:
                        return found
            else:
                return None     # groups (proto2 only) or garbage
    except IndexError:
        return None
    return None


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """Decode a base-128 varint at ``data[i]``; returns (value, next index). IndexError at the end."""
    value = shift = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7
