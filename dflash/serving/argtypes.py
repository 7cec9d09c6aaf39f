"""argparse ``type`` functions for flags: a bad value is refused with an error naming the flag
(argparse adds the name). Standard library only, so the client's CLI imports it without the
server stack."""

from __future__ import annotations

import argparse


def at_least(low: int):
    """argparse ``type`` for an int flag with a lower bound: a smaller value is refused with an
    error naming the flag (argparse adds the name)."""
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


def positive_float(text: str) -> float:
    """argparse ``type`` for a float flag that must be > 0 (refused naming the flag)."""
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::]:8081`` for IPv6) as (host, port). Raises ValueError unless the
    host is non-empty and the port 0-65535."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT with a port 0-65535")
    return host, int(port)


def host_port_or_empty(text: str) -> str:
    """argparse ``type`` for an optional listen address: empty, or :func:`split_host_port`'s
    form, refused naming the flag before the service loads anything."""
    if text:
        try:
            split_host_port(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def in_range(low: int, high: int):
    """argparse ``type`` for an int flag within ``[low, high]`` (refused naming the flag)."""
    def parse(text: str) -> int:
        n = int(text)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n
    return parse


def one_of(choices: tuple[str, ...]):
    """argparse ``type`` for a string flag with fixed choices. Unlike ``choices=``, argparse
    also runs it on a string default (an environment variable's value), so a bad value there
    is refused naming the flag too."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def int_list(low: int = 1, high: int | None = None):
    """argparse ``type`` for a comma-separated list of distinct ints, each ``>= low`` and, when
    given, ``<= high`` (e.g.
    ``--concurrency 1,2,4``); returns it normalised (``"1,2,4"``; ``""`` stays empty: the flag
    unset). A bad item is refused with an error naming the flag (argparse adds the name)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [int(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
        bad = [v for v in values if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {bad[0]}")
        bad = [v for v in values if high is not None and v > high]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be <= {high}, got {bad[0]}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
        return ",".join(map(str, values))
    return parse


def choice_list(choices: tuple[str, ...]):
    """argparse ``type`` for a non-empty comma-separated list of distinct ``choices`` (e.g.
    ``--spec-modes off,adaptive``); returns it normalised (``"off,adaptive"``)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"must name at least one of {', '.join(choices)}")
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} not one of {', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
        return ",".join(items)
    return parse
