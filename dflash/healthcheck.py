"""Container health probe: ``python -m dflash.healthcheck HOST:PORT [SERVICE]``.

Asks the server's ``grpc.health.v1.Health/Check`` for ``SERVICE`` ("" = the whole server) and
exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, UNKNOWN, unreachable, timeout).
A bind address such as ``0.0.0.0:50051`` or ``[::]:50051`` is probed on loopback, so an image
can pass its own ``DFLASH_*_BIND`` value. Stands in for ``grpc_health_probe``, which no package
registry ships.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_ANY_HOSTS = {"", "0.0.0.0", "[::]", "::"}


def probe_address(address: str) -> str:
    """``address`` with a wildcard bind host replaced by loopback."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return f"127.0.0.1:{port}" if host in _ANY_HOSTS else address


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving?, status name or error) for ``service`` at ``address``."""
    with grpc.insecure_channel(probe_address(address)) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.healthcheck", description=__doc__.split("\n")[0])
    ap.add_argument("address", help="HOST:PORT of the gRPC server (0.0.0.0 means loopback)")
    ap.add_argument("service", nargs="?", default="",
                    help='service name, e.g. dflash.v1.Verifier (default "": the whole server)')
    ap.add_argument("--timeout", type=float, default=3.0, help="RPC deadline, seconds")
    a = ap.parse_args(argv)
    try:
        ok, status = check(a.address, a.service, a.timeout)
    except ValueError as e:
        ap.error(str(e))
    print(f"{a.address} {a.service or '(server)'}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
