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
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
RUN=$WORK/one_gpu
rm -rf "$RUN"
T=${T:-420}  # seconds for the run itself (stopped cleanly after); the rest of the 10 minutes: install, charts
timeout -s INT "$T" "${FERRYMAN[@]}" train examples/gpu/one_gpu.yaml "run_dir=$RUN" "model.path=$WORK/qwen2.5-0.5b-random" "$@" \
  > "$WORK/train.log" 2>&1
rc=$?
echo "ferryman train exited with $rc"; tail -5 "$WORK/train.log"
cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$OUT/" 2>/dev/null
"${FERRYMAN[@]}" timeline "$RUN" -o "$OUT/timeline.png" --titles "one H200: vLLM x2 + FSDP2, cuda_ipc, mode (d)" > "$WORK/timeline.json" 2>&1 || tail -3 "$WORK/timeline.json"
python3 bench/plot_curve.py "$RUN" -o "$OUT/reward.png" --title "sequence (32 digits), random Qwen2.5-0.5B shape, one H200" || true
python3 bench/gpu_report.py "$RUN" --min-syncs 10 --reward-share 0.8 --within-s 300 | tee "$OUT/report.txt"
gzip -c "$WORK/train.log" > "$OUT/train.log.gz"
tar -czf "$OUT/run.tar.gz" -C "$WORK" machine.txt timeline.json one_gpu/config.yaml one_gpu/run.json one_gpu/trace 2>/dev/null
ls -la "$OUT"
exit $rc
