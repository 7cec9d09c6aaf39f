"""Container health probe: ``python -m dflash.serving.healthcheck HOST:PORT [SERVICE]``.

Asks the server's ``grpc.health.v1.Health/Check`` for ``SERVICE`` ("" = the whole server) and
exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, UNKNOWN, unreachable, timeout).
A bind address such as ``0.0.0.0:50051`` or ``[::]:50051`` is probed on loopback, so an image
can pass its own ``DFLASH_*_BIND`` value. Stands in for ``grpc_health_probe``, which no package
registry ships.

TLS: ``--tls-ca`` (verify the server) and ``--tls-cert``/``--tls-key`` (mTLS), by default from
the service's own ``DFLASH_TLS_CA``/``_CERT``/``_KEY``, so a container probes its own TLS server
with the variables it already has (``dflash certs`` certificates serve as client ones too);
``--tls-server-name`` checks the certificate for that name instead of the probed host.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.serving.tls import ClientTLS, TLSFiles, channel

_ANY_HOSTS = {"", "0.0.0.0", "[::]", "::"}


def probe_address(address: str) -> str:
    """``address`` with a wildcard bind host replaced by loopback."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return f"127.0.0.1:{port}" if host in _ANY_HOSTS else address


def check(address: str, service: str = "", timeout_s: float = 3.0,
          tls: ClientTLS | None = None) -> tuple[bool, str]:
    """(serving?, status name or error) for ``service`` at ``address`` (over TLS when ``tls``;
    a refused handshake is an UNAVAILABLE error whose details say why)."""
    with channel(probe_address(address), tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.serving.healthcheck", description=__doc__.split("\n")[0])
    ap.add_argument("address", help="HOST:PORT of the gRPC server (0.0.0.0 means loopback)")
    ap.add_argument("service", nargs="?", default="",
                    help='service name, e.g. dflash.v1.Verifier (default "": the whole server)')
    ap.add_argument("--timeout", type=float, default=3.0, help="RPC deadline, seconds")
    env = os.environ.get
    ap.add_argument("--tls-ca", default=env("DFLASH_TLS_CA") or None,
                    help="PEM CA bundle: probe with TLS, verifying the server [DFLASH_TLS_CA]")
    ap.add_argument("--tls-cert", default=env("DFLASH_TLS_CERT") or None,
                    help="PEM client certificate chain (mTLS) [DFLASH_TLS_CERT]")
    ap.add_argument("--tls-key", default=env("DFLASH_TLS_KEY") or None,
                    help="PEM private key of --tls-cert [DFLASH_TLS_KEY]")
    ap.add_argument("--tls-server-name", default=env("DFLASH_TLS_SERVER_NAME", ""),
                    help="name to verify the server's certificate for (default: the probed "
                         "host) [DFLASH_TLS_SERVER_NAME]")
    a = ap.parse_args(argv)
    try:
        tls = ClientTLS.from_files(TLSFiles(a.tls_cert, a.tls_key, a.tls_ca), a.tls_server_name)
        ok, status = check(a.address, a.service, a.timeout, tls)
    except ValueError as e:   # TLSConfigError too: the message names the flag
        ap.error(str(e))
    print(f"{a.address} {a.service or '(server)'}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
