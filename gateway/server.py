"""Gateway process: tokenizer, drafter registry, sessions; forwards to the verifier."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import grpc

from dflash.server import add_common_args, channel_options, create_server, run_until_signal
from dflash.telemetry import Telemetry, serve_metrics
from dflash.tracing import InjectTraceContext
from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from gateway.admin import GatewayAdminServicer
from gateway.registry import DrafterEntry, DrafterRegistry, load_config, parse_spec
from gateway.observe import ObservedGatewayServicer

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
ADMIN_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name
log = logging.getLogger("dflash.gateway")


def register_drafter(registry: DrafterRegistry, verifier, spec: str, *, name: str | None = None,
                     version: str | None = None, weight: float = 0.0, default: bool = False,
                     timeout_s: float = 60.0) -> DrafterEntry:
    """Check ``spec`` ("[name@version=]host:port") with the verifier and register it.

    The verifier's CheckDrafter calls the drafter's Describe and applies the same checks it
    applies before speculating. Raises grpc.RpcError: FAILED_PRECONDITION (does not fit the
    target, the message names the field) or UNAVAILABLE (not reachable within ``timeout_s``).
    """
    label, address = parse_spec(spec)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            card = verifier.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=address), timeout=10).card
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    if label:
        lname, _, lversion = label.partition("@")
        name, version = name or lname, version or lversion or card.version
    entry = DrafterEntry(name=name or card.name, version=version or card.version, address=address,
                         weight=weight)
    registry.register(entry, default=default)
    log.info("registered drafter %s at %s (weight %g%s)", entry.label, address, weight,
             ", default" if default else "")
    return entry


def build(tokenizer, verifier_address: str, bind: str, *, max_positions: int,
          session_ttl_s: float = 600.0, telemetry: Telemetry | None = None):
    channel = grpc.insecure_channel(verifier_address, options=channel_options())
    channel = grpc.intercept_channel(channel, InjectTraceContext())  # W3C traceparent to the verifier
    verifier = verifier_pb2_grpc.VerifierStub(channel)
    servicer = ObservedGatewayServicer(tokenizer, verifier, DrafterRegistry(), max_positions=max_positions,
                                       session_ttl_s=session_ttl_s, telemetry=telemetry)
    admin = GatewayAdminServicer(servicer.registry, lambda address, **kw: register_drafter(
        servicer.registry, verifier, address, timeout_s=5.0, **kw))

    def add(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        gateway_pb2_grpc.add_GatewayAdminServicer_to_server(admin, server)

    rt = create_server(bind, add, (SERVICE, ADMIN_SERVICE))
    rt.servicer = servicer
    return rt


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m gateway", description="DFlash gateway service")
    p.add_argument("--target", default=env("DFLASH_TARGET"), required=env("DFLASH_TARGET") is None,
                   help="target model directory (its tokenizer and chat template) [DFLASH_TARGET]")
    p.add_argument("--verifier", default=env("DFLASH_VERIFIER_ADDR", "127.0.0.1:50051"),
                   help="verifier host:port [DFLASH_VERIFIER_ADDR]")
    p.add_argument("--drafter", action="append",
                   default=[s for s in env("DFLASH_DRAFTERS", "").split(",") if s],
                   help="[name@version=]host:port of a drafter; repeat for several; the first is "
                        "the default [DFLASH_DRAFTERS, comma separated]")
    p.add_argument("--drafters-config", default=env("DFLASH_DRAFTERS_CONFIG"),
                   help='JSON file {"drafters": [{"address", "name", "version", "weight", "default"}]} '
                        "[DFLASH_DRAFTERS_CONFIG]")
    p.add_argument("--bind", default=env("DFLASH_GATEWAY_BIND", "127.0.0.1:50050"),
                   help="host:port to listen on [DFLASH_GATEWAY_BIND]")
    p.add_argument("--session-ttl", type=float, default=float(env("DFLASH_SESSION_TTL_S", "600")),
                   help="idle session lifetime, seconds [DFLASH_SESSION_TTL_S]")
    add_common_args(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from dflash.server import wait_healthy

    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.target)
    if not wait_healthy(a.verifier, 600):
        raise SystemExit(f"verifier at {a.verifier} did not become healthy")
    with grpc.insecure_channel(a.verifier) as ch:
        card = verifier_pb2_grpc.VerifierStub(ch).Describe(verifier_pb2.DescribeTargetRequest(), timeout=10)
    telemetry = Telemetry.from_env("gateway")
    rt = build(tok, a.verifier, a.bind, max_positions=card.max_position_embeddings,
               session_ttl_s=a.session_ttl, telemetry=telemetry)
    rt.server.start()
    if a.metrics_port:
        serve_metrics(telemetry.registry, a.metrics_port)
    for i, spec in enumerate(a.drafter):
        register_drafter(rt.servicer.registry, rt.servicer.verifier, spec, default=(i == 0))
    if a.drafters_config:
        for d in load_config(a.drafters_config):
            register_drafter(rt.servicer.registry, rt.servicer.verifier, d["address"],
                             name=d.get("name"), version=d.get("version"),
                             weight=float(d.get("weight", 0.0)), default=bool(d.get("default")))
    stop = threading.Event()

    def sweeper():
        while not stop.wait(min(30.0, a.session_ttl / 2)):
            rt.servicer.expire_sessions()

    threading.Thread(target=sweeper, daemon=True, name="session-sweeper").start()
    rt.set_serving(True)
    log.info("SERVING on port %d (verifier %s, drafters: %s)", rt.port, a.verifier,
             ", ".join(e.label for e, _ in rt.servicer.registry.entries()) or "none")
    run_until_signal(rt, a.grace, on_stop=lambda: (stop.set(), telemetry.shutdown()))
