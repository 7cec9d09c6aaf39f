"""The OpenAI-compatible HTTP front of the gateway (FastAPI; served by :mod:`gateway.http_server`).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent events with
``stream``), ``GET /v1/models`` (the target, its drafters as metadata), ``GET /health``. Each
generation calls the same path as the gRPC ``Generate`` (:meth:`GatewayServicer.stream`, via
``observed_stream``: one validation, one detokenizer, one drafter choice), in a worker thread;
what it raises maps to HTTP statuses through :mod:`gateway.status` and comes back in OpenAI's
error shape, 400s naming the parameter. API keys (``gateway.auth.ClientAuth``) are the gRPC
port's: ``Authorization: Bearer <key>``, the same rate and stream limits and session owners;
the per-client stream bound (``gateway.client_streams.ClientStreams``) counts a client's streams on both
ports together, the client being its key or its address (uvicorn's: the TCP peer's, or the
``X-Forwarded-For`` a proxy on loopback sends; never ``x-dflash-client``).
A client that disconnects cancels its generation (the verifier calls with it), whether it was
waiting for a JSON response, for the first event of a stream, or reading the stream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash.core.errors import FieldError
from gateway.auth import AuthError, ClientAuth, bearer_value
from gateway.client_streams import ClientStreams
from gateway.generation import Cancel
from gateway.inputs import http_identity
from gateway.openai_body import BodyError, parse_body
from gateway.openai_convert import Assembler, Prepared, chat_request, completion_request, http_param
from gateway.openai_models import ChatRequest, CompletionRequest, DrafterInfo, ModelCard, ModelList
from gateway.openai_stream import GONE, SSE, Run, collect, first_message, sse, unless_disconnected
from gateway.peers import address_identity
from gateway.status import error_body, retry_after_ms, status_of
from gateway.token_text import TokenText

log = logging.getLogger("dflash.gateway.http")
BUSY_RETRY_MS = 200      # hint of a request refused because every stream slot is taken
CLIENT_CLOSED = 499      # nginx's "client closed request": the status nobody receives


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, retry_ms: int | None = None) -> JSONResponse:
    headers = {}
    if retry_ms is not None:   # OpenAI's clients read retry-after-ms; others Retry-After (s)
        headers = {"retry-after-ms": str(retry_ms), "retry-after": str(max(1, -(-retry_ms // 1000)))}
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _core_error_body(e: BaseException, p: Prepared | None, chat: bool) -> dict:
    """OpenAI's error body for a core exception, the parameter named as the client named it."""
    body = error_body(e)
    if isinstance(e, FieldError):
        param = http_param(e.field, p, chat)
        body["error"]["param"] = param
        body["error"]["message"] = f"{param}: {str(e).partition(': ')[2]}"
    elif status_of(e).http >= 500:
        log.warning("request failed: %s", e)
    return body


def _core_error(e: BaseException, p: Prepared | None, chat: bool) -> JSONResponse:
    """A core exception as an HTTP error response (status from the one table)."""
    err = _core_error_body(e, p, chat)["error"]
    return _error(status_of(e).http, err["message"], err["type"], err["param"], err["code"],
                  retry_after_ms(e))


def _param_of(loc) -> str:
    """pydantic's error location ("messages", 0, "content") as "messages[0].content"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[any]", "list[dict[any,any]]", "function-after"):
            continue   # union branch names
        else:
            out += ("." if out else "") + str(part)
    return out


async def _events(asm: Assembler, run: Run, first, prepared: Prepared, chat: bool):
    """The server-sent events of a stream whose ``first`` message came (None: it ended
    without one): role chunks, the deltas, usage when asked, ``[DONE]``; an error after the
    status line is an error event."""
    try:
        for c in asm.role_chunks():
            yield sse(c)
        if first is not None:
            for c in asm.chunks(first):
                yield sse(c)
            async for m in run:
                for c in asm.chunks(m):
                    yield sse(c)
        if prepared.include_usage:
            yield sse(asm.usage_chunk())
    except Exception as e:   # noqa: BLE001 - after the status line: an error event
        yield sse(_core_error_body(e, prepared, chat))
    yield "data: [DONE]\n\n"


class OpenAIFront:
    """The HTTP app over ``servicer`` (a GatewayServicer).

    Args:
        servicer: the gateway servicer (its ``observed_stream`` is the Generate path).
        model_name: the ``model`` clients name (``/v1/models`` lists it).
        max_positions: the target's context window (``max_model_len``).
        serving: what ``/health`` reports (the gRPC health: the gateway's and its verifier's).
        api_keys: client API keys (None: no key needed).
        max_streams: generations at once (each holds a worker thread); one more gets 429.
        client_streams: the per-client Generate stream bound shared with the gRPC port (None:
            none); one more than a client's bound gets 429.
        max_request_bytes: largest request body; a larger one gets 413.
    """

    def __init__(self, servicer, *, model_name: str, max_positions: int, serving: Callable[[], bool],
                 api_keys: ClientAuth | None = None, max_streams: int = 512,
                 client_streams: ClientStreams | None = None, max_request_bytes: int = 8 << 20):
        self.servicer, self.model_name, self.max_positions = servicer, model_name, max_positions
        self.serving, self.api_keys, self.client_streams = serving, api_keys, client_streams
        self.max_streams, self.max_request_bytes = max_streams, max_request_bytes
        self.token_text = TokenText(servicer.tok)
        self.pool = ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="http-generate")
        self.created = int(time.time())
        self._lock = threading.Lock()
        self.open = 0          # generations running now
        self.refused = 0
        self.app = self._build()

    # ------------------------------------------------------------------ plumbing
    def _admit_key(self, request: Request, limited: bool):
        """(identity, release) of the caller. Raises AuthError."""
        if self.api_keys is None:
            return http_identity(request.headers, request.client.host if request.client else ""), None
        admitted = self.api_keys.admit(bearer_value(request.headers.get("authorization")), limited)
        return admitted.identity, admitted.release

    def _admit_stream(self, request: Request):
        """(identity, release) of a generation: the key's slot, the client's and the server's,
        all or none (``release`` gives back those taken). Raises AuthError: UNAUTHENTICATED,
        or RESOURCE_EXHAUSTED with a retry hint."""
        owner, release_key = self._admit_key(request, limited=True)
        releases = [release_key] if release_key else []
        try:
            if self.client_streams is not None:
                address = address_identity(request.client.host if request.client else "")
                token = bearer_value(request.headers.get("authorization"))
                releases.append(self.client_streams.acquire(self.client_streams.client(token, address)))
            if not self._take_slot():
                raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server busy: {self.max_streams} generations running", BUSY_RETRY_MS)
        except BaseException:
            for release in releases:
                release()
            raise
        releases.append(self._release_slot)

        def release_all() -> None:
            for release in releases:
                release()
        return owner, release_all

    def _take_slot(self) -> bool:
        with self._lock:
            if self.open >= self.max_streams:
                self.refused += 1
                return False
            self.open += 1
            return True

    def _release_slot(self) -> None:
        with self._lock:
            self.open -= 1

    async def _body(self, request: Request, model_cls):
        """The request body parsed within limits (``gateway.openai_body``) and validated.
        Raises FieldError-like _BadBody."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise _BadBody(413, f"request body of {length} bytes, more than "
                           f"{self.max_request_bytes}", None)
        raw = await request.body()
        if len(raw) > self.max_request_bytes:
            raise _BadBody(413, f"request body of {len(raw)} bytes, more than "
                           f"{self.max_request_bytes}", None)
        try:
            obj = parse_body(raw)
        except BodyError as e:
            raise _BadBody(400, str(e), e.param) from None
        try:
            return model_cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            param = _param_of(err["loc"]) or None
            if err["type"] == "extra_forbidden":
                raise _BadBody(400, f"{param}: is not supported by this server", param,
                               "unsupported_parameter") from None
            if err["type"] == "missing":
                raise _BadBody(400, f"{param}: required", param, "missing_required_parameter") from None
            raise _BadBody(400, f"{param}: {err['msg']}", param) from None

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: Request, chat: bool):
        model_cls = ChatRequest if chat else CompletionRequest
        prepared = None
        try:
            body = await self._body(request, model_cls)
        except _BadBody as e:
            return e.response()
        if body.model != self.model_name:
            return _error(404, f"model {body.model[:64]!r} does not exist (this server serves "
                          f"{self.model_name!r})", "not_found_error", "model", "model_not_found")
        try:
            prepared = chat_request(body) if chat else completion_request(body)
            owner, on_close = self._admit_stream(request)
        except (FieldError, AuthError) as e:
            return _core_error(e, prepared, chat)
        asm, run = self._start(request, prepared, owner, on_close, chat)
        # Nothing is sent before the whole answer (JSON) or its first message (a stream, so that
        # errors before it become statuses): a client gone meanwhile cancels the generation.
        try:
            got = await unless_disconnected(request, first_message(run) if prepared.stream
                                             else collect(run, asm))
        except Exception as e:   # noqa: BLE001 - mapped by the one table
            run.close()
            return _core_error(e, prepared, chat)
        except BaseException:    # cancelled (the server shutting down): free the slot too
            run.close()
            raise
        if got is GONE or not prepared.stream:
            run.close()          # cancels the verifier calls of a generation still running
            if got is GONE:
                log.info("client disconnected: generation cancelled")
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(asm.body())
        return SSE(_events(asm, run, got, prepared, chat), run)

    def _start(self, request: Request, prepared: Prepared, owner: str,
               on_close: Callable[[], None], chat: bool) -> tuple[Assembler, Run]:
        """The generation of ``prepared`` for ``owner`` started in a worker thread, and the
        assembler of its response; ``on_close`` runs when the run is closed."""
        cancel = Cancel()
        headers = {k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}
        r = prepared.request
        asm = Assembler(chat=chat, model=self.model_name, n=max(1, r.n), token_text=self.token_text,
                        logprobs=prepared.logprobs, top_logprobs=r.sampling.top_logprobs,
                        tools=prepared.tools)
        run = Run(asyncio.get_running_loop(), self.pool, lambda: self.servicer.observed_stream(
            prepared.request, owner, cancel, trace_headers=headers, response_id=asm.id,
            stream=prepared.stream, chat_template_kwargs=prepared.chat_template_kwargs,
            fill_context=prepared.fill_context), cancel, on_close)
        return asm, run

    # ------------------------------------------------------------------ the app
    def _models(self) -> ModelList:
        drafters = [DrafterInfo(name=e.name, version=e.version, label=e.label, is_default=d,
                                weight=e.weight) for e, d in self.servicer.registry.entries()]
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.max_positions, drafters=drafters)])

    def _build(self) -> FastAPI:
        app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc):
            s = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error",
                                                             "method_not_allowed")}
            type_, code = s.get(exc.status_code, ("invalid_request_error", None))
            return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          type_, code=code)

        @app.get("/health")
        async def health():
            if self.serving():
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "not serving"}, status_code=503)

        @app.get("/v1/models")
        async def models(request: Request):
            try:
                self._admit_key(request, limited=False)
            except AuthError as e:
                return _core_error(e, None, False)
            return JSONResponse(self._models().model_dump())

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request):
            try:
                self._admit_key(request, limited=False)
            except AuthError as e:
                return _core_error(e, None, False)
            if model_id != self.model_name:
                return _error(404, f"model {model_id[:64]!r} does not exist", "not_found_error",
                              "model", "model_not_found")
            return JSONResponse(self._models().data[0].model_dump())

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        return app

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _BadBody(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        return _error(self.status, str(self), "invalid_request_error", self.param,
                      self.code or ("invalid_value" if self.status == 400 else "request_too_large"))


__all__ = ["OpenAIFront"]
