#!/usr/bin/env bash
# Set up and run the tests: generated stubs are current, then pytest (all of it, e2e included;
# pass -m "not e2e" to skip the ones that set up the real SmolLM2 target).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
PYTHON=.venv/bin/python scripts/gen_protos.sh --check
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
