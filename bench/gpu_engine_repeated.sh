#!/bin/bash
# bench/engine_repeated.py on the project's GPU machine. Both workloads on one set of engines
# take longer than one command's 10 minutes, so the run goes on in a session of its own
# (setsid), which outlives the command that starts it, and a second command waits for it:
#
#   OUT=... WHEEL_DIR=/root/w MODE=start bench/gpu_engine_repeated.sh [engine_repeated.py run flags]
#   OUT=... MODE=wait bench/gpu_engine_repeated.sh         # at once after the first returns
#
# (the machine is given back 30 s after a command: the second must follow without a pause).
# Each command returns by LIMIT seconds (default 570 after its start) or when the run is done,
# with what the run has written copied into $OUT: engine_repeated_batch.json,
# engine_repeated_agentic.json, run.log, the four servers' logs. Each engine's KV cache is
# 16 GiB on a GPU of >= 100 GiB, else 12 GiB (four engines share the GPU).
set -u -o pipefail
KEEP=${KEEP:-/root/bench-repeated}
LIMIT=${LIMIT:-570}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT=${OUT:-$ROOT/runs/gpu-out}
mkdir -p "$OUT"
if [ "${MODE:-start}" = start ]; then
  source "$(dirname "$0")/gpu_common.sh"
  cd "$ROOT" || exit 1
  cat "$WORK/machine.txt"
  rm -rf "$KEEP"; mkdir -p "$KEEP"
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  kv=12; [ "${mib:-0}" -ge 100000 ] && kv=16
  setsid python3 bench/engine_repeated.py run --out-dir "$KEEP" --kv-cache-gib "$kv" "$@" \
    > "$KEEP/run.log" 2>&1 < /dev/null &
  echo $! > "$KEEP/pid"
  echo "started bench/engine_repeated.py (pid $(cat "$KEEP/pid"), KV cache $kv GiB an engine) at ${SECONDS}s"
fi
last=0
while [ ! -f "$KEEP/DONE" ] && kill -0 "$(cat "$KEEP/pid")" 2>/dev/null && (( SECONDS < LIMIT )); do
  sleep 5
  n=$(grep -ac '^\[' "$KEEP/run.log")
  if (( n > last )); then grep -a '^\[' "$KEEP/run.log" | tail -n +$((last + 1)); last=$n; fi
done
cp "$KEEP"/*.json "$KEEP"/*.log "$OUT"/ 2>/dev/null
if [ -f "$KEEP/DONE" ]; then
  echo "DONE (status $(cat "$KEEP/DONE")) at ${SECONDS}s"; grep -a '/raw: median' "$KEEP/run.log"
elif ! kill -0 "$(cat "$KEEP/pid")" 2>/dev/null; then
  echo "the run ended without DONE:"; tail -30 "$KEEP/run.log"
else
  echo "still running at ${SECONDS}s: MODE=wait $0 next"
fi
