"""Serve the OpenAI-compatible app (:mod:`gateway.openai_api`) with uvicorn in a thread.

:class:`HttpServer` binds its socket when built (a bad address fails there, like the gRPC
server's), serves once :meth:`start` is called and stops with :meth:`stop`; the gateway ties it
to its gRPC server's lifetime (``gateway.server.build``). HTTPS when given the gateway's
``ServerTLS`` files (its CA: client certificates required), reloaded as the gRPC port reloads
them (:class:`ReloadingTLS`).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from dflash.serving.tls import TLSConfigError, check_pair, file_stamps

log = logging.getLogger("dflash.gateway.http")


def _host_port(bind: str) -> tuple[str, int]:
    """"host:port" / "[::1]:port" -> (host, port). Raises ValueError naming --http-host (the
    address is --http-host or the --bind host, with --http-port)."""
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--http-host: expected host:port, got {bind!r}")
    return host.strip("[]"), int(port)


class ReloadingTLS:
    """The HTTPS side of a ``dflash.serving.tls.ServerTLS``: uvicorn's ``ssl_context_factory``, whose
    context re-reads the files as the gRPC port does.

    At every new handshake (the TLS ClientHello: ``SSLContext.sni_callback``, called with or
    without SNI) the files are checked; when one changed, or after ``ServerTLS.request_reload``
    (SIGHUP), a context is built from them with uvicorn's own builder and the handshake goes on
    with it (``SSLObject.context``), so the next connection gets the renewed certificate and
    open ones keep theirs. A replacement that does not load (half written, the key not matching,
    expired: ``dflash.serving.tls.check_pair``) is refused with a warning and the previous one stays.
    """

    def __init__(self, tls):
        self.tls, self.files = tls, tls.files
        self._paths = [p for p in (self.files.cert, self.files.key, self.files.ca) if p]
        self._lock = threading.Lock()
        self._stamp = file_stamps(self._paths)
        self._requests = tls.reload_requests
        self._build: Callable[[], ssl.SSLContext] | None = None
        self.first: ssl.SSLContext | None = None      # what uvicorn listens with
        self.current: ssl.SSLContext | None = None    # what a new handshake gets
        self.reloads = 0                              # contexts replaced after the first

    def factory(self, _config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        """uvicorn's ``ssl_context_factory``: ``default`` builds a context from the config's
        files (cert, key, CA and client-certificate mode), and is kept for the reloads."""
        self._build = default
        self.first = self.current = default()
        self.first.sni_callback = self._on_hello
        return self.first

    def _on_hello(self, conn, _server_name, _context) -> None:
        ctx = self._reload_if_changed()
        if ctx is not None and ctx is not self.first:
            conn.context = ctx

    def _reload_if_changed(self) -> ssl.SSLContext | None:
        with self._lock:
            stamp, requests = file_stamps(self._paths), self.tls.reload_requests
            if self._build is None or (stamp == self._stamp and requests == self._requests):
                return self.current
            self._stamp, self._requests = stamp, requests
            f = self.files
            try:
                check_pair(self._read(f.cert, "cert"), self._read(f.key, "key"),
                           cert_flag=f.flag("cert"), key_flag=f.flag("key"))
                ctx = self._build()
            except (TLSConfigError, ssl.SSLError, OSError) as e:   # e.g. the key written, the cert not yet
                log.warning("HTTPS certificate reload refused, keeping the current one: %s", e)
                return self.current
            self.current = ctx
            self.reloads += 1
            log.info("HTTPS: reloaded TLS certificate from %s", f.cert)
            return ctx

    def _read(self, path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise TLSConfigError(f"{self.files.flag(what)}: cannot read {path}: {e.strerror or e}") from e


class HttpServer:
    """Args: the ASGI app, ``bind`` ("host:port"; port 0 = any free one), ``tls`` (a
    ``dflash.serving.tls.ServerTLS``, reloaded through :class:`ReloadingTLS` (``.tls``); None = plain
    HTTP). Raises RuntimeError when ``bind`` cannot be bound, ValueError when it is malformed."""

    def __init__(self, app, bind: str, *, tls=None, on_stop=None):
        host, port = _host_port(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.front: Any = None       # the OpenAIFront serving ``app`` (gateway.server.build sets it)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"--http-port: cannot bind {bind}: {e.strerror}") from None
        self.sock.listen(2048)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.tls = reloading = ReloadingTLS(tls) if tls is not None else None
        kw = {}
        if reloading is not None:
            kw = {"ssl_certfile": tls.files.cert, "ssl_keyfile": tls.files.key,
                  "ssl_context_factory": reloading.factory}
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
