#!/usr/bin/env bash
# The one prepared accelerator run (issue 21): on one H200, from a bare machine, in about 8
# minutes: rebuild the SmolLM2 target, generate new training data with it, train the drafter
# from the committed version, evaluate both, and return the drafter and the new token data.
#
#   scripts/accel_prepare.sh           # here, first: GGUF parts + wheels, prints the run calls
#   scripts/accel_train.sh             # on the device, once per part (results under $OUT)
#   scripts/accel_train.sh --dry-run   # every stage on the CPU, tiny random models (CI)
#
# The GGUF (98 MB) cannot travel whole (64 MiB a run, the repository is ~22 MiB of it): each run
# carries one part (.accel/run<i>/, dflash_app.gguf_parts) and stores it in $H/parts
# (DFLASH_ACCEL_HOME, /tmp/dflash-accel: it lives as long as the warm machine). A run that
# finds parts missing names them and exits 0; the run that completes the set goes on:
#   1. gguf      join the parts, sha256 = target_setup.GGUF_SHA256
#   2. target    target_setup --gguf: the same dequantisation as on a CPU (kept in $H/cache)
#   3. datagen   python -m dflash.train datagen --device cuda --gen-dtype bfloat16, 512 prompts
#                a batch (a decode step costs about the same at 512 rows as at 64 on an H200:
#                it is launch-bound), prompt seed >= 1000 and above every committed seed (no
#                shard name can collide), magpie + chat2 + template (chat is where the drafter
#                is weakest; the `code` source is left out: it parses every .py of the image's
#                site-packages, minutes there), ids only, on a copy of data/train; 75 s
#   4. features  the feature cache of every shard (one float32 forward per 32k tokens), so
#                that the training budget below is steps only and the stage cannot overrun
#   5. train     from models/smollm2-dflash-b16 (--init-from) on the committed + new shards,
#                for what is left less the evaluation's share. 64 sequences x 12 anchors a
#                step (16x the CPU recipe's 4: building the blocks on the host, not the GPU,
#                bounds a step, so more blocks a step are nearly free and the gradient is less
#                noisy); lr 1e-4 (the CPU warm starts used 6e-5 at 4 sequences; 3e-4 with a
#                fresh AdamW lost version 4's long runs,
#                docs/bench/training-history/README.md), KL 0.5, full vocabulary from 85%.
#                Held-out split as on a CPU: heldout_log.csv, before / every 45 s / after.
#   6. eval      dflash.train.evaluate (in-process greedy DFlash loop, float32 target) on 8
#                HumanEval and 8 chat prompts x 128 tokens, committed drafter and new one
#   7. pack      $OUT (at most 8 files, each < 16 MiB): drafter.tar.partNN (split -b 15M),
#                shards.tar.gz (new shards + manifest), results.json, accel.log, details.tar.gz
# DFLASH_ACCEL_ARCH=dflash2: stage 5 trains a DFlash2 drafter (--architecture dflash2) from the
# committed DFlash one, which it equals at step 0 (conv identity, selector projection zero); the
# evaluation drafts its selector's path. Everything else is unchanged.
# Stages are bounded by what is left of DFLASH_ACCEL_BUDGET_S (470 s; the dry run 3000 s, its
# stage caps x DFLASH_ACCEL_CAP_SCALE, 5); one that fails or runs
# out is reported in results.json and the later ones still run where they can.
# Join the drafter here: cat FILES/drafter.tar.part* | tar -x -C runs/accel
set -uo pipefail
cd "$(dirname "$0")/.."

case "$*" in                      # one optional argument
  "") DRY=0 ;;
  --dry-run) DRY=1 ;;
  -h|--help) sed -n '2,42p' "$0"; exit 0 ;;
  *) echo "accel_train.sh: unknown arguments '$*' (use --dry-run)" >&2; exit 2 ;;
esac

OUT=${OUT:-./accel_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CARRY=${DFLASH_ACCEL_CARRY:-.accel}
# the dry run checks the flow, not a CPU's speed: its caps are scaled and its budget is wide, so a
# loaded CI machine does not read as a stage running out
BUDGET=${DFLASH_ACCEL_BUDGET_S:-$( (( DRY )) && echo 3000 || echo 470 )}
exec > >(tee -a "$OUT/accel.log") 2>&1

if [[ $DRY == 1 ]]; then
  PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
  H=${DFLASH_ACCEL_HOME:-$(mktemp -d /tmp/dflash-accel-dry.XXXXXX)}
  DEVICE=cpu THREADS=1
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
  GEN=(--batch-size 8 --max-new-tokens 16 --mix template=2,magpie=1,chat2=1)
  GEN_MIN=0.2
  TRAIN=(--num-layers 1 --block-size 4 --seqs-per-step 4 --anchors-per-seq 4 --lr 1e-3
         --kl-weight 0.5 --full-vocab-after 0.5 --heldout-every 3 --heldout-batch 2
         --ckpt-every-min 0.05 --draft-vocab-size 64 --topk 4)
  TRAIN_OVERHEAD_S=30 EVAL_RESERVE_S=400 CAP_SCALE=${DFLASH_ACCEL_CAP_SCALE:-5}
  PIECE_MIB=0.3             # a tiny drafter still comes back in several pieces
  EVAL=(--n 2 --max-new-tokens 16)
else
  PY=${PYTHON:-python3}
  H=${DFLASH_ACCEL_HOME:-/tmp/dflash-accel}
  DEVICE=${DFLASH_ACCEL_DEVICE:-cuda} THREADS=8
  GEN=(--batch-size 512 --max-new-tokens 128 --mix "${DFLASH_ACCEL_MIX:-magpie=6,chat2=6,template=2}")
  GEN_MIN=1.25
  TRAIN=(--num-layers 2 --block-size 16 --seqs-per-step 64 --anchors-per-seq 12 --lr 1e-4
         --kl-weight 0.5 --full-vocab-after 0.85 --heldout-batch 64 --ckpt-every-min 0.75)
  TRAIN_OVERHEAD_S=45 EVAL_RESERVE_S=120 CAP_SCALE=1
  PIECE_MIB=15
  EVAL=(--n 8 --max-new-tokens 128)
fi
mkdir -p "$H"
WORK=$H/work
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
START=$SECONDS
STAGES=$OUT/.stages.jsonl
rm -f "$STAGES"
FAILED=0
left() { echo $(( BUDGET - (SECONDS - START) )); }

# record NAME STATUS SECONDS: one line of results.json's "stages"
record() { printf '{"name": "%s", "status": "%s", "seconds": %s}\n' "$1" "$2" "$3" >> "$STAGES"; }

# stage NAME CAP COMMAND...: run with min(CAP, budget left - 20 s for packing); exit 124/137 = ran out
stage() {
  local name=$1 cap=$(( $2 * CAP_SCALE )); shift 2
  local limit=$(( $(left) - 20 ))
  (( limit > cap )) && limit=$cap
  if (( limit < 5 )); then
    echo "== $name: skipped, budget spent"; record "$name" "skipped: budget spent" 0; FAILED=1; return 1
  fi
  echo "== $name (limit ${limit}s, $(left)s of the budget left)"
  local t0=$SECONDS rc status
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="ran out of time (${limit}s)" ;;
    *) status="failed (exit $rc)" ;;
  esac
  echo "== $name: $status after $(( SECONDS - t0 ))s"
  record "$name" "$status" $(( SECONDS - t0 ))
  (( rc == 0 )) || FAILED=1
  return $rc
}
skip() { echo "== $1: skipped, $2"; record "$1" "skipped: $2" 0; FAILED=1; }

# report STATUS: results.json (+ the drafter card) from what the stages left, then pack
report() {
  "$PY" scripts/accel_report.py --out "$OUT" --work "$WORK" --home "$H" --status "$1" \
    --mode "$MODE" --seconds $(( SECONDS - START )) --budget "$BUDGET" --piece-mib "$PIECE_MIB"
}

# ---------------------------------------------------------------- wheels the image lacks
if [[ $DRY == 0 ]]; then
  mapfile -t WHEELS < <(find "$CARRY" -name '*.whl' 2>/dev/null)
  if (( ${#WHEELS[@]} )); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$H/site" "${WHEELS[@]}" && echo "== wheels: ${#WHEELS[@]} installed in $H/site"
  fi
  [[ -d $H/site ]] && export PYTHONPATH=$H/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODE=$( [[ $DRY == 1 ]] && echo "dry run: CPU, tiny random models" || echo "$DEVICE: SmolLM2-135M-Instruct" )

# ---------------------------------------------------------------- 1. the GGUF parts
SHA=$("$PY" -c "from dflash.train.target_setup import GGUF_SHA256; print(GGUF_SHA256)")
if [[ $DRY == 1 && -n ${DFLASH_ACCEL_GGUF_SHA256:-} ]]; then
  SHA=$DFLASH_ACCEL_GGUF_SHA256          # the dry run's small fake file; never honoured on a device
fi
t0=$SECONDS
"$PY" -m dflash_app.gguf_parts store --store "$H/parts" "$CARRY" \
  && "$PY" -m dflash_app.gguf_parts join --store "$H/parts" --out "$H/target.gguf" --sha256 "$SHA"
rc=$?                                    # 3: parts missing (named above); 1: damaged or wrong digest
if (( rc == 3 )); then
  record gguf "waiting for parts" $(( SECONDS - t0 ))
  report "waiting for parts"
  exit 0
fi
if (( rc != 0 )); then
  record gguf "failed (exit $rc)" $(( SECONDS - t0 ))
  report failed
  exit 1
fi
record gguf ok $(( SECONDS - t0 ))

# ---------------------------------------------------------------- 2. the target
rm -rf "$WORK"
mkdir -p "$WORK"
if [[ $DRY == 1 ]]; then
  # the dry run's GGUF is a fake: a tiny random target, a committed store and drafter for it
  TARGET=$H/tiny-target BASE_DRAFTER=$WORK/base-drafter
  stage target 60 "$PY" -c "import sys; from dflash_app.testing import make_tiny_target
make_tiny_target(sys.argv[1], num_layers=8, hidden=64)" "$TARGET"
  stage base-data 60 "$PY" -m dflash.train --threads 1 datagen --target-dir "$TARGET" \
    --data-dir "$WORK/data" --feature-cache "$WORK/featcache" "${GEN[@]}" --topk 4
  stage base-drafter 60 "$PY" -m dflash.train --threads 1 train --target-dir "$TARGET" \
    --data-dir "$WORK/data" --feature-cache "$WORK/featcache" --run-dir "$WORK/base-run" \
    --out-dir "$BASE_DRAFTER" --max-steps 2 "${TRAIN[@]}"
else
  TARGET=$H/cache/smollm2-135m-instruct BASE_DRAFTER=models/smollm2-dflash-b16
  stage target 150 "$PY" -m dflash_app.target_setup --cache-dir "$H/cache" --gguf "$H/target.gguf"
  cp -r data/train "$WORK/data"
fi
if [[ ! -f $TARGET/config.json ]]; then
  for s in datagen features train eval; do skip $s "no target"; done
  report failed
  exit 1
fi

# ---------------------------------------------------------------- 3. new data on the device
SEED=$("$PY" - "$WORK/data/manifest.json" <<'EOF'
import json, sys
seeds = [s.get("seed", 0) for s in json.load(open(sys.argv[1]))["shards"]]
print(max([999] + seeds) + 1)      # above every committed seed: shard names never collide
EOF
)
echo "$SEED" > "$WORK/seed"
GEN_CAP=$("$PY" -c "import sys; print(int(float(sys.argv[1]) * 60) + 40)" "$GEN_MIN")
stage datagen "$GEN_CAP" "$PY" -m dflash.train --threads "$THREADS" datagen \
  --device "$DEVICE" --gen-dtype bfloat16 --prompt-seed "$SEED" --gen-budget-min "$GEN_MIN" \
  --target-dir "$TARGET" --data-dir "$WORK/data" --feature-cache "$WORK/featcache" "${GEN[@]}"

# ---------------------------------------------------------------- 4. the feature cache
# a run of no steps computes what is missing (its own run dir: its held-out figures are not
# the training run's)
stage features 150 "$PY" -m dflash.train --threads "$THREADS" train --device "$DEVICE" \
  --target-dir "$TARGET" --data-dir "$WORK/data" --feature-cache "$WORK/featcache" \
  --run-dir "$WORK/features-run" --max-steps 0 "${TRAIN[@]}"

# ---------------------------------------------------------------- 5. training
TRAIN_CAP=$(( $(left) - EVAL_RESERVE_S ))
TRAIN_MIN=$("$PY" -c "import sys; print(round(max(0.1, (int(sys.argv[1]) - int(sys.argv[2])) / 60), 2))" \
  "$TRAIN_CAP" "$TRAIN_OVERHEAD_S")
[[ $DRY == 1 ]] && TRAIN_MIN=0.1
stage train "$TRAIN_CAP" "$PY" -m dflash.train --threads "$THREADS" train --device "$DEVICE" \
  --target-dir "$TARGET" --data-dir "$WORK/data" --feature-cache "$WORK/featcache" \
  --run-dir "$WORK/run" --out-dir "$WORK/drafter" --init-from "$BASE_DRAFTER" \
  --time-budget-min "$TRAIN_MIN" --version "${DFLASH_ACCEL_VERSION:-accel-1}" "${TRAIN[@]}" \
  --architecture "${DFLASH_ACCEL_ARCH:-dflash}"

# ---------------------------------------------------------------- 6. evaluation
for which in base new; do
  d=$BASE_DRAFTER
  [[ $which == new ]] && d=$WORK/drafter
  if [[ -f $d/model.safetensors ]]; then
    stage "eval-$which" $(( EVAL_RESERVE_S / 2 )) "$PY" -m dflash.train.evaluate --device "$DEVICE" \
      --threads "$THREADS" --target-dir "$TARGET" --drafter "$d" --which humaneval,chat \
      --out "$WORK/eval_$which.json" "${EVAL[@]}"
  else
    skip "eval-$which" "no drafter"
  fi
done

# ---------------------------------------------------------------- 7. results and files
report "$( (( FAILED )) && echo partial || echo ok )"
rc=$?
echo "== done in $(( SECONDS - START ))s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
# non-zero when a stage failed, ran out or was skipped, so a dry run in CI fails loudly
(( rc == 0 && FAILED == 0 ))
