"""``--health-bind``: a plaintext health-only listener beside a service port that requires mTLS
(kubelet's gRPC probes cannot present client certificates)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.serving.server import add_health_listener, create_server
from dflash.serving.tls import ServerTLS, TLSFiles, make_dev_certs


def status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def test_health_only_listener_follows_the_service_and_serves_nothing_else(tmp_path):
    certs = make_dev_certs(tmp_path, ["localhost", "127.0.0.1"])
    tls = ServerTLS(TLSFiles(cert=str(certs["verifier"][0]), key=str(certs["verifier"][1]),
                             ca=str(certs["ca"][0])))
    rt = create_server("127.0.0.1:0", lambda s: None, ("dflash.v1.Verifier",), tls=tls)
    port = add_health_listener(rt, "127.0.0.1:0")
    assert add_health_listener(rt, "") is None
    rt.server.start()
    try:
        assert status(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        rt.set_serving(True)
        assert status(port) == health_pb2.HealthCheckResponse.SERVING
        # the service port itself refuses a plaintext client
        with pytest.raises(grpc.RpcError):
            status(rt.port)
        # nothing but health on the listener (no reflection, no service)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/dflash.v1.Verifier/Describe")(b"", timeout=2)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        rt.server.stop(0).wait()
    # stopped with the service
    with pytest.raises(grpc.RpcError):
        status(port)
