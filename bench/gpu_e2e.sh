#!/bin/bash
# The whole pipeline on one H200: `ferryman train examples/gpu/one_gpu.yaml` (two vLLM engine
# replicas and the FSDP2 trainer sharing the GPU, weights over CUDA IPC, mode (d), the
# `sequence` task on a random Qwen2.5-0.5B shape), then its metrics, summary, timeline chart and
# reward curve into $OUT. One command under 10 minutes, from the repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_e2e.sh [dotted overrides ...]
#
# e.g. `bench/gpu_e2e.sh training.total_steps=60 trainer.lr=1e-4`. $OUT gets at most 8 files:
# metrics.jsonl, summary.json, timeline.png, reward.png, report.txt (the numbers every run
# reports, and whether the goals were met), train.log.gz, run.tar.gz (config, trace, Ray logs).
#
# A run longer than one command goes in parts, one command each (the run directory, under
# $WORK, stays on the machine between the calls of one lease):
#
#   PART=1 bench/gpu_e2e.sh [overrides ...]   # a new run; at T seconds SIGTERM: ferryman saves a
#                                             # checkpoint at the next sync and exits 75
#   PART=2 bench/gpu_e2e.sh                   # ferryman train --resume: the same run goes on
#                                             # (PART=3, ... likewise); overrides are not taken
#
# Each part's report, charts and metrics cover the run so far (bench/gpu_report.py joins the
# parts). Without PART (the default) the run is stopped with SIGINT at T, as one command.
# Environment: T (seconds of `ferryman train`, default 420), GRACE (seconds a stopped run gets to
# exit before its whole session is SIGKILLed: default 30, with PART 90: a checkpoint of the
# 0.5B shape with its AdamW state is ~6 GB), CONFIG (default examples/gpu/one_gpu.yaml),
# RUN_NAME (the run directory's name under $WORK, default one_gpu), MODEL (the model directory,
# default $WORK/qwen2.5-0.5b-random), WITHIN_S (the reward goal's
# seconds of training, default 300; 0.8 of the maximum), TL_STEPS (the timeline's steps), TL_TITLE
# (the timeline's title: say the engines and trainer, e.g. "one H200: SGLang x2 + FSDP2, cuda_ipc,
# mode (d)"), TITLE (the reward chart's).
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
CONFIG=${CONFIG:-examples/gpu/one_gpu.yaml}
MODEL=${MODEL:-$WORK/qwen2.5-0.5b-random}  # built on the first run, kept for the later ones
RUN=$WORK/${RUN_NAME:-one_gpu}
PART=${PART:-}
T=${T:-420}  # seconds for the run itself (stopped cleanly after); the rest of the 10 minutes: install, charts
WITHIN_S=${WITHIN_S:-300}
if [ -z "$PART" ]; then
  rm -rf "$RUN" "$WORK/train.log"
  run_limited "$T" INT "${GRACE:-30}" "$WORK/train.log" "${FERRYMAN[@]}" train "$CONFIG" "run_dir=$RUN" "model.path=$MODEL" "$@"
  rc=$?
elif [ "$PART" = 1 ]; then
  rm -rf "$RUN" "$WORK/train.log"
  run_limited "$T" TERM "${GRACE:-90}" "$WORK/train.log" "${FERRYMAN[@]}" train "$CONFIG" "run_dir=$RUN" "model.path=$MODEL" "$@"
  rc=$?
else
  if [ ! -d "$RUN/checkpoints" ]; then
    echo "PART=$PART: $RUN has no checkpoints/ (run PART=1 first, in the same lease)" >&2
    exit 2
  fi
  [ $# -gt 0 ] && echo "PART=$PART: overrides ignored on resume ($*)" >&2
  echo "=== part $PART: ferryman train --resume $RUN" >> "$WORK/train.log"
  run_limited "$T" TERM "${GRACE:-90}" "$WORK/train.log" "${FERRYMAN[@]}" train --resume "$RUN"
  rc=$?
fi
echo "ferryman train exited with $rc${PART:+ (part $PART)}"; tail -5 "$WORK/train.log"
# this part's start: the next part's resume rewrites run.json
[ -n "$PART" ] && cp "$RUN/run.json" "$RUN/run.part$PART.json" 2>/dev/null
cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$OUT/" 2>/dev/null
# the timeline: TL_STEPS (FIRST:LAST), by default the last 20 steps of this command's part (a
# chart of hundreds of steps, a sync after each, is a solid block of colour; one across the pause
# between two commands would be mostly gap)
steps=()
range=${TL_STEPS:-$(python3 -c "
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
t0 = json.load(open(sys.argv[2]))['started_at']
mine = [r['step'] for r in rows if r['time'] >= t0]
print(f'{max(mine[0], mine[-1] - 19)}:{mine[-1]}' if mine else '')" "$RUN/metrics.jsonl" "$RUN/run.json" 2>/dev/null)}
[ -n "$range" ] && steps=(--steps "$range")
"${FERRYMAN[@]}" timeline "$RUN" ${steps[@]+"${steps[@]}"} -o "$OUT/timeline.png" --titles "${TL_TITLE:-one H200: vLLM x2 + FSDP2, cuda_ipc, mode (d)}${PART:+, part $PART}" > "$WORK/timeline.json" 2>&1 || tail -3 "$WORK/timeline.json"
python3 bench/gpu_report.py "$RUN" --min-syncs 10 --reward-share 0.8 --within-s "$WITHIN_S" \
  --plot "$OUT/reward.png" --title "${TITLE:-sequence (32 digits), random Qwen2.5-0.5B shape, one H200}" | tee "$OUT/report.txt"
gzip -c "$WORK/train.log" > "$OUT/train.log.gz"
tar -czf "$OUT/run.tar.gz" -C "$WORK" machine.txt timeline.json \
  $(cd "$WORK" && ls -d "$(basename "$RUN")"/config.yaml "$(basename "$RUN")"/run*.json "$(basename "$RUN")"/trace 2>/dev/null) 2>/dev/null
ls -la "$OUT"
exit $rc
