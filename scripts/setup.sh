#!/usr/bin/env bash
# Create .venv and install dflash-serve with its test dependencies. Idempotent (a no-op install
# takes a few seconds). torch is pinned to 2.13.0 and installed first: on this machine kind that
# is a CPU build already on disk; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -E "^WARNING: Location|is ignored" || true
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v -E "^WARNING: Location|is ignored" || true
.venv/bin/python -m pip install -q -e ".[dev,kernels]" 2>&1 | grep -v -E "^WARNING: Location|is ignored" || true
.venv/bin/python -c "import torch, transformers, grpc; assert torch.__version__.startswith('2.13.0'), torch.__version__"
