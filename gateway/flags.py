"""The gateway's command line (``python -m gateway``): flags, each with its environment
variable, and what the parsed flags ask for (admin token, HTTP bind, model name, input bounds)."""

from __future__ import annotations

import argparse
import os

from dflash.serving.argtypes import at_least, in_range, one_of, positive_float
from dflash.serving.server import add_common_args, add_upstream_tls_args
from gateway.auth import check_secret, read_secret
from gateway.client_streams import DEFAULT_STREAMS_PER_CLIENT
from gateway.inputs import OWNER_PREFIX_CHARS, InputLimits
from gateway.registry import DrafterAllowlist
from gateway.routing import ROUTINGS


def parse_args(argv=None) -> argparse.Namespace:
    """The gateway's flags (``argv``; None: the process's). Exits 2 naming a bad flag."""
    # no abbreviations: a new flag must never capture what an older one was spelt as
    p = argparse.ArgumentParser(prog="python -m gateway", description="DFlash gateway service", allow_abbrev=False)
    _add_routing_args(p)
    _add_access_args(p)
    _add_overload_args(p)
    _add_input_bound_args(p)
    add_common_args(p)
    add_upstream_tls_args(p, "verifier")
    a = p.parse_args(argv)
    if not a.verifier:       # an append flag's default would be extended, not replaced
        a.verifier = [] if a.verifiers_file else [
            s for s in os.environ.get("DFLASH_VERIFIER_ADDR", "127.0.0.1:50051").split(",") if s]
    return a


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """The target, the verifier and drafters, the ports, sessions."""
    env = os.environ.get
    p.add_argument("--target", default=env("DFLASH_TARGET"), required=env("DFLASH_TARGET") is None,
                   help="target model directory (its tokenizer and chat template) [DFLASH_TARGET]")
    p.add_argument("--verifier", action="append", default=None,
                   help="verifier replica: host:port, or dns:///name:port for every address the "
                        "name resolves to (a headless Service; re-resolved each second); repeat "
                        "for several (gateway.replicas) [DFLASH_VERIFIER_ADDR, comma separated; "
                        "default 127.0.0.1:50051]")
    p.add_argument("--verifiers-file", default=env("DFLASH_VERIFIERS_FILE") or None,
                   help="file of verifier replicas, one 'host:port [drain]' a line, re-read each "
                        "second ('drain': no new requests, its streams finish) "
                        "[DFLASH_VERIFIERS_FILE]")
    p.add_argument("--routing", default=env("DFLASH_ROUTING", "score"), type=one_of(ROUTINGS),
                   help="how a request picks its verifier replica: score (load, prefix affinity, "
                        "session_id sticky; gateway.routing) or round-robin (each the next in "
                        "turn, nothing else: a baseline) [DFLASH_ROUTING]")
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
    p.add_argument("--resent-answers", default=env("DFLASH_RESENT_ANSWERS", "off"),
                   type=one_of(("on", "off")),
                   help="remember each tenant's recent chat answers as the ids the target "
                        "generated, and use them when a later chat resends the answer as text "
                        "(its prefix then matches the verifier's cache; the prompt ids then depend on "
                        "what the gateway remembers; docs/prefix-cache.md) [DFLASH_RESENT_ANSWERS]")
    p.add_argument("--resent-answers-mb", type=positive_float,
                   default=env("DFLASH_RESENT_ANSWERS_MB", "64"),
                   help="MiB of remembered turns (prompt text and ids), all tenants together; "
                        "past it the least recently used go first [DFLASH_RESENT_ANSWERS_MB]")


def _add_access_args(p: argparse.ArgumentParser) -> None:
    """Who may call what (gateway.auth): the admin plane apart, drafter addresses, client keys."""
    env = os.environ.get
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


def _add_overload_args(p: argparse.ArgumentParser) -> None:
    """Streams open at once, in all and per client (gateway.client_streams.ClientStreams)."""
    env = os.environ.get
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


def _add_input_bound_args(p: argparse.ArgumentParser) -> None:
    """Input bounds, checked before tokenisation (gateway.inputs.InputLimits)."""
    env = os.environ.get
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


def resent_answers_bytes(a: argparse.Namespace) -> int:
    """The bound of the resent-answer memory the flags ask for, bytes (0: off)."""
    return int(a.resent_answers_mb * (1 << 20)) if a.resent_answers == "on" else 0


def input_limits(a: argparse.Namespace) -> InputLimits:
    """The InputLimits the parsed flags ask for."""
    return InputLimits(max_prompt_chars=a.max_prompt_chars, max_chat_messages=a.max_chat_messages,
                       max_stop_strings=a.max_stop_strings, max_stop_chars=a.max_stop_chars,
                       max_stop_token_ids=a.max_stop_token_ids,
                       max_session_id_chars=a.max_session_id_chars, max_name_chars=a.max_name_chars,
                       max_n=a.max_n)
