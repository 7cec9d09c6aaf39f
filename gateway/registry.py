"""Drafters known to the gateway, and which one a request uses.

Entries come from ``--drafter [name@version=]host:port`` flags, a JSON config file
(``--drafters-config``), or the ``GatewayAdmin`` RPCs. Registration asks the verifier to
``CheckDrafter`` the address, so the gateway refuses exactly what the verifier would refuse.

Resolution per request: an explicit ``name`` or ``name@version``; else, when any weight is set,
a weighted random choice (traffic split); else the default (the first registered, or the one set).
A session sticks to the drafter of its first request while that drafter stays registered.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import random
import threading
from pathlib import Path

from dflash.core.errors import FieldError
from dflash.core.sampling import InvalidParam


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    name: str
    version: str
    address: str
    weight: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


def parse_spec(spec: str) -> tuple[str | None, str]:
    """``"name@version=host:port"`` or ``"host:port"`` -> (label or None, address)."""
    if "=" in spec:
        label, addr = spec.split("=", 1)
        return label.strip(), addr.strip()
    return None, spec.strip()


class NotAllowed(FieldError):
    """A drafter address outside ``--drafter-allow``; maps to PERMISSION_DENIED."""


def split_host_port(address: str) -> tuple[str, int | None]:
    """``"host:port"``, ``"[v6]:port"``, ``"host"`` or a bare IPv6 -> (host, port or None).

    Raises ValueError for a port that is not an integer in [1, 65535]."""
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif address.count(":") == 1:
        host, port = address.split(":")
    else:                                   # a name, an IPv4 or a bare IPv6 address
        host, port = address, None
    if port is not None:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"port {port!r} is not in [1, 65535]")
        return host.lower(), int(port)
    return host.lower(), None


@dataclasses.dataclass(frozen=True)
class DrafterAllowlist:
    """Where drafters may be (``--drafter-allow``): a comma-separated list of ``host:port``
    (exact), ``host`` (a DNS name or IP, any port), or a CIDR network (``10.0.0.0/8``, any
    port). Names are compared as written, never resolved: an address given as a name matches
    only a name entry, so DNS cannot move an allowed name's traffic into a CIDR entry."""

    hosts: frozenset[tuple[str, int | None]]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def parse(cls, text: str) -> "DrafterAllowlist":
        """Raises ValueError naming --drafter-allow and the entry that is malformed."""
        hosts, networks = set(), []
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            try:
                if "/" in item:
                    networks.append(ipaddress.ip_network(item, strict=False))
                else:
                    host, port = split_host_port(item)
                    if not host:
                        raise ValueError("empty host")
                    hosts.add((host, port))
            except ValueError as e:
                raise ValueError(f"--drafter-allow: {item!r}: {e}") from None
        if not hosts and not networks:
            raise ValueError("--drafter-allow: no entry given")
        return cls(frozenset(hosts), tuple(networks))

    def allows(self, address: str) -> bool:
        try:
            host, port = split_host_port(address)
        except ValueError:
            return False
        if (host, port) in self.hosts or (host, None) in self.hosts:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def check(self, address: str) -> None:
        """Raises NotAllowed("address") unless ``address`` is allowed."""
        if not self.allows(address):
            raise NotAllowed("address", f"{address[:64]!r} is not in the drafter allowlist "
                                        "(--drafter-allow)")


def load_config(path: str | Path) -> list[dict]:
    """``{"drafters": [{"address", "name"?, "version"?, "weight"?, "default"?}, ...]}``.

    Raises InvalidParam naming the entry field that is missing or wrong.
    """
    data = json.loads(Path(path).read_text())
    out = []
    for i, d in enumerate(data.get("drafters", [])):
        if not isinstance(d, dict) or not d.get("address"):
            raise InvalidParam(f"drafters[{i}].address", "required")
        w = d.get("weight", 0.0)
        if not isinstance(w, (int, float)) or w < 0:
            raise InvalidParam(f"drafters[{i}].weight", "must be a number >= 0")
        out.append(d)
    return out


class DrafterRegistry:
    """Thread-safe set of drafter entries with a default and traffic weights."""

    def __init__(self, rng: random.Random | None = None):
        self._entries: dict[str, DrafterEntry] = {}
        self._default: str | None = None
        self._lock = threading.Lock()
        self._rng = rng or random.Random()

    def register(self, entry: DrafterEntry, *, default: bool = False) -> None:
        with self._lock:
            self._entries[entry.label] = entry
            if default or self._default is None:
                self._default = entry.label

    def deregister(self, label: str) -> DrafterEntry:
        """Remove ``label``; the default moves to the next entry. Raises InvalidParam."""
        with self._lock:
            e = self._entries.pop(label, None)
            if e is None:
                raise InvalidParam("drafter", f"unknown drafter {label!r}")
            if self._default == label:
                self._default = next(iter(self._entries), None)
            return e

    def set_default(self, label: str) -> DrafterEntry:
        with self._lock:
            if label not in self._entries:
                raise InvalidParam("drafter", f"unknown drafter {label!r}")
            self._default = label
            return self._entries[label]

    def set_weights(self, weights: dict[str, float]) -> None:
        """Replace all weights; entries not named get 0. Raises InvalidParam."""
        with self._lock:
            for label, w in weights.items():
                if label not in self._entries:
                    raise InvalidParam(f"weights[{label}]", "unknown drafter")
                if not w >= 0:
                    raise InvalidParam(f"weights[{label}]", "must be >= 0")
            self._entries = {k: dataclasses.replace(e, weight=float(weights.get(k, 0.0)))
                             for k, e in self._entries.items()}

    def entries(self) -> list[tuple[DrafterEntry, bool]]:
        with self._lock:
            return [(e, e.label == self._default) for e in self._entries.values()]

    def get(self, label: str) -> DrafterEntry | None:
        with self._lock:
            return self._entries.get(label)

    def resolve(self, spec: str) -> DrafterEntry | None:
        """The entry for ``spec`` ("" = traffic split or default; None when none registered).

        Raises InvalidParam("drafter", ...) for an unknown name or version.
        """
        with self._lock:
            if not spec:
                weighted = [e for e in self._entries.values() if e.weight > 0]
                if weighted:
                    return self._rng.choices(weighted, weights=[e.weight for e in weighted])[0]
                return self._entries.get(self._default) if self._default else None
            name, _, version = spec.partition("@")
            matches = [e for e in self._entries.values()
                       if e.name == name and (not version or e.version == version)]
            if not matches:
                known = ", ".join(self._entries) or "none registered"
                raise InvalidParam("drafter", f"unknown drafter {spec!r} (known: {known})")
            # Without a version: the default if it has this name, else the newest registered.
            return next((e for e in matches if e.label == self._default), matches[-1])
