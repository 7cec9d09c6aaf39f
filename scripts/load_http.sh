#!/usr/bin/env bash
# A short, bounded load against the gateway's OpenAI-compatible HTTP API with a real load tool
# from PyPI (AIPerf), on the tiny stack (`dflash up --tiny`, random weights: the figures measure
# the serving path, not a model). Not CI. AIPerf goes into a throwaway venv (LOAD_VENV, default
# /tmp/dflash-aiperf), never into the project's. Every request goes to 127.0.0.1 only.
#
#   scripts/load_http.sh [REQUESTS=40] [CONCURRENCY=4]
#   LOAD_STREAMING=0 scripts/load_http.sh       # non-streaming requests
#
# Prints AIPerf's summary table (TTFT, ITL, request latency, throughput); its artifacts (json,
# csv) go to $RUN_DIR/aiperf. The stack is stopped when the script ends, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-40}
CONCURRENCY=${2:-4}
VENV=${LOAD_VENV:-/tmp/dflash-aiperf}
RUN_DIR=${RUN_DIR:-runs/load-http}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
PY=.venv/bin/python

if [[ ! -x "$VENV/bin/aiperf" ]]; then
  echo "installing aiperf==$AIPERF_VERSION into $VENV (throwaway, not a project dependency)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION" 2>&1 | grep -v "is ignored" || true
fi

read -r GW VER DR HTTP < <("$PY" -c '
import socket
s = [socket.socket() for _ in range(4)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])
for x in s: x.close()')
mkdir -p "$RUN_DIR"
"$PY" -m dflash_app.cli up --tiny --gateway-port "$GW" --verifier-port "$VER" --drafter-port "$DR" \
  --http-port "$HTTP" --run-dir "$RUN_DIR/logs" > "$RUN_DIR/up.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
URL="http://127.0.0.1:$HTTP"
for _ in $(seq 600); do
  if "$PY" -c "import urllib.request,sys; urllib.request.urlopen('$URL/health', timeout=1)" 2>/dev/null; then
    break
  fi
  kill -0 $UP 2>/dev/null || { cat "$RUN_DIR/up.log"; exit 1; }
  sleep 0.5
done
MODEL=$("$PY" -c "import json,urllib.request; print(json.load(urllib.request.urlopen('$URL/v1/models'))['data'][0]['id'])")
TOKENIZER=$("$PY" -c "from dflash.train.target_setup import default_cache_dir; print(default_cache_dir() / 'tiny' / 'target')")
echo "stack up: $URL/v1, model $MODEL; $REQUESTS requests at concurrency $CONCURRENCY"

STREAM=()
[[ "${LOAD_STREAMING:-1}" == "1" ]] && STREAM=(--streaming)
# Bounded in count (--request-count) and time (timeout); the tiny model's own tokenizer, and the
# server's token counts (random weights emit invalid UTF-8, which re-tokenises to more tokens).
timeout 600 "$VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" --endpoint-type chat \
  "${STREAM[@]}" --tokenizer "$TOKENIZER" --concurrency "$CONCURRENCY" \
  --request-count "$REQUESTS" --warmup-request-count 4 --isl 64 --osl 32 --random-seed 1 \
  --use-server-token-count --no-server-metrics --ui none --artifact-dir "$RUN_DIR/aiperf" 2>&1 | tee "$RUN_DIR/aiperf.log"
