#!/bin/bash
# bench/modes.py on one H200 (--stack gpu): the long-tailed agent workload run colocated and in
# modes (a)-(d), with real vLLM generation (two replicas) and the FSDP2 trainer sharing the GPU,
# weights over CUDA IPC, on a random Qwen2.5-0.5B shape. One command under 10 minutes, from the
# repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_modes.sh [bench/modes.py options ...]
#
# e.g. `MODES="colocated d" bench/gpu_modes.sh --steps 16`. Each mode runs alone under its own
# time limit (PER_MODE seconds), so one slow mode costs only itself; then the table and the
# charts are drawn from the traces of the modes that finished (bench/modes.py --redraw). $OUT
# gets: modes.txt (the table, the numbers), modes.png and modes-colocated.png (timeline charts),
# modes.log.gz, traces.tar.gz (each mode's config, metrics, summary and trace).
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
RUNS=$WORK/modes
rm -rf "$RUNS"
MODES=${MODES:-colocated a b c d}
PER_MODE=${PER_MODE:-95}
COMMON=(--stack gpu --out "$RUNS" --window 8 --mini 2 --staleness 1.0 --steps 12 --median-s 0.3 --cpus 8 --concurrency 32)
done_modes=()
for m in $MODES; do
  timeout -s INT "$PER_MODE" python3 bench/modes.py "${COMMON[@]}" --modes "$m" --png "$WORK/modes-$m.png" "$@" >> "$WORK/modes.log" 2>&1
  echo "mode $m: exit $?"
  if python3 -c "import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s.get('report') else 1)" "$RUNS/run-$m/summary.json" 2>/dev/null; then
    done_modes+=("$m")
  fi
done
list=$(IFS=,; echo "${done_modes[*]}")
echo "finished modes: ${list:-none}"
if [ -n "$list" ]; then
  python3 bench/modes.py "${COMMON[@]}" --modes "$list" --png "$OUT/modes.png" "$@" --redraw > "$WORK/redraw.log" 2>&1
  { echo "finished modes: $list (each limited to $PER_MODE s)"; grep -E '^(\| |chart:)' "$WORK/redraw.log"; sed -n '/^{/,/^}/p' "$WORK/redraw.log"; } > "$OUT/modes.txt"
  cat "$OUT/modes.txt"
fi
gzip -c "$WORK/modes.log" > "$OUT/modes.log.gz"
tar -czf "$OUT/traces.tar.gz" -C "$WORK" machine.txt $(cd "$WORK" && ls -d modes/run-*/ 2>/dev/null | sed 's,/$,,') 2>/dev/null
ls -la "$OUT"
[ -n "$list" ]
