#!/usr/bin/env bash
# The trace UI's own virtualenv, .venv-traces: Arize Phoenix at the exact versions of
# constraints-traces.txt (`dflash up --traces-ui` runs its `phoenix serve`). Kept apart from
# .venv: Phoenix's dependency tree is several times the services' and is pinned on its own
# (docs/observability.md, Trace UI). Idempotent (a stamp skips a second install).
#   --browser  also install Debian's headless Chromium and its driver when missing (root,
#              apt-get), for the browser test (tests/test_traces_ui.py, marker `browser`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--browser" ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
fi
VENV=.venv-traces
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
STAMP=$VENV/.dflash-setup
want=$(sha256sum constraints-traces.txt | cut -c1-64)
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$VENV/bin/python" -m pip install -q -c constraints-traces.txt arize-phoenix 2>&1 \
    | { grep -v '^WARNING: Location\|is ignored' || true; }
fi
"$VENV/bin/phoenix" --help >/dev/null
echo "$want" > "$STAMP"
