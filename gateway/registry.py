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
import json
import random
import threading
from pathlib import Path

from dflash.sampling import InvalidParam


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
