#!/bin/bash
# SGLang on one H200 (issue "GPU runs on one H200", run 5): the engine-sglang GPU tests
# (EngineContract on real SGLang, tokens and log-probs against transformers, partial rollout,
# weight loads, radix cache, the pause modes), then bench/engine.py rows sglang, sglang-raw-each
# and sglang-raw (SGLang's own Engine on the same prompts: one call per prompt, and one batch
# call) on one random Qwen2.5-1.5B-shaped model (hf: add ,hf to ENGINES; its row takes minutes). One
# command, from the repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/wsg FERRYMAN_SITE=/root/site-sg bench/gpu_sglang.sh
#
# WHEEL_DIR must hold the SGLang set (`tools/gpu_wheels.py download --extra sglang`); it pins
# other versions than the vLLM set (transformers 5.12.1 among them), so it goes into a site of
# its own (FERRYMAN_SITE). The pipeline with SGLang engines (run 2) is bench/gpu_e2e.sh:
#   CONFIG=examples/gpu/one_gpu_sglang.yaml RUN_NAME=one_gpu_sglang \
#     TL_TITLE="one H200: SGLang x2 + FSDP2, cuda_ipc, mode (d)" bench/gpu_e2e.sh
# $OUT gets: sglang_tests.txt, engine.json, engine.txt. TESTS=0 / BENCH=0 skip a part;
# T_TESTS / T_BENCH bound them; ENGINES picks the bench rows.
set -u
export FERRYMAN_SITE=${FERRYMAN_SITE:-/root/site-sg}
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
# SGLang's settings (CUDA_HOME for its JIT kernels; torch's CUDA 13 libraries on LD_LIBRARY_PATH
# for torch_memory_saver's hook in its scheduler processes), as its package's tools set them
# shellcheck disable=SC1091
source "$ROOT/packages/engine-sglang/tools/gpu_env.sh"
sglang_lib_env
python3 -c "import sglang, sglang.srt.entrypoints.engine; print('sglang', sglang.__version__)" 2>&1 | tail -3
if [ "${TESTS:-1}" = 1 ]; then
  timeout -s KILL "${T_TESTS:-300}" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --durations=15 \
    packages/engine-sglang/tests/test_gpu.py > "$OUT/sglang_tests.txt" 2>&1
  echo "sglang GPU tests exited with $?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" "$OUT/sglang_tests.txt" | tail -30
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout -s KILL "${T_BENCH:-360}" python3 bench/engine.py --engines "${ENGINES:-sglang,sglang-raw-each,sglang-raw}" \
    --gpu-memory-utilization 0.3 --out "$OUT/engine.json" > "$OUT/engine.txt" 2>&1
  echo "bench/engine.py exited with $?"; tail -12 "$OUT/engine.txt"
fi
