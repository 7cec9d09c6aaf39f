"""The flood tool against separate processes: a gateway and a verifier with small admission
bounds, more streams than they admit; every stream ends completed or refused with
RESOURCE_EXHAUSTED, and the probe process got an answer to every health check."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from dflash_app.flood import main, run_stack_flood


@pytest.mark.slow   # three service processes and 160 streams: ~40 s on 2 cores
def test_flood_of_processes_refuses_excess_and_health_answers(tmp_path):
    import argparse

    a = argparse.Namespace(tiny=True, target=None, drafter=None, streams=160, max_tokens=16,
                           max_batch=8, max_waiting=16, probe_interval=0.05,
                           run_dir=str(tmp_path / "logs"))
    r = run_stack_flood(a)
    assert r.errors == []
    assert r.completed + r.refused == 160
    assert r.completed >= 8 + 16 and r.refused > 0          # the bounds were used and held
    assert len(r.refusal_s) == r.refused and len(r.served_s) == r.completed
    assert len(r.health_s) == 4        # gateway and verifier: service ports, health-only listeners
    for addr, xs in r.health_s.items():
        assert len(xs) >= 5 and all(math.isfinite(x) for x in xs), (addr, xs[-5:])
    assert any(line.startswith("health ") for line in r.lines())
    assert _live_children() == [], "a service outlived the flood's stack"


def _live_children() -> list[str]:
    """Command lines of this process's children that are still running (not zombies)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if int(fields["PPid"]) == os.getpid() and not fields["State"].startswith("Z"):
                out.append((status.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, KeyError, ValueError):
            continue                      # gone meanwhile
    return out


def test_a_stack_refuses_a_second_start(tmp_path):
    """A second ``start`` (``with`` already started it) would spawn a second set of services
    on the same ports and orphan the first, so it is refused before anything is spawned."""
    from dflash_app.launcher import DrafterSpec, LaunchError, LocalStack, StackConfig

    cfg = StackConfig(target="t", drafters=[DrafterSpec(path="d", port=1)], gateway_port=2,
                      verifier_port=3, admin_port=4, run_dir=str(tmp_path))
    stack = LocalStack(cfg)
    stack.procs["drafter0"] = None        # as after a start: a service was spawned
    with pytest.raises(LaunchError, match="already started"):
        stack.start()
    assert list(stack.procs) == ["drafter0"] and _live_children() == []


def test_flood_cli_needs_models():
    with pytest.raises(SystemExit, match="--tiny"):
        main(["--streams", "1"])
