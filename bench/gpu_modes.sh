#!/bin/bash
# bench/modes.py on one H200 (--stack gpu): the long-tailed agent workload run colocated and in
# modes (a)-(d), with real vLLM generation (two replicas) and the FSDP2 trainer sharing the GPU,
# weights over CUDA IPC, on a random Qwen2.5-0.5B shape. One command under 10 minutes, from the
# repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_modes.sh [bench/modes.py options ...]
#
# e.g. `bench/gpu_modes.sh --modes colocated,d --steps 24`. $OUT gets: modes.txt (the table, the
# numbers, the load), modes.png and modes-colocated.png (timeline charts), modes.log.gz, and
# traces.tar.gz (each mode's config, metrics and trace).
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
RUNS=$WORK/modes
rm -rf "$RUNS"
T=${T:-480}  # seconds for the modes (stopped cleanly after); the rest: install, tables
timeout -s INT "$T" python3 bench/modes.py --stack gpu --out "$RUNS" --png "$OUT/modes.png" \
  --modes colocated,a,b,c,d --steps 16 --window 8 --mini 2 --staleness 1.0 --cpus 8 --concurrency 32 "$@" \
  > "$WORK/modes.log" 2>&1
rc=$?
echo "bench/modes.py exited with $rc"
# the table, the per-mode lines and the JSON numbers (the log's tail), without the Ray noise
grep -E '^(== mode|   [0-9.]+ samples/s|\| |chart:|load average)' "$WORK/modes.log" > "$OUT/modes.txt"
sed -n '/^{/,/^}/p' "$WORK/modes.log" >> "$OUT/modes.txt"
cat "$OUT/modes.txt"
gzip -c "$WORK/modes.log" > "$OUT/modes.log.gz"
tar -czf "$OUT/traces.tar.gz" -C "$WORK" machine.txt $(cd "$WORK" && ls -d modes/run-*/ 2>/dev/null | sed 's,/$,,') 2>/dev/null
ls -la "$OUT"
exit $rc
