#!/usr/bin/env bash
# The one prepared GPU check (issue 26): on one H200 in at most 8 minutes, from a bare machine
# that has only this repository (and, beside it, the wheels of scripts/gpu_wheels.sh in .whl/).
#
#   scripts/gpu_check.sh              # on the GPU machine; results under $OUT (default ./gpu_out)
#   scripts/gpu_check.sh --dry-run    # the same stages on the CPU with tiny shapes (CI runs it)
#
# Stages, each bounded by what is left of the budget (DFLASH_GPU_BUDGET_S, 470 s; a stage that
# runs out is cut and the next ones still run, the report says what is missing):
#   1. meta        versions, GPU name
#   2. realsize    scripts/make_realsize.py: random-weight Qwen3-8B target + z-lab
#                  Qwen3-8B-DFlash-b16-shaped drafter, drawn on the GPU, written to $WORK
#   3. pytest      pytest -m gpu tests/test_gpu.py (the services' pieces on the GPU, lossless)
#   4. kernels     scripts/bench_kernels.py: Triton vs torch references, batch 1/8/32, exactness
#   5. step        scripts/gpu_bench.py step: decode, verify of 16, drafter call, wire time at
#                  batch 1/8/32 on the real-size checkpoints
#   6. e2e         scripts/gpu_bench.py e2e: tokens/s through the real services over gRPC on
#                  loopback: speculation off vs the oracle drafter vs the random drafter, with
#                  the default kernels (bf16 near-ties may cut the oracle's blocks)
#   6b. e2e_invariant  the same at batch 1 with --batch-invariant on (kernels/invariant.py):
#                  the oracle's tau must be the block size and every output identical to off
#   7. report      $OUT/results.json + $OUT/report.md (targets met or not), $OUT/check.log,
#                  $OUT/details.tar.gz (every stage's output and the services' logs)
# Copy results.json and report.md to docs/bench/gpu-<date>/ (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --dry-run)" >&2; exit 2 ;;
  esac
done
[[ "${DFLASH_GPU_DRY_RUN:-0}" == 1 ]] && DRY=1

OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${DFLASH_GPU_WORK:-/tmp/dflash-gpu-check}
RUN=$WORK/run
rm -rf "$RUN"
mkdir -p "$RUN/logs"
BUDGET=${DFLASH_GPU_BUDGET_S:-470}
exec > >(tee "$OUT/check.log") 2>&1

if [[ $DRY == 1 ]]; then
  PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
  DEVICE=cpu
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # tiny models: one thread, no spinning
  REALSIZE=(--tiny --device cpu)
  KERNELS=(--smoke)
  STEP=(--batches 1 2 --context 32 --iters 1)
  E2E=(--concurrency 1 --prompt-len 16 --max-tokens 33 --start-timeout 120)
  E2E_INV=(--concurrency 1 --prompt-len 16 --max-tokens 33 --start-timeout 120)
  MODE="dry run: CPU, tiny shapes"
else
  PY=${PYTHON:-python3}
  DEVICE=${DFLASH_GPU_DEVICE:-cuda}
  REALSIZE=(--device "$DEVICE")
  KERNELS=(--batch 1 8 32 --vocab 151936 --hidden 20480 --iters 20)
  STEP=(--batches 1 8 32 --context 512 --iters 10)
  E2E=(--concurrency 1 8 --prompt-len 256 --max-tokens 128)
  # off the AVX-512 CPU kernels the invariant mode takes its row-at-a-time references: batch 1
  E2E_INV=(--concurrency 1 --prompt-len 256 --max-tokens 64)
  MODE="real size: Qwen3-8B target, Qwen3-8B-DFlash-b16 drafter, bf16"
  # What the image lacks or has in another version travels as wheels (scripts/gpu_wheels.sh).
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/dflash-site .whl/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/dflash-site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

START=$SECONDS
STAGES=""
left() { echo $(( BUDGET - (SECONDS - START) )); }

# stage NAME CAP_SECONDS LOG COMMAND...: run with min(CAP, budget left - 15 s for the report),
# its output also copied to LOG ("-": none)
stage() {
  local name=$1 cap=$2 log=$3; shift 3
  local limit=$(( $(left) - 15 ))
  (( limit > cap )) && limit=$cap
  if (( limit < 5 )); then
    echo "== $name: skipped, budget spent"; STAGES+="$name:skipped "; return
  fi
  echo "== $name (limit ${limit}s, $(left)s of the budget left)"
  local t0=$SECONDS rc
  if [[ $log == - ]]; then
    timeout --kill-after=10 "$limit" "$@"
  else
    timeout --kill-after=10 "$limit" "$@" > >(tee "$log") 2>&1
  fi
  rc=$?
  echo "== $name: exit $rc after $(( SECONDS - t0 ))s"
  STAGES+="$name:$rc "
}

stage meta 60 - "$PY" - "$RUN/meta.json" "$MODE" <<'EOF'
import datetime, json, sys
import torch
info = {"mode": sys.argv[2], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
for mod in ("transformers", "triton", "grpc", "google.protobuf"):
    try:
        info[mod.split(".")[-1]] = __import__(mod, fromlist=["x"]).__version__
    except Exception as e:
        info[mod.split(".")[-1]] = f"missing ({e.__class__.__name__})"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(info)
EOF

stage realsize 150 - "$PY" scripts/make_realsize.py --out "$WORK/ckpt" --skip-existing "${REALSIZE[@]}"
cp "$WORK/ckpt/realsize.json" "$RUN/" 2>/dev/null

stage pytest 120 "$RUN/pytest_gpu.txt" "$PY" -m pytest -m gpu tests/test_gpu.py -q \
  -p no:cacheprovider -rs

stage kernels 90 "$RUN/kernels.md" "$PY" scripts/bench_kernels.py "${KERNELS[@]}"

stage step 180 - "$PY" scripts/gpu_bench.py step --target "$WORK/ckpt/target" \
  --drafter "$WORK/ckpt/drafter" --device "$DEVICE" --dtype bfloat16 --out "$RUN/step.json" \
  "${STEP[@]}"

stage e2e 240 - "$PY" scripts/gpu_bench.py e2e --target "$WORK/ckpt/target" \
  --drafter "$WORK/ckpt/drafter" --device "$DEVICE" --dtype bfloat16 --out "$RUN/e2e.json" \
  --logs "$RUN/logs" --batch-invariant off "${E2E[@]}"

stage e2e_invariant 150 - "$PY" scripts/gpu_bench.py e2e --target "$WORK/ckpt/target" \
  --drafter "$WORK/ckpt/drafter" --device "$DEVICE" --dtype bfloat16 \
  --out "$RUN/e2e_invariant.json" --logs "$RUN/logs/invariant" --batch-invariant on \
  "${E2E_INV[@]}"

"$PY" - "$RUN/meta.json" "$STAGES" "$(( SECONDS - START ))" <<'EOF'
import json, sys
p = sys.argv[1]
try:
    meta = json.load(open(p))
except Exception:
    meta = {}
meta.update(stages=sys.argv[2].strip(), seconds=int(sys.argv[3]))
json.dump(meta, open(p, "w"), indent=2)
EOF
"$PY" scripts/gpu_bench.py report --dir "$RUN" > /dev/null
cp "$RUN/results.json" "$RUN/report.md" "$OUT/" 2>/dev/null
tar -czf "$OUT/details.tar.gz" -C "$RUN" . 2>/dev/null
echo "== done in $(( SECONDS - START ))s: $STAGES"
echo "== $OUT: $(ls "$OUT" | tr '\n' ' ')"
cat "$OUT/report.md" 2>/dev/null
# exit non-zero when a stage failed or was skipped, so a dry run in CI fails loudly
for s in $STAGES; do [[ ${s##*:} == 0 ]] || exit 1; done
exit 0
