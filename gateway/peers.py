"""Who a client is by its address: one form per IP address, whichever port served it (a gRPC
peer string or the HTTP front's TCP peer), so per-client bounds count one client once."""

from __future__ import annotations

import ipaddress
import urllib.parse


def address_identity(host: str) -> str:
    """A client's IP address as ``ipv4:<address>`` or ``ipv6:<address>`` (normalised: one form
    per address, an IPv4-mapped IPv6 address as its IPv4 one, so a dual-stack socket does not
    make one client two); ``unix:`` for an empty host (a Unix socket's client); anything that
    is not an IP address as ``host:<host>``."""
    if not host:
        return "unix:"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"host:{host}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"ipv{ip.version}:{ip.compressed}"


def peer_identity(peer: str) -> str:
    """The client of a gRPC peer string (``context.peer()``) without its port:
    ``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``; ``ipv6:%5B::1%5D:51234`` (gRPC escapes the
    brackets; unescaped is read too) -> ``ipv6:::1`` (:func:`address_identity`'s form, the one
    the HTTP front gives the same client); ``unix:<path>`` is kept whole (every process on a
    Unix socket is one client: the peer names no process); any other scheme too."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    hostport = urllib.parse.unquote(rest)
    if hostport.startswith("["):                 # [v6]:port
        host = hostport[1:].partition("]")[0]
    elif hostport.count(":") == 1:               # v4:port
        host = hostport.partition(":")[0]
    else:                                        # a bare address, no port
        host = hostport
    return address_identity(host) if host else peer
