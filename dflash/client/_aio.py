"""The asyncio client of the Gateway service (``grpc.aio``): the same calls as
:class:`dflash.client.GatewayClient`, awaitable; :meth:`stream` is an async iterator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc
from grpc import aio

from dflash.client._common import (
    CHANNEL_OPTIONS,
    Collector,
    Completion,
    GenerateError,
    call_metadata,
    channel_credentials,
)
from dflash.v1 import gateway_pb2, gateway_pb2_grpc


class AsyncGatewayClient:
    """Arguments as :class:`dflash.client.GatewayClient`. Use ``async with`` or ``await close()``."""

    def __init__(self, address: str, tls=None, *, api_key: str | None = None,
                 metadata: Sequence[tuple[str, str]] = ()):
        creds = channel_credentials(tls)
        options = CHANNEL_OPTIONS + (list(tls.options()) if hasattr(tls, "options") else [])
        self.channel = (aio.secure_channel(address, creds, options=options) if creds
                        else aio.insecure_channel(address, options=options))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.metadata = call_metadata(api_key, metadata)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel connects. Raises asyncio.TimeoutError."""
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def stream(self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
                     ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The raw messages (deltas, then a final one per sample). Raises grpc.RpcError."""
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        try:
            async for r in call:
                yield r
        finally:
            call.cancel()

    async def complete_all(self, request: gateway_pb2.GenerateRequest, on_text=None,
                           timeout: float | None = None) -> list[Completion]:
        """Every sample of the request (``n``), in index order. Raises GenerateError."""
        c = Collector(on_text)
        try:
            async for r in self.stream(request, timeout=timeout):
                c.add(r)
        except grpc.RpcError as e:
            raise GenerateError.from_rpc(e) from None
        return c.completions()

    async def complete(self, request: gateway_pb2.GenerateRequest, on_text=None,
                       timeout: float | None = None) -> Completion:
        """The one sample of a request with n <= 1. Raises GenerateError, ValueError for n > 1."""
        if request.n > 1:
            raise ValueError("n: complete() returns one sample; use complete_all()")
        return (await self.complete_all(request, on_text, timeout))[0]

    async def list_drafters(self, timeout: float = 10.0) -> list[gateway_pb2.DrafterEntry]:
        r = await self.stub.ListDrafters(gateway_pb2.ListDraftersRequest(), timeout=timeout,
                                         metadata=self.metadata)
        return list(r.drafters)

    async def close_session(self, session_id: str, timeout: float = 10.0) -> bool:
        r = await self.stub.CloseSession(
            gateway_pb2.GatewayCloseSessionRequest(session_id=session_id), timeout=timeout,
            metadata=self.metadata)
        return r.existed

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncGatewayClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
