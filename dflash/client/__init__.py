"""A small typed client of the Gateway's gRPC API, blocking and asyncio, that imports only
grpcio, protobuf and the generated stubs (``dflash.v1``; the ``.proto`` files ship beside
them): no torch, transformers or numpy. Used by ``dflash generate``, the demo and the bench.

    from dflash.client import GatewayClient, build_request

    with GatewayClient("127.0.0.1:50050") as c:
        done = c.complete(build_request("Write a haiku", max_tokens=64))
        print(done.text, done.acceptance.mean_acceptance_length)

    # asyncio
    async with AsyncGatewayClient("127.0.0.1:50050", api_key=KEY) as c:
        async for r in c.stream(build_request(messages=[{"role": "user", "content": "Hi"}])):
            print(r.text, end="")

Install without the server's dependencies: ``pip install dflash-serve[client]`` (the core is
grpcio and protobuf; the services need ``[serve]``); see docs/http-api.md.
"""

from dflash.client._aio import AsyncGatewayClient
from dflash.client._common import Completion, GenerateError, build_request, finish_name, summary_line
from dflash.client._sync import GatewayClient

__all__ = ["AsyncGatewayClient", "Completion", "GatewayClient", "GenerateError", "build_request",
           "finish_name", "summary_line"]
