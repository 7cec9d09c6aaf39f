"""Per-RPC authorization on an mTLS port: which service identity may call which RPC.

mTLS alone proves "signed by our CA", which every certificate ``dflash certs`` issues is,
clients' included. Each certificate therefore also carries its holder's identity as a SAN URI,
SPIFFE style: ``spiffe://<trust domain>/dflash/<role>`` (:func:`spiffe_id`; roles are
``gateway``, ``verifier``, ``drafter``, ``client``, ``admin``). Each service declares, in one
table, the role every one of its RPCs needs (``verifier_svc.server.AUTHZ``: every Verifier RPC
from the gateway; ``drafter_svc.server.AUTHZ``: every Drafter RPC from a verifier;
``gateway.server.ADMIN_AUTHZ``: GatewayAdmin from the admin), and :class:`RoleAuthz` enforces it
before the handler runs: a valid certificate of another role gets PERMISSION_DENIED naming the
role needed, an RPC missing from the table is refused for every caller. Health and reflection
need no role (probes present no identity).

:class:`PeerIds` says which SAN URIs hold which role: by default the SPIFFE ID of each role in
one trust domain (``--tls-trust-domain``, default :data:`DEFAULT_TRUST_DOMAIN`), or the
operator's own (``--tls-peer-ids gateway=spiffe://prod.example/ns/llm/sa/gateway,...``, e.g. the
IDs SPIRE or cert-manager's ``uris`` give), with any CA (``--tls-ca``).

Without a client certificate requirement (plaintext, or TLS without ``--tls-ca``) there is no
identity to check and every RPC is served as before; that is for local development on loopback
(docs/deployment.md, "Trust model").
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping

import grpc

ROLES = ("gateway", "verifier", "drafter", "client", "admin")
DEFAULT_TRUST_DOMAIN = "dflash.local"
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
# SPIFFE trust domains: lower-case letters, digits, dots, dashes and underscores.
_TRUST_DOMAIN = re.compile(r"[a-z0-9._-]{1,255}")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S{1,2000}")


class AuthzConfigError(ValueError):
    """A trust domain or peer-id setting that cannot be used; the message names the flag."""


def spiffe_id(trust_domain: str, role: str) -> str:
    """``spiffe://<trust_domain>/dflash/<role>``, the identity ``dflash certs`` gives ``role``.
    Raises AuthzConfigError naming --tls-trust-domain for an invalid trust domain."""
    if not _TRUST_DOMAIN.fullmatch(trust_domain):
        raise AuthzConfigError(f"--tls-trust-domain: {trust_domain[:64]!r} is not a SPIFFE trust "
                               "domain (lower-case letters, digits, '.', '-', '_')")
    return f"spiffe://{trust_domain}/dflash/{role}"


@dataclasses.dataclass(frozen=True)
class PeerIds:
    """Role -> the SAN URIs whose holder has that role (a URI may hold several roles)."""

    ids: Mapping[str, frozenset[str]]

    @classmethod
    def parse(cls, trust_domain: str = DEFAULT_TRUST_DOMAIN, overrides: str = "") -> "PeerIds":
        """Each role's :func:`spiffe_id` in ``trust_domain``, replaced for the roles that
        ``overrides`` names: ``role=URI[,role=URI...]`` (a role named twice holds both URIs).
        Raises AuthzConfigError naming the flag for an unknown role, a value that is not a URI
        or an invalid trust domain."""
        ids = {r: frozenset({spiffe_id(trust_domain, r)}) for r in ROLES}
        given: dict[str, set[str]] = {}
        for part in (p.strip() for p in overrides.split(",")):
            if not part:
                continue
            role, eq, uri = (x.strip() for x in part.partition("="))
            if not eq or role not in ROLES:
                raise AuthzConfigError(f"--tls-peer-ids: {part[:64]!r}: expected ROLE=URI with "
                                       f"ROLE one of {', '.join(ROLES)}")
            if not _URI.fullmatch(uri):
                raise AuthzConfigError(f"--tls-peer-ids: {role}: {uri[:64]!r} is not a URI")
            given.setdefault(role, set()).add(uri)
        ids.update({r: frozenset(u) for r, u in given.items()})
        return cls(ids)

    def roles_of(self, uris: Iterable[str]) -> frozenset[str]:
        """The roles any of ``uris`` holds."""
        have = set(uris)
        return frozenset(r for r, accepted in self.ids.items() if have & accepted)


@dataclasses.dataclass(frozen=True)
class Peer:
    """What a verified client certificate says: its SAN URIs and whether its extended key usage
    allows client authentication (true without the extension, as in TLS itself)."""

    uris: tuple[str, ...]
    client_auth: bool

    @property
    def identity(self) -> str:
        """The first SAN URI, else ``""`` (a certificate without an identity)."""
        return self.uris[0] if self.uris else ""


@functools.lru_cache(maxsize=1024)
def _parse_peer(pem: bytes) -> Peer:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        uris = ()
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client_auth = ExtendedKeyUsageOID.CLIENT_AUTH in eku
    except x509.ExtensionNotFound:
        client_auth = True
    return Peer(uris=uris, client_auth=client_auth)


def peer_of(context) -> Peer | None:
    """The verified client certificate of the call's connection (gRPC's ``x509_pem_cert``
    auth property), None on a connection without one (plaintext, TLS without mTLS)."""
    pems = (context.auth_context() or {}).get("x509_pem_cert")
    return _parse_peer(pems[0]) if pems else None


def caller_identity(context) -> str | None:
    """The caller's identity for ownership checks: its certificate's first SAN URI (``""``
    when it has none); None on a connection without a client certificate."""
    peer = peer_of(context)
    return None if peer is None else peer.identity


def _guard(handler, check: Callable[[object], None]):
    """``handler`` with ``check(context)`` run before its behaviour, whatever its kind."""
    if handler.request_streaming and handler.response_streaming:
        inner_ss = handler.stream_stream

        def stream_stream(requests, context):
            check(context)
            yield from inner_ss(requests, context)
        return handler._replace(stream_stream=stream_stream)
    if handler.response_streaming:
        inner_us = handler.unary_stream

        def unary_stream(request, context):
            check(context)
            yield from inner_us(request, context)
        return handler._replace(unary_stream=unary_stream)
    if handler.request_streaming:
        inner_su = handler.stream_unary

        def stream_unary(requests, context):
            check(context)
            return inner_su(requests, context)
        return handler._replace(stream_unary=stream_unary)
    inner_uu = handler.unary_unary

    def unary_unary(request, context):
        check(context)
        return inner_uu(request, context)
    return handler._replace(unary_unary=unary_unary)


class RoleAuthz(grpc.ServerInterceptor):
    """Every RPC of ``policy`` (full method name -> the role it needs) only from a client
    certificate holding that role (:class:`PeerIds`); PERMISSION_DENIED otherwise, naming the
    role and the identity it expects. Health and reflection are exempt; any other RPC that
    ``policy`` does not name is refused. Install it only on a port that requires client
    certificates (``dflash.serving.server.create_server`` does): a call without one is refused.
    """

    def __init__(self, policy: Mapping[str, str], peer_ids: PeerIds):
        unknown = sorted(set(policy.values()) - set(ROLES))
        if unknown:
            raise ValueError(f"policy: unknown role {unknown[0]!r}")
        self.policy, self.peer_ids = dict(policy), peer_ids
        self.refused = 0

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        role = self.policy.get(method)
        return _guard(handler, functools.partial(self._check, method, role))

    def _check(self, method: str, role: str | None, context) -> None:
        peer = peer_of(context)
        if role is None:
            reason = f"{method}: no role may call it here"
        elif peer is None:
            reason = f"{method}: needs the {role} role (a client certificate)"
        elif not peer.client_auth:
            reason = (f"{method}: needs the {role} role; the caller's certificate is not for "
                      "client authentication (extended key usage)")
        elif role in self.peer_ids.roles_of(peer.uris):
            return
        else:
            expected = ", ".join(sorted(self.peer_ids.ids[role]))
            held = ", ".join(sorted(self.peer_ids.roles_of(peer.uris))) or "none"
            reason = (f"{method}: needs the {role} role ({expected}); the caller's certificate "
                      f"is {(peer.identity or 'without a SAN URI')[:128]} (roles: {held})")
        self.refused += 1
        context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

