#!/usr/bin/env bash
# The suffix-drafts benchmarks (docs/bench/suffix-history/README.md), one after the other on an
# otherwise idle machine; each set's results go to docs/bench/suffix-<set>-<tag>/
# (bench.json/md/png). A set whose bench.json exists is skipped, so a second run resumes. TAG
# names the machine (amd, xeon).
#   scripts/bench_suffix.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-$(grep -qi amd /proc/cpuinfo && echo amd || echo xeon)}
B=".venv/bin/dflash bench --start --max-tokens 128"
run() {   # name, then bench arguments
  local out="docs/bench/suffix-$1-$TAG"; shift
  if [[ -f "$out/bench.json" || -f "$out/load.json" ]]; then echo "skip $out"; return; fi
  mkdir -p "$out"
  echo "== $out: $*"
  $B --out "$out" "$@" 2>&1 | tr '\r' '\n' | grep -v "^bench: " | tail -40
}
run humaneval --limit 20 --spec-modes tree:15,hybrid:15,suffix,adaptive
run chat --prompts chat --limit 12 --spec-modes tree:15,hybrid:15,suffix,adaptive
run edit --prompts data/bench/edit.jsonl --limit 24 --spec-modes tree:15,hybrid:15,suffix,adaptive
run load --concurrency 8,32 --spec-modes adaptive:1,adaptive --max-tokens 64 --requests-per-client 3 --repeats 2
