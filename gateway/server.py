"""Gateway process: tokenizer, drafter registry, sessions; forwards to the verifier."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.serving.argtypes import at_least, in_range
from dflash.serving.server import (
    BindError,
    ServiceRuntime,
    add_common_args,
    add_health_listener,
    add_upstream_tls_args,
    channel_options,
    create_server,
    run_until_signal,
    server_tls_from_args,
    tie_server,
    upstream_tls_from_args,
)
from dflash.serving.telemetry import Telemetry, serve_metrics
from dflash.serving.tls import ClientTLS, ServerTLS, TLSConfigError, channel as tls_channel
from dflash.serving.tracing import InjectTraceContext, server_interceptors
from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from gateway.admin import GatewayAdminServicer
from gateway.auth import (
    DEFAULT_STREAMS_PER_CLIENT,
    AdminAuth,
    ClientAuth,
    ClientStreams,
    check_admin_bind,
    check_secret,
    load_api_keys,
    read_secret,
)
from gateway.inputs import OWNER_PREFIX_CHARS, DecodeGuard, InputLimits
from gateway.observe import ObservedGatewayServicer
from gateway.registry import DrafterAllowlist, DrafterEntry, DrafterRegistry, load_config, parse_spec

if TYPE_CHECKING:   # imported in build, so importing this module loads no HTTP stack
    from gateway.http_server import HttpServer

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
ADMIN_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name
# The role each admin RPC needs when the admin plane requires client certificates
# (dflash/serving/authz.py), besides the admin token when one is set (gateway/auth.py). The
# client port asks no role: any certificate of the CA, and API keys when set.
ADMIN_AUTHZ = {f"/{ADMIN_SERVICE}/{m}": "admin" for m in (
    "RegisterDrafter", "DeregisterDrafter", "SetDefaultDrafter", "SetDrafterWeights", "ListDrafters")}
log = logging.getLogger("dflash.gateway")


def register_drafter(registry: DrafterRegistry, verifier, spec: str, *, name: str | None = None,
                     version: str | None = None, weight: float = 0.0, default: bool = False,
                     timeout_s: float = 60.0, allow: DrafterAllowlist | None = None) -> DrafterEntry:
    """Check ``spec`` ("[name@version=]host:port") with the verifier and register it.

    The verifier's CheckDrafter calls the drafter's Describe and applies the same checks it
    applies before speculating; the verifier then accepts this address in Generate requests.
    Raises gateway.registry.NotAllowed("address") when ``allow`` is given and the address is
    not in it (checked first: nothing contacts a refused address), grpc.RpcError:
    FAILED_PRECONDITION (does not fit the target, the message names the field) or UNAVAILABLE
    (not reachable within ``timeout_s``).
    """
    label, address = parse_spec(spec)
    if allow is not None:
        allow.check(address)
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


@dataclasses.dataclass
class GatewayRuntime(ServiceRuntime):
    """The gateway's client-port server and what :func:`build` ties to it."""

    admin: ServiceRuntime | None = None             # the GatewayAdmin plane's own server
    drafter_allow: DrafterAllowlist | None = None   # addresses drafters may register at
    verifier_watch: VerifierHealthWatch | None = None
    http: HttpServer | None = None                  # the OpenAI-compatible HTTP API, if bound
    client_streams: ClientStreams | None = None     # the per-client stream bound, both ports


def build(tokenizer, verifier_address: str, bind: str, *, max_positions: int,
          session_ttl_s: float = 600.0, telemetry: Telemetry | None = None,
          limits: InputLimits | None = None, vocab_size: int | None = None,
          max_request_mb: int = 8, tls: "ServerTLS | None" = None,
          upstream_tls: "ClientTLS | None" = None, admin_bind: str = "127.0.0.1:0",
          admin_token: str | None = None, drafter_allow: DrafterAllowlist | None = None,
          api_keys: ClientAuth | None = None, http_bind: str | None = None,
          model_name: str = "dflash", max_streams: int = 512,
          max_streams_per_client: int = DEFAULT_STREAMS_PER_CLIENT) -> GatewayRuntime:
    """An unstarted gateway bound to ``bind`` (TLS when ``tls``) calling the verifier at
    ``verifier_address`` (over TLS when ``upstream_tls``).

    ``http_bind`` ("host:port", port 0 = any free one; None = none): the OpenAI-compatible HTTP
    API (``rt.http``, a gateway.http_server.HttpServer, HTTPS with ``tls``), started and
    stopped with the gRPC server, serving ``model_name`` through the same Generate path, API
    keys and health as the gRPC port.

    ``GatewayAdmin`` is served apart, on ``admin_bind`` (``rt.admin``, started and stopped with
    the gateway's server; the client port answers UNIMPLEMENTED for it): with ``admin_token``
    every admin RPC needs ``authorization: Bearer <token>``; without one ``admin_bind`` must be
    loopback. ``drafter_allow`` restricts the addresses drafters may be registered at;
    ``api_keys`` requires client API keys on the client port (``gateway.auth``).

    ``max_streams``: response streams open at once on the gRPC port, and generations on the
    HTTP port (each counts its own: each has its own worker threads); one more is refused at
    once (RESOURCE_EXHAUSTED, HTTP 429). ``max_streams_per_client``: Generate streams one
    client (its API key, else its IP address) may have open over both ports together, 0 =
    unbounded (``gateway.auth.ClientStreams``, ``rt.client_streams``).

    Raises ValueError naming --admin-bind for a non-loopback admin bind without a token, or
    for ``max_streams`` < 1 or ``max_streams_per_client`` < 0; RuntimeError when an address
    cannot be bound.
    """
    from gateway.http_server import HttpServer
    from gateway.openai_api import OpenAIFront

    check_admin_bind(admin_bind, admin_token)
    raw = tls_channel(verifier_address, upstream_tls, options=channel_options() + FAST_RECONNECT)
    channel = grpc.intercept_channel(raw, InjectTraceContext())  # W3C traceparent to the verifier
    verifier = verifier_pb2_grpc.VerifierStub(channel)
    servicer = ObservedGatewayServicer(tokenizer, verifier, DrafterRegistry(), max_positions=max_positions,
                                       session_ttl_s=session_ttl_s, telemetry=telemetry,
                                       limits=limits, vocab_size=vocab_size, model_name=model_name)
    if api_keys is not None:
        servicer.identity = api_keys.identity    # the key's name owns the sessions
    admin = GatewayAdminServicer(servicer.registry, lambda address, **kw: register_drafter(
        servicer.registry, verifier, address, timeout_s=5.0, allow=drafter_allow, **kw))

    def add(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)

    def add_admin(server):
        gateway_pb2_grpc.add_GatewayAdminServicer_to_server(admin, server)

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
    try:
        rt.admin = admin_rt = create_server(admin_bind, add_admin, (ADMIN_SERVICE,), max_streams=8,
                                            interceptors=[AdminAuth(admin_token), DecodeGuard()], tls=tls,
                                            authz=ADMIN_AUTHZ)
    except BindError as e:      # its default port is the gateway's + 10: a second gateway needs its own
        raise BindError(f"--admin-bind: {e}") from None
    admin_rt.servicer = admin
    admin_rt.set_serving(True)
    tie_server(rt.server, admin_rt.server)
    rt.servicer = servicer
    rt.drafter_allow = drafter_allow
    rt.verifier_watch = VerifierHealthWatch(
        rt, raw, on_serving=lambda: reregister_drafters(servicer.registry, verifier))
    if http_bind is not None:
        front = OpenAIFront(servicer, model_name=model_name, max_positions=max_positions,
                            serving=lambda: rt.serving, api_keys=api_keys,
                            max_streams=max_streams, client_streams=per_client,
                            max_request_bytes=max_request_mb << 20)
        rt.http = http = HttpServer(front.app, http_bind, tls=tls, on_stop=front.close)
        http.front = front
        tie_server(rt.server, http)
    return rt


def reregister_drafters(registry: DrafterRegistry, verifier) -> int:
    """CheckDrafter every registered address again (a restarted verifier forgot them and
    would refuse their Generate requests); returns how many the verifier accepted. A drafter
    it refuses now stays registered here: its requests fall back to no speculation."""
    ok = 0
    for e, _ in registry.entries():
        try:
            verifier.CheckDrafter(verifier_pb2.CheckDrafterRequest(address=e.address), timeout=5)
            ok += 1
        except grpc.RpcError as err:
            log.warning("re-registering drafter %s at %s: %s", e.label, e.address, err.details())
    return ok


# The verifier's channel retries a lost connection at least every 200 ms (gRPC's default
# back-off grows to minutes), so a restarted verifier is used again within the watch's 0.5 s.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 200)]


class VerifierHealthWatch:
    """Honest health: the gateway reports SERVING only while its verifier does.

    A background thread checks the verifier's ``grpc.health.v1`` (overall status) every
    ``interval_s`` over the channel requests use, each check bounded by ``timeout_s``, and sets
    ``rt.set_upstream``: NOT_SERVING while the verifier is unreachable, slow to answer or not
    SERVING, SERVING again on the first good answer. No request waits for it. The thread ends
    when the gateway's server stops (``wait_for_termination``). ``on_serving`` runs (on the
    thread) each time the verifier is SERVING again after it was not.
    """

    def __init__(self, rt, channel: grpc.Channel, *, interval_s: float = 0.1,
                 timeout_s: float = 0.5, on_serving=None):
        self.rt, self.interval_s, self.timeout_s = rt, interval_s, timeout_s
        self.on_serving = on_serving
        self._stub = health_pb2_grpc.HealthStub(channel)
        self.healthy: bool | None = None      # None until the first check
        self.checks = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="verifier-health")
        self._thread.start()

    def check(self) -> bool:
        try:
            r = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _run(self) -> None:
        while True:
            ok = self.check()
            self.checks += 1
            if ok != self.healthy:
                if self.healthy is not None or not ok:
                    log.warning("verifier %s: gateway %s", "SERVING" if ok else "not SERVING",
                                "SERVING again" if ok else "NOT_SERVING")
                if ok and self.healthy is False and self.on_serving is not None:
                    self.on_serving()    # before SERVING: a restarted verifier knows the drafters
                self.healthy = ok
                self.rt.set_upstream(ok)
            if not self.rt.server.wait_for_termination(self.interval_s):   # False: it stopped
                return


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
    # The OpenAI-compatible HTTP API (gateway.openai_api), beside the gRPC port.
    p.add_argument("--http-port", type=in_range(0, 65535), default=env("DFLASH_HTTP_PORT", "8000"),
                   help="port of the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health); 0 = off [DFLASH_HTTP_PORT]")
    p.add_argument("--http-host", default=env("DFLASH_HTTP_HOST") or None,
                   help="host the HTTP API listens on; default: the host of --bind "
                        "[DFLASH_HTTP_HOST]")
    p.add_argument("--served-model-name", default=env("DFLASH_SERVED_MODEL_NAME") or None,
                   help="the model name HTTP clients send; default: the --target directory's "
                        "name [DFLASH_SERVED_MODEL_NAME]")
    p.add_argument("--session-ttl", type=float, default=float(env("DFLASH_SESSION_TTL_S", "600")),
                   help="idle session lifetime, seconds [DFLASH_SESSION_TTL_S]")
    # Who may call what (gateway.auth): the admin plane apart, drafter addresses, client keys.
    p.add_argument("--admin-bind", default=env("DFLASH_ADMIN_BIND", "127.0.0.1:50060"),
                   help="host:port of the GatewayAdmin service (never on --bind); without a "
                        "token it must be loopback [DFLASH_ADMIN_BIND]")
    p.add_argument("--admin-token-file", default=env("DFLASH_ADMIN_TOKEN_FILE") or None,
                   help="file holding the admin token: every admin RPC then needs "
                        "'authorization: Bearer <token>' (or give the token itself in "
                        "DFLASH_ADMIN_TOKEN) [DFLASH_ADMIN_TOKEN_FILE]")
    p.add_argument("--drafter-allow", type=_allowlist, default=env("DFLASH_DRAFTER_ALLOW") or None,
                   help="comma-separated addresses drafters may be registered at: host:port, "
                        "host (any port) or CIDR; default any [DFLASH_DRAFTER_ALLOW]")
    p.add_argument("--api-keys-file", default=env("DFLASH_API_KEYS_FILE") or None,
                   help="client API keys, one a line: 'key [name [max_concurrency "
                        "[rate_per_s]]]'; clients then need 'authorization: Bearer <key>' "
                        "[DFLASH_API_KEYS_FILE]")
    # Overload: streams open at once, in all and per client (gateway.auth.ClientStreams).
    p.add_argument("--max-streams", type=at_least(1), default=env("DFLASH_MAX_STREAMS", "512"),
                   help="Generate streams open at once on the gRPC port, and generations on the "
                        "HTTP port (each its own count); more are refused at once with "
                        "RESOURCE_EXHAUSTED / HTTP 429 and a retry hint, and health and unary "
                        "RPCs keep their own threads [DFLASH_MAX_STREAMS]")
    p.add_argument("--max-streams-per-client", type=at_least(0),
                   default=env("DFLASH_MAX_STREAMS_PER_CLIENT", str(DEFAULT_STREAMS_PER_CLIENT)),
                   help="Generate streams one client may have open, both ports together; the "
                        "client is its API key, else its IP address; more are refused at once "
                        "like --max-streams; 0 = unbounded; default "
                        f"{DEFAULT_STREAMS_PER_CLIENT} [DFLASH_MAX_STREAMS_PER_CLIENT]")
    # Input bounds, checked before tokenisation (gateway.inputs.InputLimits).
    d = InputLimits()
    for flag, var, default, what in [
            ("--max-request-mb", "DFLASH_MAX_REQUEST_MB", 8, "largest request message, MiB "
             "(refused by gRPC with RESOURCE_EXHAUSTED)"),
            ("--max-prompt-chars", "DFLASH_MAX_PROMPT_CHARS", d.max_prompt_chars,
             "characters of a prompt, or of all chat contents together"),
            ("--max-chat-messages", "DFLASH_MAX_CHAT_MESSAGES", d.max_chat_messages,
             "messages in a chat"),
            ("--max-stop-strings", "DFLASH_MAX_STOP_STRINGS", d.max_stop_strings,
             "stop strings in a request"),
            ("--max-stop-chars", "DFLASH_MAX_STOP_CHARS", d.max_stop_chars,
             "characters of one stop string"),
            ("--max-stop-token-ids", "DFLASH_MAX_STOP_TOKEN_IDS", d.max_stop_token_ids,
             "stop token ids in a request"),
            ("--max-session-id-chars", "DFLASH_MAX_SESSION_ID_CHARS", d.max_session_id_chars,
             "characters of a session_id (A-Z a-z 0-9 . _ : -; at most 1007: the verifier "
             "allows 1024 and the gateway prefixes 17 naming the owner)"),
            ("--max-name-chars", "DFLASH_MAX_NAME_CHARS", d.max_name_chars,
             "characters of a drafter name"),
            ("--max-n", "DFLASH_MAX_N", d.max_n, "samples of one request (n)")]:
        p.add_argument(flag, type=in_range(1, 1024 - OWNER_PREFIX_CHARS) if flag == "--max-session-id-chars"
                       else at_least(1), default=env(var, str(default)),
                       help=f"{what}; default {default} [{var}]")
    add_common_args(p)
    add_upstream_tls_args(p, "verifier")
    return p.parse_args(argv)


def _allowlist(text: str) -> DrafterAllowlist:
    """argparse ``type`` of --drafter-allow (an error keeps its message)."""
    try:
        return DrafterAllowlist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--drafter-allow: ")) from None


def admin_token(a: argparse.Namespace, env=os.environ) -> str | None:
    """The admin token: --admin-token-file, else DFLASH_ADMIN_TOKEN, else None.

    Raises ValueError naming the flag or variable (unreadable, shorter than 16 characters)."""
    if a.admin_token_file:
        return read_secret(a.admin_token_file, "--admin-token-file")
    token = env.get("DFLASH_ADMIN_TOKEN", "").strip()
    if token:
        check_secret(token, "DFLASH_ADMIN_TOKEN")
        return token
    return None


def http_bind(a: argparse.Namespace) -> str | None:
    """host:port of the HTTP API the flags ask for (None: --http-port 0, off)."""
    if not a.http_port:
        return None
    host = a.http_host or a.bind.rpartition(":")[0]
    return f"{host}:{a.http_port}"


def served_model_name(a: argparse.Namespace) -> str:
    return a.served_model_name or os.path.basename(os.path.normpath(a.target))


def input_limits(a: argparse.Namespace) -> InputLimits:
    """The InputLimits the parsed flags ask for."""
    return InputLimits(max_prompt_chars=a.max_prompt_chars, max_chat_messages=a.max_chat_messages,
                       max_stop_strings=a.max_stop_strings, max_stop_chars=a.max_stop_chars,
                       max_stop_token_ids=a.max_stop_token_ids,
                       max_session_id_chars=a.max_session_id_chars, max_name_chars=a.max_name_chars,
                       max_n=a.max_n)


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from dflash.serving.server import wait_healthy

    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
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
    tok = AutoTokenizer.from_pretrained(a.target)
    if not wait_healthy(a.verifier, 600, tls=upstream_tls):
        raise SystemExit(f"verifier at {a.verifier} did not become healthy")
    with tls_channel(a.verifier, upstream_tls) as ch:
        card = verifier_pb2_grpc.VerifierStub(ch).Describe(verifier_pb2.DescribeTargetRequest(), timeout=10)
    telemetry = Telemetry.from_env("gateway")
    try:        # a port that is taken, out of range or unparsable: one line naming the flag
        rt = build(tok, a.verifier, a.bind, max_positions=card.max_position_embeddings,
                   session_ttl_s=a.session_ttl, telemetry=telemetry, limits=input_limits(a),
                   vocab_size=card.vocab_size, max_request_mb=a.max_request_mb, tls=tls,
                   upstream_tls=upstream_tls, admin_bind=a.admin_bind, admin_token=token,
                   drafter_allow=a.drafter_allow, api_keys=keys, http_bind=http_bind(a),
                   model_name=served_model_name(a), max_streams=a.max_streams,
                   max_streams_per_client=a.max_streams_per_client)
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
    for i, spec in enumerate(a.drafter):
        register_drafter(rt.servicer.registry, rt.servicer.verifier, spec, default=(i == 0),
                         allow=rt.drafter_allow)
    if a.drafters_config:
        for d in load_config(a.drafters_config):
            register_drafter(rt.servicer.registry, rt.servicer.verifier, d["address"],
                             name=d.get("name"), version=d.get("version"),
                             weight=float(d.get("weight", 0.0)), default=bool(d.get("default")),
                             allow=rt.drafter_allow)
    stop = threading.Event()

    def sweeper():
        while not stop.wait(min(30.0, a.session_ttl / 2)):
            rt.servicer.expire_sessions()

    threading.Thread(target=sweeper, daemon=True, name="session-sweeper").start()
    rt.set_serving(True)
    log.info("SERVING on port %d (verifier %s, drafters: %s)", rt.port, a.verifier,
             ", ".join(e.label for e, _ in rt.servicer.registry.entries()) or "none")
    if rt.http is not None:
        log.info("HTTP API (OpenAI-compatible) on %s/v1, model %r", rt.http.url,
                 rt.http.front.model_name)
    def on_stop() -> None:
        stop.set()
        telemetry.shutdown()

    run_until_signal(rt, a.grace, on_stop=on_stop)
