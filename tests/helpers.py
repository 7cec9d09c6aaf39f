"""Helpers shared by the deployment tests (compose, Kubernetes): not a test module."""

from __future__ import annotations


def host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


class RecordingEnviron(dict):
    """os.environ stand-in that records every name the code looks up."""

    def __init__(self, values):
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)
