#!/usr/bin/env bash
# Set up and run the tests: generated stubs are current, then pytest (all of it, e2e included;
# pass -m "not e2e" to skip the ones that set up the real SmolLM2 target). Two pytest-xdist
# workers (DFLASH_TEST_WORKERS=0: one process); tests of one xdist_group share a worker; -rs
# prints why each skipped test skipped (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
PYTHON=.venv/bin/python scripts/gen_protos.sh --check
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider -rs -n "${DFLASH_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
