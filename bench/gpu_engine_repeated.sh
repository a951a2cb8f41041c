#!/bin/bash
# bench/engine_repeated.py on the project's GPU machine: one workload per command (each command
# has 10 minutes; the three engines are started afresh in each, vLLM's compile cache kept on
# the machine's disk from the first).
#
#   OUT=/some/dir WHEEL_DIR=/root/w WORKLOAD=batch bench/gpu_engine_repeated.sh [engine_repeated.py run flags]
#   OUT=/some/dir WHEEL_DIR=/root/w WORKLOAD=agentic bench/gpu_engine_repeated.sh
#
# BUDGET (default 560): seconds of this command after which no timed run starts.
# $OUT gets engine_repeated_$WORKLOAD.json (every run), run_$WORKLOAD.log and the servers' logs.
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
cat "$WORK/machine.txt"
W=${WORKLOAD:-batch}
python3 bench/engine_repeated.py run --workload "$W" --out "$OUT/engine_repeated_$W.json" --log-dir "$OUT" \
  --deadline-s $(( ${BUDGET:-560} - SECONDS - 40 )) "$@" 2>&1 | tee "$OUT/run_$W.log"
