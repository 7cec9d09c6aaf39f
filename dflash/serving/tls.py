"""TLS and mTLS for every gRPC link: server credentials that reload, client channels, dev certs.

Roles and flags (one meaning each, the same in every service):

* **Server side** (``--tls-cert``, ``--tls-key``, ``--tls-ca``; env ``DFLASH_TLS_CERT`` ...):
  cert + key = the service listens with TLS; with ``--tls-ca`` as well it requires a client
  certificate signed by that CA (mTLS). None of them = plaintext, as before.
* **Upstream client side** of the gateway (-> verifier) and the verifier (-> drafters)
  (``--upstream-tls-ca``, ``--upstream-tls-cert``, ``--upstream-tls-key``; env
  ``DFLASH_UPSTREAM_TLS_*``): the CA = connect with TLS and verify the upstream's certificate
  (its host name against the certificate's SANs); cert + key = present them (mTLS).
* Plain clients (``dflash generate``, ``python -m dflash.serving.healthcheck``): ``--tls-ca`` to verify
  the server, ``--tls-cert``/``--tls-key`` for mTLS.

:class:`ServerTLS` serves through ``grpc.dynamic_ssl_server_credentials``: gRPC asks its fetcher
for the configuration at every new handshake, and the fetcher re-reads the files when one of
them changed (or after :meth:`ServerTLS.request_reload`, wired to SIGHUP by
``dflash.serving.server.run_until_signal``), so a renewed certificate is used by the next connection
without a restart; open connections keep theirs. A half-written or invalid replacement is
refused with a warning and the previous certificate stays in use.

:func:`make_dev_certs` (``dflash certs``) writes a development CA and one certificate per role
(gateway, verifier, drafter, client, admin) with the ``cryptography`` package, each carrying its
role's SPIFFE ID as a SAN URI (what ``dflash.serving.authz`` authorizes by) and the key usages of
what it does (:data:`ROLE_USAGES`).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:   # imported where used: the client side never loads cryptography
    from cryptography import x509

    from dflash.serving.authz import PeerIds

log = logging.getLogger("dflash.serving.tls")

DEV_SERVICES = ("gateway", "verifier", "drafter", "client", "admin")
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
# What each role's certificate is for: (server authentication, client authentication). The
# gateway and the verifier serve and call; the drafter only serves; clients and the admin only call.
ROLE_USAGES = {"gateway": (True, True), "verifier": (True, True), "drafter": (True, False),
               "client": (False, True), "admin": (False, True)}


class TLSConfigError(ValueError):
    """A TLS flag names a missing, unreadable or invalid file, or flags are combined wrongly;
    the message names the flag."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TLSConfigError(f"{flag}: cannot read {path}: {e.strerror or e}") from e


def check_pair(cert_pem: bytes, key_pem: bytes, *, cert_flag: str = "--tls-cert",
               key_flag: str = "--tls-key", now: datetime.datetime | None = None) -> None:
    """Refuse a certificate chain / private key pair a handshake would fail on.

    Raises TLSConfigError naming the flag: not PEM, the key not matching the certificate, or the
    certificate outside its validity period (expired, not yet valid) at ``now`` (UTC).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)   # the first of the chain: the leaf
    except ValueError as e:
        raise TLSConfigError(f"{cert_flag}: not a PEM certificate ({e})") from e
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise TLSConfigError(f"{key_flag}: not an unencrypted PEM private key ({e})") from e
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.DER, pub)
            != cert.public_key().public_bytes(serialization.Encoding.DER, pub)):
        raise TLSConfigError(f"{key_flag}: the key does not match the certificate of {cert_flag}")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now > cert.not_valid_after_utc:
        raise TLSConfigError(f"{cert_flag}: certificate expired at "
                             f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC")
    if now < cert.not_valid_before_utc:
        raise TLSConfigError(f"{cert_flag}: certificate not valid before "
                             f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC")


def _check_ca(ca_pem: bytes, flag: str) -> None:
    from cryptography import x509

    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as e:
        raise TLSConfigError(f"{flag}: not a PEM certificate bundle ({e})") from e


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """Paths of a certificate chain, its private key and a CA bundle (each optional).

    ``prefix`` is the flag prefix the paths came from (``--tls`` or ``--upstream-tls``), used in
    error messages.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    prefix: str = "--tls"

    def flag(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)


def file_stamps(paths: list[str]) -> tuple:
    """(mtime, size, inode) of each file, None when missing: an atomic rename over the old file
    changes the inode even within one mtime tick."""
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class ServerTLS:
    """Reloading server credentials from ``files`` (cert + key required, CA = require clients).

    ``peer_ids``: which client certificates hold which role, for the per-RPC authorization of
    an mTLS port (``dflash.serving.authz``; default: each role's SPIFFE ID in the default trust
    domain).

    Raises TLSConfigError (naming the flag) when the key or the certificate is missing, a file
    cannot be read or the pair is invalid (:func:`check_pair`).
    """

    def __init__(self, files: TLSFiles, peer_ids: "PeerIds | None" = None):
        from dflash.serving.authz import PeerIds

        self.peer_ids = peer_ids or PeerIds.parse()
        if not (files.cert or files.key):
            raise TLSConfigError(f"{files.flag('cert')}: needed with {files.flag('ca')} (a TLS "
                                 f"server needs a certificate and its key)")
        if not (files.cert and files.key):
            have, need = ("cert", "key") if files.cert else ("key", "cert")
            raise TLSConfigError(f"{files.flag(need)}: needed with {files.flag(have)}")
        self.files = files
        self.require_client_cert = bool(files.ca)
        self._lock = threading.Lock()
        self._forced = False
        self.reloads = 0                     # configurations replaced after the first
        self.reload_requests = 0             # request_reload() calls: the HTTP API follows them
        self._stamp = self._stamps()
        self._initial = self._load()

    def _paths(self) -> list[str]:
        return [p for p in (self.files.cert, self.files.key, self.files.ca) if p]

    def _stamps(self) -> tuple:
        return file_stamps(self._paths())

    def _load(self):
        f = self.files
        cert, key = _read(f.cert, f.flag("cert")), _read(f.key, f.flag("key"))
        check_pair(cert, key, cert_flag=f.flag("cert"), key_flag=f.flag("key"))
        ca = None
        if f.ca:
            ca = _read(f.ca, f.flag("ca"))
            _check_ca(ca, f.flag("ca"))
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def request_reload(self) -> None:
        """Re-read the files at the next handshake even if they look unchanged (SIGHUP)."""
        with self._lock:
            self._forced = True
            self.reload_requests += 1

    def _fetch(self):
        """gRPC's fetcher, called at each new handshake: a new configuration or None (keep)."""
        with self._lock:
            stamp = self._stamps()
            if stamp == self._stamp and not self._forced:
                return None
            self._stamp, self._forced = stamp, False
            try:
                config = self._load()
            except TLSConfigError as e:   # e.g. the key written, the certificate not yet
                log.warning("certificate reload refused, keeping the current one: %s", e)
                return None
            self.reloads += 1
            log.info("reloaded TLS certificate from %s", self.files.cert)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.require_client_cert)


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """What a client needs to open a TLS channel: the CA that signed the server (``ca``), and
    its own certificate chain and key for mTLS (``cert``/``key``, optional), as PEM bytes.
    ``server_name``: verify the server's certificate for this name instead of the address's
    host (``grpc.ssl_target_name_override``; e.g. a probe through 127.0.0.1)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""

    @classmethod
    def from_files(cls, files: TLSFiles, server_name: str = "") -> "ClientTLS | None":
        """None when no file is given (plaintext). Raises TLSConfigError naming the flag: a cert
        without key or the reverse, client files without a CA, an unreadable or invalid file."""
        if not files.enabled:
            return None
        if bool(files.cert) != bool(files.key):
            have, need = ("cert", "key") if files.cert else ("key", "cert")
            raise TLSConfigError(f"{files.flag(need)}: needed with {files.flag(have)}")
        if not files.ca:
            # A channel verified against the system roots would accept any public certificate
            # for the host; the services' links are meant for one private CA.
            raise TLSConfigError(f"{files.flag('ca')}: needed to verify the server "
                                 f"(given {files.flag('cert')})")
        ca = _read(files.ca, files.flag("ca"))
        _check_ca(ca, files.flag("ca"))
        cert = key = None
        if files.cert:
            cert, key = _read(files.cert, files.flag("cert")), _read(files.key, files.flag("key"))
            check_pair(cert, key, cert_flag=files.flag("cert"), key_flag=files.flag("key"))
        return cls(ca=ca, cert=cert, key=key, server_name=server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel(address: str, tls: ClientTLS | None, options=()) -> grpc.Channel:
    """A channel to ``address``: TLS (verified against ``tls.ca``) when ``tls`` is given,
    plaintext otherwise."""
    options = list(options)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options + tls.options())


# ------------------------------------------------------------------ development certificates
@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes


def _san(hosts, uri: str | None = None) -> "x509.SubjectAlternativeName":
    from cryptography import x509

    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)] if uri else []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str = "dflash-serve development CA", *, days: float = 365) -> Issued:
    """A self-signed CA certificate (EC P-256) valid from now for ``days`` days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(cert=cert.public_bytes(serialization.Encoding.PEM), key=_key_pem(key))


def issue(ca: Issued, common_name: str, hosts, *, days: float = 365,
          not_before: datetime.datetime | None = None, uri: str | None = None,
          server: bool = True, client: bool = True) -> Issued:
    """A certificate for ``hosts`` (SANs: IP addresses or DNS names) signed by ``ca``, valid
    from ``not_before`` (default: now) for ``days`` days (negative: already expired, for tests).

    ``uri``: the identity a SAN URI carries (a SPIFFE ID, ``dflash.serving.authz.spiffe_id``),
    which the services' per-RPC authorization reads; None = none (a certificate no internal
    port authorizes). ``server`` / ``client``: the extended key usages serverAuth / clientAuth
    (key usage: digitalSignature, the X.509-SVID profile's). Raises ValueError when ``hosts``
    is empty or neither usage is asked for."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = list(hosts)
    if not hosts:
        raise ValueError("hosts: at least one host name or IP address is needed")
    usages = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                              (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on]
    if not usages:
        raise ValueError("usage: a certificate for neither server nor client authentication")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=days)
    if days < 0:
        start, end = end - datetime.timedelta(days=1), end
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts, uri), critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Issued(cert=cert.public_bytes(serialization.Encoding.PEM), key=_key_pem(key))


def write_pair(out: Path, stem: str, issued: Issued) -> tuple[Path, Path]:
    """Write ``<stem>.pem`` and ``<stem>-key.pem`` (mode 0600) under ``out``; returns the paths.
    Each file is written beside and renamed into place, so a reloading server never reads half
    of one."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{stem}.pem", out / f"{stem}-key.pem"
    for path, data, mode in ((paths[1], issued.key, 0o600), (paths[0], issued.cert, 0o644)):
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    return paths


def make_dev_certs(out: str | Path, hosts=DEFAULT_HOSTS, *, services=DEV_SERVICES,
                   days: float = 365, trust_domain: str | None = None) -> dict[str, tuple[Path, Path]]:
    """A development CA (``ca.pem``, ``ca-key.pem``) and, per role in ``services`` (keys of
    :data:`ROLE_USAGES`), ``<role>.pem`` and ``<role>-key.pem`` for ``hosts`` plus the role's
    own name (its DNS name in compose and Kubernetes), carrying the role's SPIFFE ID
    ``spiffe://<trust_domain>/dflash/<role>`` as a SAN URI and its key usages (server, client
    or both: :data:`ROLE_USAGES`). Returns ``{"ca" | role: (cert path, key path)}``. Raises
    ValueError on an empty ``hosts``, an unknown role or an invalid trust domain."""
    from dflash.serving.authz import DEFAULT_TRUST_DOMAIN, spiffe_id

    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ValueError("hosts: at least one host name or IP address is needed")
    unknown = [s for s in services if s not in ROLE_USAGES]
    if unknown:
        raise ValueError(f"services: unknown role {unknown[0]!r} (roles: {', '.join(ROLE_USAGES)})")
    domain = trust_domain or DEFAULT_TRUST_DOMAIN
    out = Path(out)
    ca = new_ca(days=days)
    paths = {"ca": write_pair(out, "ca", ca)}
    for s in services:
        server, client = ROLE_USAGES[s]
        paths[s] = write_pair(out, s, issue(ca, f"dflash {s}", list(dict.fromkeys([*hosts, s])),
                                            days=days, uri=spiffe_id(domain, s),
                                            server=server, client=client))
    return paths
