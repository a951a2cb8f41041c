#!/bin/bash
# Run 7 of the issue "GPU runs on one H200": faults on the GPU. bench/gpu_faults.py runs a short
# run-1-like training (examples/gpu/one_gpu.yaml: two vLLM replicas and the FSDP2 trainer on the
# one GPU, cuda_ipc, mode (d)), SIGKILLs one engine replica's actor process in the middle of it,
# checks that the replica is quarantined and the run goes on, stops the run (SIGTERM: checkpoint,
# exit 75), resumes it with `ferryman train --resume` and checks that no sample was lost and none
# trained twice. One command under 10 minutes, from the repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_faults.sh [bench/gpu_faults.py options] [overrides ...]
#
# $OUT gets faults.txt (what happened, each check, PASS/FAIL), faults.json, faults.log.gz (both
# ferryman processes' output), run.tar.gz (config, summary, metrics, trace). Environment:
# CONFIG (default examples/gpu/one_gpu.yaml; bench/smoke/cpu_one.yaml with
# FERRYMAN_SKIP_INSTALL=1 is the CPU check of the same logic), TOTAL (seconds for the bench,
# default 520, install not counted).
START=$SECONDS
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
CONFIG=${CONFIG:-examples/gpu/one_gpu.yaml}
TOTAL=${TOTAL:-520}
RUN=$WORK/faults
extra=()
# the run-1 model, built once per machine (gpu_e2e.sh uses the same directory)
[ "$CONFIG" = examples/gpu/one_gpu.yaml ] && extra+=("model.path=$WORK/qwen2.5-0.5b-random")
python3 bench/gpu_faults.py --out "$OUT" --config "$CONFIG" --run-dir "$RUN" --total-s "$TOTAL" "$@" ${extra[@]+"${extra[@]}"}
rc=$?
gzip -c "$OUT/faults.log" > "$OUT/faults.log.gz" && rm -f "$OUT/faults.log"
tar -czf "$OUT/run.tar.gz" -C "$WORK" machine.txt \
  $(cd "$WORK" && ls -d faults/config.yaml faults/summary.json faults/metrics.jsonl faults/run.json faults/trace 2>/dev/null) 2>/dev/null
ls -la "$OUT"
echo "whole command: $((SECONDS - START))s"
exit $rc
