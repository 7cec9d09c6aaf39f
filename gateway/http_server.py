"""Serve the OpenAI-compatible app (:mod:`gateway.openai_api`) with uvicorn in a thread.

:class:`HttpServer` binds its socket when built (a bad address fails there, like the gRPC
server's), serves once :meth:`start` is called and stops with :meth:`stop`; the gateway ties it
to its gRPC server's lifetime (``gateway.server.build``). HTTPS when given the gateway's
``ServerTLS`` files (its CA: client certificates required).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import uvicorn

log = logging.getLogger("dflash.gateway.http")


def _host_port(bind: str) -> tuple[str, int]:
    """"host:port" / "[::1]:port" -> (host, port). Raises ValueError naming --http-bind."""
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--http-bind: expected host:port, got {bind!r}")
    return host.strip("[]"), int(port)


class HttpServer:
    """Args: the ASGI app, ``bind`` ("host:port"; port 0 = any free one), ``tls`` (a
    ``dflash.tls.ServerTLS``; None = plain HTTP). Raises RuntimeError when ``bind`` cannot be
    bound, ValueError when it is malformed."""

    def __init__(self, app, bind: str, *, tls=None, on_stop=None):
        host, port = _host_port(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"--http-bind: cannot bind {bind}: {e.strerror}") from None
        self.sock.listen(2048)
        self.host, self.port = host, self.sock.getsockname()[1]
        kw = {}
        if tls is not None:
            kw = {"ssl_certfile": tls.files.cert, "ssl_keyfile": tls.files.key}
            if tls.files.ca:
                kw.update(ssl_ca_certs=tls.files.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.scheme = "https" if tls is not None else "http"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, **kw)
        self.server = uvicorn.Server(config)
        self.on_stop = on_stop
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve in a daemon thread; returns once uvicorn is accepting connections. Raises
        RuntimeError when it did not start within ``timeout_s``."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="http-server")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.url} did not start")
            time.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on %s", self.url)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            if self.on_stop is not None:
                self.on_stop()

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop accepting, let open responses finish for up to ``grace_s`` (at least 1 s: the
        gRPC server's ``stop(0)`` passes 0), then close them."""
        self.server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(max(1.0, grace_s) + 5.0)
        self.sock.close()
