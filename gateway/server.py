"""Gateway process: tokenizer, drafter registry, sessions; forwards to the verifier.

:func:`build` assembles an unstarted gateway (client port, admin plane, HTTP front);
:func:`main` is ``python -m gateway`` (flags: :mod:`gateway.flags`; the verifier link:
:mod:`gateway.upstream`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import grpc

from dflash.serving.metrics import RoutedRequests
from dflash.serving.server import (
    BindError,
    ServiceRuntime,
    add_health_listener,
    create_server,
    run_until_signal,
    server_tls_from_args,
    tie_server,
    upstream_tls_from_args,
)
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tls import ClientTLS, ServerTLS, TLSConfigError, channel as tls_channel
from dflash.serving.tracing import server_interceptors
from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from gateway.admin import GatewayAdminServicer
from gateway.auth import AdminAuth, ClientAuth, check_admin_bind, load_api_keys
from gateway.client_streams import DEFAULT_STREAMS_PER_CLIENT, ClientStreams
from gateway.flags import admin_token, http_bind, input_limits, parse_args, resent_answers_bytes, served_model_name
from gateway.inputs import DecodeGuard, InputLimits
from gateway.observe import ObservedGatewayServicer
from gateway.registry import DrafterAllowlist, DrafterRegistry, load_config
from gateway.replicas import ReplicaSet, parse_sources
from gateway.resent import ResentAnswers
from gateway.upstream import register_drafter, reregister_drafters

if TYPE_CHECKING:   # imported in _http_front, so importing this module loads no HTTP stack
    from gateway.http_server import HttpServer

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
ADMIN_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name
# The role each admin RPC needs when the admin plane requires client certificates
# (dflash/serving/authz.py), besides the admin token when one is set (gateway/auth.py). The
# client port asks no role: any certificate of the CA, and API keys when set.
ADMIN_AUTHZ = {f"/{ADMIN_SERVICE}/{m}": "admin" for m in (
    "RegisterDrafter", "DeregisterDrafter", "SetDefaultDrafter", "SetDrafterWeights", "ListDrafters")}
log = logging.getLogger("dflash.gateway")


@dataclasses.dataclass
class GatewayRuntime(ServiceRuntime):
    """The gateway's client-port server and what :func:`build` ties to it."""

    admin: ServiceRuntime | None = None             # the GatewayAdmin plane's own server
    drafter_allow: DrafterAllowlist | None = None   # addresses drafters may register at
    verifier_watch: ReplicaSet | None = None       # the verifier replicas, health-watched
    http: HttpServer | None = None                  # the OpenAI-compatible HTTP API, if bound
    client_streams: ClientStreams | None = None     # the per-client stream bound, both ports


def build(tokenizer, verifier_address: str | Sequence[str] | ReplicaSet, bind: str, *,
          max_positions: int,
          session_ttl_s: float = 600.0, telemetry: Telemetry | None = None,
          limits: InputLimits | None = None, vocab_size: int | None = None,
          max_request_mb: int = 8, tls: "ServerTLS | None" = None,
          upstream_tls: "ClientTLS | None" = None, admin_bind: str = "127.0.0.1:0",
          admin_token: str | None = None, drafter_allow: DrafterAllowlist | None = None,
          api_keys: ClientAuth | None = None, http_bind: str | None = None,
          model_name: str = "dflash", max_streams: int = 512, resent_answers_bytes: int = 0,
          max_streams_per_client: int = DEFAULT_STREAMS_PER_CLIENT) -> GatewayRuntime:
    """An unstarted gateway bound to ``bind`` (TLS when ``tls``) calling the verifier at
    ``verifier_address`` (over TLS when ``upstream_tls``): one address, several (replicas,
    routed and failed over: ``gateway.replicas``; ``dns:///name:port`` for every address a
    name resolves to) or a ready ReplicaSet (``rt.verifier_watch``).

    ``http_bind`` ("host:port", port 0 = any free one; None = none): the OpenAI-compatible HTTP
    API (``rt.http``, a gateway.http_server.HttpServer, HTTPS with ``tls``), started and
    stopped with the gRPC server, serving ``model_name`` through the same Generate path, API
    keys and health as the gRPC port.

    ``GatewayAdmin`` is served apart, on ``admin_bind`` (``rt.admin``, started and stopped with
    the gateway's server; the client port answers UNIMPLEMENTED for it): with ``admin_token``
    every admin RPC needs ``authorization: Bearer <token>``; without one ``admin_bind`` must be
    loopback. ``drafter_allow`` restricts the addresses drafters may be registered at;
    ``api_keys`` requires client API keys on the client port (``gateway.auth``).

    ``max_streams``: streams open at once per port (one more: RESOURCE_EXHAUSTED, HTTP 429);
    ``max_streams_per_client``: a client's (API key, else IP) over both ports, 0 = unbounded
    (``gateway.client_streams.ClientStreams``, ``rt.client_streams``); ``resent_answers_bytes``:
    the bound of the tenants' remembered chat answers (``gateway.resent``; 0 = none kept).
    Raises ValueError naming --admin-bind for a non-loopback admin bind without a token, or
    for ``max_streams`` < 1 or ``max_streams_per_client`` < 0; RuntimeError when an address
    cannot be bound.
    """
    check_admin_bind(admin_bind, admin_token)
    verifier = verifier_address if isinstance(verifier_address, ReplicaSet) else ReplicaSet(
        parse_sources([verifier_address] if isinstance(verifier_address, str) else list(verifier_address)),
        upstream_tls=upstream_tls)
    servicer = ObservedGatewayServicer(tokenizer, verifier, DrafterRegistry(), max_positions=max_positions,
                                       session_ttl_s=session_ttl_s, telemetry=telemetry, limits=limits,
                                       vocab_size=vocab_size, model_name=model_name, resent=ResentAnswers(
                                           tokenizer, resent_answers_bytes) if resent_answers_bytes else None)
    if api_keys is not None:
        servicer.identity = api_keys.identity    # the key's name owns the sessions
    rt = _client_port(servicer, bind, api_keys=api_keys, max_streams=max_streams,
                      max_streams_per_client=max_streams_per_client,
                      max_request_mb=max_request_mb, tls=tls)
    admin = GatewayAdminServicer(servicer.registry, lambda address, **kw: register_drafter(
        servicer.registry, verifier, address, timeout_s=5.0, allow=drafter_allow, **kw))
    rt.admin = _admin_plane(rt, admin, admin_bind, admin_token, tls)
    rt.servicer = servicer
    rt.drafter_allow = drafter_allow
    # a replica SERVING first or again (restarted) lacks the drafters: register them there first
    verifier.start(rt, on_serving=lambda r: reregister_drafters(servicer.registry, r.stub))
    rt.verifier_watch = verifier
    if http_bind is not None:
        rt.http = _http_front(rt, servicer, http_bind, model_name=model_name,
                              max_positions=max_positions, api_keys=api_keys, max_streams=max_streams,
                              max_request_mb=max_request_mb, tls=tls)
    return rt


def _client_port(servicer: ObservedGatewayServicer, bind: str, *, api_keys: ClientAuth | None,
                 max_streams: int, max_streams_per_client: int, max_request_mb: int,
                 tls: ServerTLS | None) -> GatewayRuntime:
    """The client port's unstarted server on ``bind``: ``dflash.v1.Gateway`` behind the API
    keys, the per-client stream bound (``rt.client_streams``), the UTF-8 guard and tracing."""
    def add(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)

    # ClientAuth first: an unauthenticated request is refused before anything else reads it
    # (and takes no per-client slot).
    auth: list[grpc.ServerInterceptor] = [api_keys] if api_keys is not None else []
    per_client = ClientStreams(max_streams_per_client, api_keys)
    # A request over max_request_mb is refused by gRPC before it is parsed (RESOURCE_EXHAUSTED).
    rt = cast(GatewayRuntime, create_server(bind, add, (SERVICE,), max_streams=max_streams,
                                            interceptors=auth + [per_client, DecodeGuard()]
                                            + server_interceptors(servicer.tracer_provider),
                                            max_message_mb=max_request_mb, tls=tls, runtime=GatewayRuntime))
    rt.client_streams = per_client
    return rt


def _admin_plane(rt: GatewayRuntime, admin: GatewayAdminServicer, bind: str, token: str | None,
                 tls: ServerTLS | None) -> ServiceRuntime:
    """The GatewayAdmin plane's own server on ``bind``, SERVING, started and stopped with
    ``rt``'s. Raises BindError naming --admin-bind."""
    def add(server):
        gateway_pb2_grpc.add_GatewayAdminServicer_to_server(admin, server)

    try:
        admin_rt = create_server(bind, add, (ADMIN_SERVICE,), max_streams=8,
                                 interceptors=[AdminAuth(token), DecodeGuard()], tls=tls,
                                 authz=ADMIN_AUTHZ)
    except BindError as e:      # its default port is the gateway's + 10: a second gateway needs its own
        raise BindError(f"--admin-bind: {e}") from None
    admin_rt.servicer = admin
    admin_rt.set_serving(True)
    tie_server(rt.server, admin_rt.server)
    return admin_rt


def _http_front(rt: GatewayRuntime, servicer: ObservedGatewayServicer, bind: str, *, model_name: str,
                max_positions: int, api_keys: ClientAuth | None, max_streams: int,
                max_request_mb: int, tls: ServerTLS | None) -> HttpServer:
    """The OpenAI-compatible HTTP API on ``bind`` over ``servicer``, sharing ``rt``'s health and
    per-client stream bound, started and stopped with ``rt``'s server."""
    from gateway.http_server import HttpServer  # here: importing this module loads no HTTP stack
    from gateway.openai_api import OpenAIFront

    front = OpenAIFront(servicer, model_name=model_name, max_positions=max_positions,
                        serving=lambda: rt.serving, api_keys=api_keys, max_streams=max_streams,
                        client_streams=rt.client_streams, max_request_bytes=max_request_mb << 20)
    http = HttpServer(front.app, bind, tls=tls, on_stop=front.close)
    http.front = front
    tie_server(rt.server, http)
    return http


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    tls, upstream_tls, token, keys = _credentials(a)
    tok = AutoTokenizer.from_pretrained(a.target)
    try:
        replicas = ReplicaSet(parse_sources(a.verifier, a.verifiers_file), upstream_tls=upstream_tls,
                              routing=a.routing)
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m gateway: error: {e}") from None
    card = _first_card(replicas, upstream_tls)
    telemetry = Telemetry.from_env("gateway")
    RoutedRequests(telemetry.registry, replicas.routed_counts)
    try:        # a port that is taken, out of range or unparsable: one line naming the flag
        rt = build(tok, replicas, a.bind, max_positions=card.max_position_embeddings,
                   session_ttl_s=a.session_ttl, telemetry=telemetry, limits=input_limits(a),
                   vocab_size=card.vocab_size, max_request_mb=a.max_request_mb, tls=tls,
                   upstream_tls=upstream_tls, admin_bind=a.admin_bind, admin_token=token,
                   drafter_allow=a.drafter_allow, api_keys=keys, http_bind=http_bind(a),
                   model_name=served_model_name(a), max_streams=a.max_streams,
                   max_streams_per_client=a.max_streams_per_client,
                   resent_answers_bytes=resent_answers_bytes(a))
        add_health_listener(rt, a.health_bind)
    except BindError as e:
        raise SystemExit(f"python -m gateway: error: {e}") from None
    rt.server.start()
    assert rt.admin is not None                       # build always binds the admin plane
    log.info("admin plane (GatewayAdmin) on %s:%d, %s", a.admin_bind.rpartition(":")[0],
             rt.admin.port, "token required" if token else
             "loopback only, no token (set --admin-token-file to require one)")
    if keys is None:
        log.warning("no --api-keys-file: any client reaching port %d may generate", rt.port)
    if a.metrics_port:
        serve_metrics(telemetry.registry, a.metrics_port, a.metrics_host)
    _register_drafters(rt, a)
    stop = threading.Event()

    def sweeper():
        while not stop.wait(min(30.0, a.session_ttl / 2)):
            rt.servicer.expire_sessions()

    threading.Thread(target=sweeper, daemon=True, name="session-sweeper").start()
    rt.set_serving(True)
    log.info("SERVING on port %d (verifiers %s, routing %s, drafters: %s)", rt.port,
             ", ".join(replicas.replicas) or "none yet", a.routing,
             ", ".join(e.label for e, _ in rt.servicer.registry.entries()) or "none")
    if rt.http is not None:
        log.info("HTTP API (OpenAI-compatible) on %s/v1, model %r", rt.http.url,
                 rt.http.front.model_name)
    def on_stop() -> None:
        stop.set()
        telemetry.shutdown()

    run_until_signal(rt, a.grace, on_stop=on_stop)


def _first_card(replicas: ReplicaSet, upstream_tls: ClientTLS | None, timeout_s: float = 600.0):
    """The target card of the first replica to become healthy (they serve one target: each
    replica checks every drafter against its own). Exits when none does in ``timeout_s``."""
    from dflash.serving.server import wait_healthy

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for address in list(replicas.replicas):
            if wait_healthy(address, 1.0, tls=upstream_tls):
                with tls_channel(address, upstream_tls) as ch:
                    return verifier_pb2_grpc.VerifierStub(ch).Describe(
                        verifier_pb2.DescribeTargetRequest(), timeout=10)
        if not replicas.replicas:
            time.sleep(1.0)
            replicas.refresh()            # a DNS name or file with nobody in it yet
    raise SystemExit(f"no verifier of {', '.join(replicas.replicas) or 'the --verifier sources'} "
                     "became healthy")


def _credentials(a: argparse.Namespace
                 ) -> tuple[ServerTLS | None, ClientTLS | None, str | None, ClientAuth | None]:
    """(server TLS, verifier TLS, admin token, API keys) the flags ask for; exits with one line
    naming the flag when one is wrong."""
    try:
        tls, upstream_tls = server_tls_from_args(a), upstream_tls_from_args(a)
    except TLSConfigError as e:
        raise SystemExit(f"python -m gateway: error: {e}") from None
    try:
        token = admin_token(a)
        check_admin_bind(a.admin_bind, token)
        keys = ClientAuth(load_api_keys(a.api_keys_file)) if a.api_keys_file else None
    except ValueError as e:
        raise SystemExit(f"python -m gateway: error: {e}") from None
    return tls, upstream_tls, token, keys


def _register_drafters(rt: GatewayRuntime, a: argparse.Namespace) -> None:
    """Register the --drafter addresses (the first the default), then --drafters-config's."""
    for i, spec in enumerate(a.drafter):
        register_drafter(rt.servicer.registry, rt.servicer.verifier, spec, default=(i == 0),
                         allow=rt.drafter_allow)
    if a.drafters_config:
        for d in load_config(a.drafters_config):
            register_drafter(rt.servicer.registry, rt.servicer.verifier, d["address"],
                             name=d.get("name"), version=d.get("version"),
                             weight=float(d.get("weight", 0.0)), default=bool(d.get("default")),
                             allow=rt.drafter_allow)


__all__ = ["ADMIN_AUTHZ", "GatewayRuntime", "build", "http_bind", "main", "parse_args",
           "register_drafter", "reregister_drafters"]
