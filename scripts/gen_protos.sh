#!/usr/bin/env bash
# Regenerate the gRPC stubs in dflash/v1/ from proto/dflash/v1/*.proto (one command; CI checks
# that the committed stubs are current with `scripts/gen_protos.sh --check`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=dflash/v1
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$PY" -m grpc_tools.protoc -Iproto --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" proto/dflash/v1/*.proto
  for f in "$tmp"/dflash/v1/*; do
    cmp -s "$f" "$out/$(basename "$f")" || { echo "stale generated stub: $out/$(basename "$f") (run scripts/gen_protos.sh)"; exit 1; }
  done
  echo "generated stubs are current"
  exit 0
fi
"$PY" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/dflash/v1/*.proto
touch "$out/__init__.py"
echo "wrote $out/"
