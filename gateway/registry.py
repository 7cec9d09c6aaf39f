"""Drafters known to the gateway, and which one a request uses.

Entries come from ``--drafter name@version=host:port`` flags (or ``host:port`` alone; the
name and version are then read from the drafter's card). Registration asks the verifier to
``CheckDrafter`` the address, so the gateway refuses exactly what the verifier would refuse.
Resolution: an explicit ``name`` or ``name@version``, else the default (the first registered).
"""

from __future__ import annotations

import dataclasses
import threading

from dflash.sampling import InvalidParam


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    name: str
    version: str
    address: str

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


def parse_spec(spec: str) -> tuple[str | None, str]:
    """``"name@version=host:port"`` or ``"host:port"`` -> (label or None, address)."""
    if "=" in spec:
        label, addr = spec.split("=", 1)
        return label.strip(), addr.strip()
    return None, spec.strip()


class DrafterRegistry:
    def __init__(self):
        self._entries: list[DrafterEntry] = []
        self._default: str | None = None
        self._lock = threading.Lock()

    def register(self, entry: DrafterEntry, *, default: bool = False) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e.label != entry.label] + [entry]
            if default or self._default is None:
                self._default = entry.label

    def entries(self) -> list[tuple[DrafterEntry, bool]]:
        with self._lock:
            return [(e, e.label == self._default) for e in self._entries]

    def resolve(self, spec: str) -> DrafterEntry | None:
        """The entry for ``spec`` ("" = default; None when nothing is registered).

        Raises InvalidParam("drafter", ...) for an unknown name or version.
        """
        with self._lock:
            if not spec:
                return next((e for e in self._entries if e.label == self._default), None)
            name, _, version = spec.partition("@")
            matches = [e for e in self._entries
                       if e.name == name and (not version or e.version == version)]
            if not matches:
                known = ", ".join(e.label for e in self._entries) or "none registered"
                raise InvalidParam("drafter", f"unknown drafter {spec!r} (known: {known})")
            # Without a version: the default if it has this name, else the newest registered.
            dflt = next((e for e in matches if e.label == self._default), None)
            return dflt or matches[-1]
