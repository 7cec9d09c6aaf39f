"""Who may call the gateway: the admin token and client API keys (``authorization: Bearer``).

* :class:`AdminAuth` guards the ``GatewayAdmin`` server: with a token, every RPC but health
  needs ``authorization: Bearer <token>`` (constant-time compare), else UNAUTHENTICATED.
  Without a token the admin server may only bind loopback (:func:`check_admin_bind`).
* :class:`ClientAuth` guards the client port when ``--api-keys-file`` is given: every
  ``dflash.v1.Gateway`` RPC needs a known key (UNAUTHENTICATED otherwise); each key has its own
  request rate (token bucket) and Generate concurrency, over which it gets RESOURCE_EXHAUSTED
  with a ``retry-after-ms`` hint while other keys are served.

The Generate streams each client has open, keys or not, are bounded apart
(:mod:`gateway.client_streams`).

API keys file: one key a line, ``key [name [max_concurrency [rate_per_s]]]`` separated by
blanks; ``#`` starts a comment. ``name`` (default ``sha256:<first 8 hex digits of the key>``)
becomes the session owner identity ``key:<name>``; ``max_concurrency`` (Generate streams open
at once) and ``rate_per_s`` (requests per second, a burst of one second's worth) default to 0 =
unlimited. Keys are at least :data:`MIN_SECRET_CHARS` characters without blanks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import threading
import time
from pathlib import Path

import grpc

from dflash.serving.server import RETRY_AFTER_KEY, is_loopback_bind

log = logging.getLogger("dflash.gateway")

MIN_SECRET_CHARS = 16           # an admin token or API key shorter than this is refused
CONCURRENCY_RETRY_MS = 200      # hint of a stream refused for a key's or client's stream limit
EXEMPT_PREFIXES = ("/grpc.health.v1.",)   # probes need no credentials
CLIENT_PREFIX = "/dflash.v1.Gateway/"
LIMITED_STREAM = "/dflash.v1.Gateway/Generate"


def bearer(context) -> str | None:
    """The token of ``authorization: Bearer <token>`` metadata, None when absent or malformed."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_value(value)
    return None


def bearer_value(value: str | None) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (gRPC metadata or an HTTP
    header), None when absent or malformed."""
    scheme, _, token = (value or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def read_secret(path: str | Path, what: str) -> str:
    """The secret in ``path`` (surrounding whitespace removed).

    Raises ValueError naming ``what`` (the flag) when unreadable, empty, containing blanks or
    shorter than MIN_SECRET_CHARS."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    check_secret(text, what)
    return text


def check_secret(secret: str, what: str) -> None:
    """Raises ValueError naming ``what`` unless ``secret`` is >= MIN_SECRET_CHARS, no blanks."""
    if len(secret) < MIN_SECRET_CHARS or any(c.isspace() for c in secret):
        raise ValueError(f"{what}: must be at least {MIN_SECRET_CHARS} characters without blanks")


def check_admin_bind(bind: str, token: str | None) -> None:
    """Without a token the admin plane is reachable from this machine only.

    Raises ValueError naming --admin-bind when ``bind`` is not loopback and ``token`` is None."""
    if token is None and not is_loopback_bind(bind):
        raise ValueError(f"--admin-bind: {bind} is not a loopback address; set "
                         "--admin-token-file (or DFLASH_ADMIN_TOKEN) to expose the admin plane")


class AuthError(Exception):
    """A client refused by API keys: UNAUTHENTICATED, or RESOURCE_EXHAUSTED over its key's
    rate or concurrency (``retry_after_ms``: when to try again)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code, self.retry_after_ms = code, retry_after_ms


def wrap_unary_request(handler, guard):
    """``handler`` with ``guard(behavior, streaming)`` applied to its (unary-request) behavior."""
    if handler is None or handler.request_streaming:
        return handler
    if handler.response_streaming:
        return handler._replace(unary_stream=guard(handler.unary_stream, True))
    return handler._replace(unary_unary=guard(handler.unary_unary, False))


class AdminAuth(grpc.ServerInterceptor):
    """Every RPC but health needs ``authorization: Bearer <token>``; None = no check (the
    server must then bind loopback, :func:`check_admin_bind`)."""

    def __init__(self, token: str | None):
        self._digest = _digest(token) if token is not None else None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self._digest is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        return wrap_unary_request(handler, self._guard)

    def _allowed(self, context) -> bool:
        token = bearer(context)
        # Compare digests: constant time, and equal length whatever the caller sends.
        return (token is not None and self._digest is not None
                and hmac.compare_digest(_digest(token), self._digest))

    def _guard(self, behavior, streaming):
        def unary(request, context):
            if not self._allowed(context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "authorization: admin token required (Bearer)")
            return behavior(request, context)

        def stream(request, context):
            if not self._allowed(context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "authorization: admin token required (Bearer)")
            yield from behavior(request, context)
        return stream if streaming else unary


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApiKey:
    name: str
    max_concurrency: int = 0      # Generate streams open at once, 0 = unlimited
    rate_per_s: float = 0.0       # requests per second, 0 = unlimited


def load_api_keys(path: str | Path) -> dict[bytes, ApiKey]:
    """Parse an API keys file (module docstring); returns sha256(key) -> ApiKey.

    Raises ValueError naming ``--api-keys-file``, the line and the field that is wrong."""
    where = "--api-keys-file"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path}: {e.strerror}") from None
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for n, line in enumerate(lines, 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 4:
            raise ValueError(f"{where}: line {n}: expected 'key [name [max_concurrency "
                             f"[rate_per_s]]]', got {len(parts)} fields")
        key = parts[0]
        check_secret(key, f"{where}: line {n}: key")
        digest = _digest(key)
        name = parts[1] if len(parts) > 1 else "sha256:" + digest.hex()[:8]
        try:
            conc = int(parts[2]) if len(parts) > 2 else 0
        except ValueError:
            conc = -1
        if conc < 0:
            raise ValueError(f"{where}: line {n}: max_concurrency: must be an integer >= 0")
        try:
            rate = float(parts[3]) if len(parts) > 3 else 0.0
        except ValueError:
            rate = -1.0
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"{where}: line {n}: rate_per_s: must be a number >= 0")
        if digest in keys:
            raise ValueError(f"{where}: line {n}: key: repeated")
        if name in names:
            raise ValueError(f"{where}: line {n}: name: {name!r} repeated")
        keys[digest] = ApiKey(name=name, max_concurrency=conc, rate_per_s=rate)
        names.add(name)
    if not keys:
        raise ValueError(f"{where}: {path} holds no key")
    return keys


class _KeyState:
    """One key's open Generate streams and token bucket (``tokens`` up to ``rate_per_s``)."""

    def __init__(self, key: ApiKey):
        self.key = key
        self.open = 0
        self.tokens = max(1.0, key.rate_per_s)
        self.stamp = time.monotonic()

    def take(self, now: float) -> float:
        """Spend one request; returns 0 when allowed, else seconds until one is available."""
        rate = self.key.rate_per_s
        if rate <= 0:
            return 0.0
        self.tokens = min(max(1.0, rate), self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


class ClientAuth(grpc.ServerInterceptor):
    """API keys on ``dflash.v1.Gateway`` RPCs (module docstring); health and reflection exempt.

    ``identity(context)`` is the session owner for the servicer: ``key:<name>``.
    """

    def __init__(self, keys: dict[bytes, ApiKey]):
        self._state = {d: _KeyState(k) for d, k in keys.items()}
        self._lock = threading.Lock()
        self.refused = 0

    def _lookup(self, context) -> _KeyState | None:
        token = bearer(context)
        # A dict keyed by the digest: timing reveals at most digest prefixes, not the key.
        return self._state.get(_digest(token)) if token is not None else None

    def key(self, token: str | None) -> ApiKey | None:
        """The key ``token`` names, None when it names none (no side effect)."""
        st = self._state.get(_digest(token)) if token is not None else None
        return st.key if st is not None else None

    def identity(self, context) -> str:
        """``key:<name>`` of the caller's key. Raises KeyError for a call without a valid key
        (ClientAuth refuses those before the servicer runs)."""
        st = self._lookup(context)
        if st is None:
            raise KeyError("authorization")
        return f"key:{st.key.name}"

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not details.method.startswith(CLIENT_PREFIX):
            return handler
        limited = details.method == LIMITED_STREAM
        return wrap_unary_request(handler, lambda behavior, streaming: self._guard(behavior, streaming, limited))

    def admit(self, token: str | None, limited: bool) -> "Admitted":
        """Check the key ``token`` and spend its rate (and a stream slot when ``limited``:
        give it back with :meth:`Admitted.release`); the HTTP front's entry, and the gRPC
        guard's. Raises AuthError: UNAUTHENTICATED, or RESOURCE_EXHAUSTED with
        a retry hint in milliseconds."""
        st = self._state.get(_digest(token)) if token is not None else None
        if st is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "authorization: a valid API key is required (Bearer)")
        with self._lock:
            wait_s = st.take(time.monotonic())
            over = limited and st.key.max_concurrency and st.open >= st.key.max_concurrency
            if not wait_s and not over and limited:
                st.open += 1
            if wait_s or over:
                self.refused += 1
        if wait_s:
            raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"authorization: key {st.key.name!r} is over its rate of "
                            f"{st.key.rate_per_s:g} requests/s", max(1, math.ceil(wait_s * 1000)))
        if over:
            raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"authorization: key {st.key.name!r} has {st.key.max_concurrency} "
                            "streams open, its limit", CONCURRENCY_RETRY_MS)
        return Admitted(self, st, limited)

    def _admit(self, context, limited: bool) -> _KeyState:
        """:meth:`admit` for a gRPC call: aborts with its code (and ``retry-after-ms``)."""
        try:
            return self.admit(bearer(context), limited).state
        except AuthError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
            context.abort(e.code, str(e))
            raise AssertionError("unreachable: context.abort raises") from e

    def _release_on_end(self, context, st: _KeyState) -> None:
        admitted = Admitted(self, st, True)
        # add_callback runs when the RPC terminates, also when it is cancelled mid-stream.
        if not context.add_callback(admitted.release):
            admitted.release()

    def _guard(self, behavior, streaming, limited):
        def unary(request, context):
            self._admit(context, False)
            return behavior(request, context)

        def stream(request, context):
            st = self._admit(context, limited)
            if limited:
                self._release_on_end(context, st)
            yield from behavior(request, context)
        return stream if streaming else unary


class Admitted:
    """A request :meth:`ClientAuth.admit` let in: ``identity`` (the session owner,
    ``key:<name>``) and, for a stream, its slot, given back once by :meth:`release`."""

    def __init__(self, auth: ClientAuth, state: _KeyState, holds_slot: bool):
        self._auth, self.state, self._holds = auth, state, holds_slot
        self._released = False

    @property
    def identity(self) -> str:
        return f"key:{self.state.key.name}"

    def release(self) -> None:
        with self._auth._lock:
            if self._holds and not self._released:
                self._released = True
                self.state.open -= 1
