#!/usr/bin/env bash
# Lint and type checks: ruff (pyflakes, import order, bugbear; ruff.toml) on the whole
# repository, mypy (mypy.ini) on the services and kernels, then lint-imports (import-linter; the
# layer contract in pyproject.toml). CI runs this before the tests (.ci/run); the three come with
# the dev extra (scripts/setup.sh). Installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
missing=()
for tool in ruff mypy lint-imports; do
  [[ -x "$BIN/$tool" ]] || missing+=("$tool")
done
if (( ${#missing[@]} )); then
  echo "lint: ${missing[*]} missing from $BIN (scripts/setup.sh installs the dev extra)" >&2
  exit 2
fi
rc=0
"$BIN/ruff" check . || rc=1            # both run, so one CI log shows every finding
"$BIN/mypy" --config-file mypy.ini || rc=1
"$BIN/lint-imports" --no-cache || rc=1   # no cache: it would be one more untracked folder
exit $rc
