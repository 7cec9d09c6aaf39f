"""The blocking client of the Gateway service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from dflash.client._common import (
    CHANNEL_OPTIONS,
    Collector,
    Completion,
    GenerateError,
    call_metadata,
    channel_credentials,
)
from dflash.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayClient:
    """Gateway stub over one channel to ``address``.

    Args:
        address: host:port of the gateway's gRPC port.
        tls: None (plaintext), grpc.ChannelCredentials, or an object with ``credentials()``
            and ``options()`` (``dflash.serving.tls.ClientTLS``: the CA and a client certificate).
        api_key: sent as ``authorization: Bearer <key>`` (the gateway's ``--api-keys-file``).
        metadata: more metadata for every call (``x-dflash-client``...).

    Errors of :meth:`complete` / :meth:`complete_all` are :class:`GenerateError`; :meth:`stream`
    yields the raw messages and raises grpc.RpcError.
    """

    def __init__(self, address: str, tls=None, *, api_key: str | None = None,
                 metadata: Sequence[tuple[str, str]] = ()):
        creds = channel_credentials(tls)
        options = CHANNEL_OPTIONS + (list(tls.options()) if hasattr(tls, "options") else [])
        self.channel = (grpc.secure_channel(address, creds, options=options) if creds
                        else grpc.insecure_channel(address, options=options))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.metadata = call_metadata(api_key, metadata)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects. Raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def stream(self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
               ) -> Iterator[gateway_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def complete_all(self, request: gateway_pb2.GenerateRequest, on_text=None,
                     timeout: float | None = None) -> list[Completion]:
        """Every sample of the request (``n``), in index order. Raises GenerateError."""
        c = Collector(on_text)
        try:
            for r in self.stream(request, timeout=timeout):
                c.add(r)
        except grpc.RpcError as e:
            raise GenerateError.from_rpc(e) from None
        return c.completions()

    def complete(self, request: gateway_pb2.GenerateRequest, on_text=None,
                 timeout: float | None = None) -> Completion:
        """The one sample of a request with n <= 1. Raises GenerateError, ValueError for n > 1."""
        if request.n > 1:
            raise ValueError("n: complete() returns one sample; use complete_all()")
        return self.complete_all(request, on_text, timeout)[0]

    def list_drafters(self, timeout: float = 10.0) -> list[gateway_pb2.DrafterEntry]:
        r = self.stub.ListDrafters(gateway_pb2.ListDraftersRequest(), timeout=timeout,
                                   metadata=self.metadata)
        return list(r.drafters)

    def close_session(self, session_id: str, timeout: float = 10.0) -> bool:
        """Free the session's state on the verifier and drafter; whether it existed."""
        r = self.stub.CloseSession(gateway_pb2.GatewayCloseSessionRequest(session_id=session_id),
                                   timeout=timeout, metadata=self.metadata)
        return r.existed

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
