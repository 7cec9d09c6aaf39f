"""The Generate streams each client may have open: the API key's name, else the peer's IP
address, counted over the gRPC port and the HTTP front together (``--max-streams-per-client``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from dflash.serving.server import RETRY_AFTER_KEY
from gateway.auth import CONCURRENCY_RETRY_MS, LIMITED_STREAM, AuthError, ClientAuth, bearer, wrap_unary_request
from gateway.peers import peer_identity

DEFAULT_STREAMS_PER_CLIENT = 64  # --max-streams-per-client: an eighth of the default --max-streams


class ClientStreams(grpc.ServerInterceptor):
    """At most ``limit`` Generate streams open per client (0 = unbounded), counted over the gRPC
    port and the HTTP front together; one more is refused at once with RESOURCE_EXHAUSTED (HTTP
    429) and a ``retry-after-ms`` hint of :data:`CONCURRENCY_RETRY_MS`, while other clients
    are served. A slot is held from the stream's first step until the RPC terminates: finished,
    failed or cancelled by the client.

    The client (:meth:`client`) is the API key's ``key:<name>`` when ``api_keys`` are on (a key
    with its own ``max_concurrency`` is bounded by that alone, in ClientAuth), else the peer's
    IP address (:func:`peer_identity`); never ``x-dflash-client``, which a caller may change
    with every request. Place it after ClientAuth: an unauthenticated call never takes a slot.

    Raises ValueError when ``limit`` < 0.
    """

    def __init__(self, limit: int, api_keys: ClientAuth | None = None):
        if limit < 0:
            raise ValueError(f"max_streams_per_client: must be >= 0, got {limit}")
        self.limit, self.api_keys = limit, api_keys
        self._open: dict[str, int] = {}     # client -> streams open (absent = 0)
        self._lock = threading.Lock()
        self.refused = 0

    def open(self, client: str) -> int:
        """Streams ``client`` has open now."""
        with self._lock:
            return self._open.get(client, 0)

    def client(self, token: str | None, address: str) -> str | None:
        """Whom a Generate stream counts for: ``address`` (an :func:`address_identity` or
        :func:`peer_identity`) without keys, else ``key:<name>`` of the key ``token`` names;
        None when it is not bounded here (limit 0, or the key has its own max_concurrency)."""
        if not self.limit:
            return None
        if self.api_keys is None:
            return address
        key = self.api_keys.key(token)
        if key is None:          # ClientAuth refuses it; counted by address meanwhile
            return address
        return None if key.max_concurrency else f"key:{key.name}"

    def acquire(self, client: str | None) -> Callable[[], None]:
        """Take one of ``client``'s slots (None: nothing to take); returns the function that
        gives it back (idempotent). Raises AuthError (RESOURCE_EXHAUSTED, with the retry hint)
        when ``client`` has ``limit`` streams open."""
        if client is None:
            return lambda: None
        with self._lock:
            n = self._open.get(client, 0)
            if n >= self.limit:
                self.refused += 1
                refused = True
            else:
                self._open[client] = n + 1
                refused = False
        if refused:
            raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"too many streams: client {client[:64]} has {self.limit} open, the "
                            f"per-client limit; retry after {CONCURRENCY_RETRY_MS} ms",
                            CONCURRENCY_RETRY_MS)
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._open[client] - 1
                if left:
                    self._open[client] = left
                else:             # no entry per client ever seen: the map stays bounded
                    del self._open[client]
        return release

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not self.limit or details.method != LIMITED_STREAM:
            return handler
        return wrap_unary_request(handler, self._guard)

    def _guard(self, behavior, streaming):
        def stream(request, context):
            client = self.client(bearer(context), peer_identity(context.peer() or ""))
            try:
                release = self.acquire(client)
            except AuthError as e:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
                context.abort(e.code, str(e))
                raise AssertionError("unreachable: context.abort raises") from e
            # add_callback runs when the RPC terminates, also when it is cancelled mid-stream.
            if not context.add_callback(release):
                release()
            yield from behavior(request, context)
        return stream if streaming else behavior
