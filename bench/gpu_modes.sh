#!/bin/bash
# bench/modes.py on one H200 (--stack gpu): the long-tailed agent workload run colocated and in
# modes (a)-(d), with real vLLM generation (two replicas) and the FSDP2 trainer sharing the GPU,
# weights over CUDA IPC, on a random Qwen2.5-0.5B shape. One command under 10 minutes, from the
# repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_modes.sh [bench/modes.py options ...]
#
# Every mode runs alone, in a process session of its own, under a time limit that holds for the
# whole session (Ray's raylet, GCS and workers included: bench/gpu_common.sh `run_limited`): the
# time left of TOTAL seconds shared out equally among the modes still to run (at most PER_MODE
# each), so a slow mode costs only its share. A mode stopped at its limit still counts with the
# steps its trace holds. After every mode the table so far is written to $OUT/modes.txt (so a
# command killed from outside still leaves one); at the end the table and the charts of every
# mode that has numbers (bench/modes.py --redraw --lenient), whatever happened to the others.
#
# $OUT gets: modes.txt (per-mode status, the table: samples/s, trainer and Rollouter idle, the
# ratio to colocated and to (a); the numbers as JSON), modes.png and modes-colocated.png (timeline
# charts), modes.log.gz, traces.tar.gz (each mode's config, metrics, summary and trace).
#
# Environment: MODES (run order, default "colocated d a b c": the comparison the issue asks for
# first), TOTAL (seconds for the whole command from its start, install included; default 560),
# PER_MODE (default 150), KEEP=1 (keep and tabulate the modes a command before this one ran on the
# same machine, e.g. MODES="colocated d", then KEEP=1 MODES="a b c"), STEPS (trainer steps per mode, default 12: three windows of 4 steps, the
# first one warm-up), EPOCHS (PPO epochs, default 4), EAGER=1 (vLLM without CUDA graphs),
# STACK=cpu with FERRYMAN_SKIP_INSTALL=1 (the CPU smoke: transformers engines, the tiny model).
START=$SECONDS
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
RUNS=$WORK/modes
# KEEP=1: keep the modes an earlier command of the same machine ran (the table joins them)
[ -z "${KEEP:-}" ] && rm -rf "$RUNS" "$WORK/modes.log"
mkdir -p "$RUNS"
MODES=${MODES:-colocated d a b c}
TOTAL=${TOTAL:-560}
PER_MODE=${PER_MODE:-150}
STACK=${STACK:-gpu}
RESERVE=30   # the final table, the charts and the archives
COMMON=(--stack "$STACK" --out "$RUNS" --window 8 --mini 2 --staleness 1.0 --steps "${STEPS:-12}" --median-s 0.3 --cpus 8
        --concurrency 32 --ppo-epochs "${EPOCHS:-4}")
[ -n "${EAGER:-}" ] && COMMON+=(--eager)
[ "$STACK" = cpu ] && COMMON=(--stack cpu --out "$RUNS" --window 4 --mini 2 --staleness 1.0 --steps "${STEPS:-4}" --quick --cpus 2
                               --concurrency 4 --ppo-epochs 1 --turns 2 --max-tokens 4)
# the model once, before the clocks of the modes start
python3 bench/modes.py "${COMMON[@]}" --prepare "$@" >> "$WORK/modes.log" 2>&1 || { echo "building the model failed"; tail -20 "$WORK/modes.log"; exit 3; }

gpu_free() {  # wait (at most 30 s) until no process holds the GPU: the next mode's engines need its memory
  command -v nvidia-smi > /dev/null || return 0
  local i
  for i in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "GPU still in use by: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
}
table() {  # the table of the modes that have numbers so far (in the canonical order) -> $OUT/modes.txt
  local chart=$1 have=() m
  shift
  for m in colocated a b c d; do [ -d "$RUNS/run-$m/trace" ] && have+=("$m"); done
  local list
  list=$(IFS=,; echo "${have[*]}")
  { printf '%s\n' "${status[@]}"; } > "$OUT/modes.txt"
  [ -z "$list" ] && return 1
  if [ "$chart" = chart ]; then
    python3 bench/modes.py "${COMMON[@]}" --modes "$list" --png "$OUT/modes.png" "$@" --redraw --lenient > "$WORK/redraw.log" 2>&1
  else
    python3 bench/modes.py "${COMMON[@]}" --modes "$list" "$@" --redraw --lenient --no-chart > "$WORK/redraw.log" 2>&1
  fi
  local rc=$?
  { grep -E '^(\| |chart:|   no numbers)' "$WORK/redraw.log"; sed -n '/^{/,/^}/p' "$WORK/redraw.log"; } >> "$OUT/modes.txt"
  return $rc
}

status=()

n=$(wc -w <<< "$MODES")
i=0
for m in $MODES; do
  left=$(( TOTAL - (SECONDS - START) - RESERVE ))
  limit=$(( left / (n - i) ))
  (( limit > PER_MODE )) && limit=$PER_MODE
  i=$((i + 1))
  if (( limit < 30 )); then
    status+=("mode $m: not run (${left}s left)")
    echo "${status[-1]}"
    continue
  fi
  gpu_free
  t0=$SECONDS
  echo "=== mode $m (limit ${limit}s)" >> "$WORK/modes.log"
  run_limited "$limit" INT 10 "$WORK/modes.log" python3 bench/modes.py "${COMMON[@]}" --modes "$m" --no-chart "$@"
  rc=$?
  what="finished"
  [ $rc != 0 ] && what="failed (exit $rc; see modes.log)"
  [ "$RUN_LIMITED_HIT" = 1 ] && what="stopped at its limit of ${limit}s (exit $rc)"
  steps=$(python3 -c "
import glob, json, sys
n = 0
for f in glob.glob(sys.argv[1] + '/trace/*.jsonl'):
    for line in open(f):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        n += r.get('name') == 'trainer.step' and r.get('ph') == 'X'
print(n)" "$RUNS/run-$m" 2>/dev/null)
  status+=("mode $m: $what after $((SECONDS - t0))s, ${steps:-0} trainer steps in its trace")
  echo "${status[-1]}"
  table nochart "$@" > /dev/null
done
table chart "$@"
cat "$OUT/modes.txt"
gzip -c "$WORK/modes.log" > "$OUT/modes.log.gz"
tar -czf "$OUT/traces.tar.gz" -C "$WORK" machine.txt $(cd "$WORK" && ls -d modes/run-*/ 2>/dev/null | sed 's,/$,,') 2>/dev/null
ls -la "$OUT"
echo "whole command: $((SECONDS - START))s"
grep -q '^| ' "$OUT/modes.txt"
