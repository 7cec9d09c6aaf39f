#!/usr/bin/env bash
# Wheels the GPU machine lacks or has in another version, for scripts/gpu_check.sh (run here,
# where PyPI is reachable; the GPU machine reaches nothing). They go to .whl/ (git-ignored
# through .git/info/exclude), about 26 MB; the check installs them with --no-index.
#
#   scripts/gpu_wheels.sh            # then carry .whl to the device run
#
# The machine's image has torch 2.11, transformers 5.17, triton 3.6, grpcio, numpy, safetensors,
# tokenizers, huggingface-hub, prometheus-client, pyyaml, jinja2, pytest (docs/gpu.md). This
# project needs transformers 5.24 (its cache and EP APIs), the gRPC health/reflection packages,
# OpenTelemetry, cryptography and protobuf 7: the versions pinned in constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES=(transformers grpcio grpcio-health-checking grpcio-reflection protobuf
       opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc
       opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
       opentelemetry-proto opentelemetry-semantic-conventions googleapis-common-protos
       cryptography cffi pycparser)
PINS=()
for n in "${NAMES[@]}"; do
  pin=$(grep -iE "^${n//-/[-_]}==" constraints.txt | head -1)
  [[ -n $pin ]] || { echo "gpu_wheels.sh: $n is not pinned in constraints.txt" >&2; exit 1; }
  PINS+=("$pin")
done
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${PINS[@]}"
du -sh .whl
