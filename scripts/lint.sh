#!/usr/bin/env bash
# Lint and type checks: ruff (pyflakes, import order, bugbear; ruff.toml) on the whole
# repository, then mypy (mypy.ini) on the services and kernels. CI runs this before the tests
# (.ci/run); ruff and mypy come with the dev extra (scripts/setup.sh). Installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
missing=()
for tool in ruff mypy; do
  [[ -x "$BIN/$tool" ]] || missing+=("$tool")
done
if (( ${#missing[@]} )); then
  echo "lint: ${missing[*]} missing from $BIN (scripts/setup.sh installs the dev extra)" >&2
  exit 2
fi
rc=0
"$BIN/ruff" check . || rc=1            # both run, so one CI log shows every finding
"$BIN/mypy" --config-file mypy.ini || rc=1
exit $rc
