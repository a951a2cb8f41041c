#!/bin/bash
# The vllm engine on one H200 (issue "GPU runs on one H200", run 5, vLLM side): the GPU tests of
# the `thread` core, then bench/engine.py's rows vllm-raw, vllm and vllm-stream, each in a process
# of its own (vLLM's sleep-mode memory pool allows one engine per process), and their table.
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_vllm_engine.sh
#
# Environment: ROWS (default "vllm-raw vllm vllm-stream"; ROW:on / ROW:off runs a row with vLLM's
# async scheduling on / off, ROW/process with --vllm-core process, e.g.
# "vllm-raw vllm-raw:off vllm vllm:on vllm/process"), TESTS=0 skips the tests,
# SYNC_TESTS=1 runs them again with the thread core's async scheduling off (the default is vLLM's:
# on), ASYNC_TESTS=1 with it on explicitly, T_TESTS (default 240 s
# each), T_ROW (default 150 s a row).
# $OUT gets: gpu_thread.log (pytest), engine_<row>.json and engine_<row>.log, engine.txt (table).
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
gpu_tests() {  # gpu_tests LOG ASYNC(0|1|""): the thread core's GPU tests
  FERRYMAN_VLLM_TEST_ASYNC=$2 FERRYMAN_VLLM_TEST_CORES=thread timeout -s KILL "${T_TESTS:-240}" python3 -m pytest \
    -o addopts="" -m gpu --import-mode=importlib -p no:cacheprovider -q -rA --durations=10 --timeout 150 \
    packages/engine-vllm/tests/test_gpu.py > "$OUT/$1" 2>&1
  echo "thread core GPU tests$([ "$2" = 1 ] && echo ", async scheduling on")$([ "$2" = 0 ] && echo ", async scheduling off"): $(tail -1 "$OUT/$1")"
}
[ "${TESTS:-1}" != 0 ] && gpu_tests gpu_thread.log ""
[ "${SYNC_TESTS:-0}" = 1 ] && gpu_tests gpu_thread_sync.log 0
[ "${ASYNC_TESTS:-0}" = 1 ] && gpu_tests gpu_thread_async.log 1
files=()
for spec in ${ROWS:-vllm-raw vllm vllm-stream}; do
  core=thread
  case $spec in */process) core=process spec=${spec%/process} ;; esac
  row=${spec%%:*} sched=default tag=$spec
  [ "$spec" != "$row" ] && sched=${spec#*:} tag=$row-$sched
  [ "$core" = process ] && tag=$tag-process spec=$spec/process
  timeout -s KILL "${T_ROW:-150}" python3 bench/engine.py --engines "$row" --vllm-async-scheduling "$sched" --vllm-core "$core" \
    --gpu-memory-utilization 0.5 --out "$OUT/engine_$tag.json" > "$OUT/engine_$tag.log" 2>&1
  echo "$spec: exit $? $(grep -E '^\{' "$OUT/engine_$tag.log" | tail -1)"
  [ -f "$OUT/engine_$tag.json" ] && files+=("$OUT/engine_$tag.json")
done
[ ${#files[@]} -gt 0 ] && python3 bench/engine.py --table "${files[@]}" | tee "$OUT/engine.txt"
cat "$WORK/machine.txt"
