"""`dflash demo` (the README's main job, `./run.sh`) end to end on the tiny models: HumanEval
completions over gRPC, then one chat completion through the OpenAI-compatible HTTP API."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_ports

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_streams_over_grpc_and_http(tmp_path):
    gw, vf, dr, http = free_ports(4)
    r = subprocess.run(
        [sys.executable, "-m", "dflash_app.cli", "demo", "--tiny", "--num-prompts", "1",
         "--max-tokens", "8", "--gateway-port", str(gw), "--verifier-port", str(vf),
         "--drafter-port", str(dr), "--http-port", str(http), "--run-dir", str(tmp_path / "up")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"OpenAI-compatible HTTP API, http://127.0.0.1:{http}/v1" in r.stdout
    assert re.search(r"\[HTTP\] 8 tokens, finish=length, mean acceptance length \d", r.stdout)
    assert "acceptance over 1 prompt: tau" in r.stdout
