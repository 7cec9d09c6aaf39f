#!/usr/bin/env bash
# Create .venv and install dflash-serve with every extra the tests and `dflash demo` use, at the
# exact versions of constraints.txt (pyproject.toml holds ranges only). Idempotent (a no-op
# install takes a few seconds). torch is installed first, at its constrained version: on this
# machine kind that is a CPU build already on disk; an unpinned torch would pull a multi-GB CUDA
# build. Extras: serve (the services and the `dflash` command: the core alone is the torch-free
# client), bench (demo, bench), train, setup (setup-target), kernels, dev (the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip, minus this machine's "Location ... is ignored" noise and setuptools' boxed warning about
# editable installs (it reads like an error on a first ./run.sh); a failed install fails the
# script (pip's own status is returned).
pip_install() {
  .venv/bin/python -m pip install -q "$@" 2>&1 | awk '
    /BuildBackendWarning: Editable installation/ { skip = 1 }
    !skip && !/^WARNING: Location|is ignored/ { print }
    skip && /WheelFile\(/ { skip = 0 }'
  return "${PIPESTATUS[0]}"
}
# A second run with the same pins, in the same checkout, installs nothing: the stamp saves
# rebuilding the editable wheel (and setuptools' warning block) on every ./run.sh.
STAMP=.venv/.dflash-setup
want=$( { pwd; cat pyproject.toml constraints.txt; } | sha256sum | cut -c1-64)
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  pip_install --upgrade pip
  pip_install -c constraints.txt torch
  pip_install -c constraints.txt -e ".[dev,serve,bench,train,setup,kernels]"
fi
.venv/bin/python -c "import torch, transformers, grpc; assert torch.__version__.startswith('2.13.0'), torch.__version__"
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check >&2; exit 1; }
echo "$want" > "$STAMP"
