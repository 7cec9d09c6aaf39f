"""How the HTTP front runs a generation: the gRPC path's stream iterated in a worker thread
(:class:`Run`), its messages awaited on the event loop, a client's disconnect noticed while
waiting (:func:`unless_disconnected`), and the server-sent event response (:class:`SSE`)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.generation import Cancel
from gateway.openai_convert import Assembler

_END = object()
GONE = object()          # the client disconnected before the awaited result


class Run:
    """One Generate stream iterated in a worker thread; its messages handed to the event loop.

    :meth:`close` (idempotent) cancels the verifier calls, stops the thread after its current
    message and releases the request's slots (``on_close``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: ThreadPoolExecutor, make_stream,
                 cancel: Cancel, on_close: Callable[[], None]):
        self.loop, self.cancel, self.on_close = loop, cancel, on_close
        self.queue: asyncio.Queue = asyncio.Queue()
        self._stop = threading.Event()
        self._closed = False
        pool.submit(self._work, make_stream)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:      # the loop is gone (server shut down)
            self._stop.set()

    def _work(self, make_stream) -> None:
        stream = None
        try:
            stream = make_stream()
            for item in stream:
                self._put(item)
                if self._stop.is_set():
                    break
            self._put(_END)
        except BaseException as e:   # noqa: BLE001 - handed to the request's coroutine
            self._put(e)
        finally:
            if stream is not None:
                stream.close()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            self.cancel.cancel()
            self.on_close()


class SSE(StreamingResponse):
    """A server-sent event stream whose request is closed however the response ends (also when
    the client went away before its first byte)."""

    def __init__(self, content, run: Run):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away. Awaited after the body was read, so the next ASGI
    message is ``http.disconnect``: the server sends it when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
    """``work``'s result (or its exception), or ``GONE`` when the client disconnected first;
    ``work`` is cancelled then (and when this coroutine is)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()   # no-op once finished
        gone.cancel()
    return task.result() if task in done else GONE


async def first_message(run: Run):
    """The run's first message; None when it ended without one."""
    try:
        return await run.__anext__()
    except StopAsyncIteration:
        return None


async def collect(run: Run, asm: Assembler) -> None:
    async for m in run:
        asm.add(m)
