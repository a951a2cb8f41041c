#!/bin/bash
# Benches of the sglang engine on the project's GPU machine: bench/engine.py rows sglang,
# sglang-raw (SGLang's own Engine on the same prompts) and hf, then bench/sglang_weights.py
# (the tensor path; the distributed path too when 2 GPUs are visible). Logs to ${OUT:-.}.
source "$(dirname "$0")/gpu_env.sh"
install_sglang || { echo "SGLang install failed"; exit 3; }
cd "$ROOT" || exit 1
timeout -s KILL 360 python3 bench/engine.py --engines ${ENGINES:-sglang,sglang-raw,hf} \
  --out "${OUT:-.}/bench-engine-sglang.json" > "${OUT:-.}/bench_engine_sglang.log" 2>&1
tail -9 "${OUT:-.}/bench_engine_sglang.log"
timeout -s KILL 200 python3 bench/sglang_weights.py --out "${OUT:-.}/bench-sglang-weights.json" \
  > "${OUT:-.}/bench_sglang_weights.log" 2>&1
tail -6 "${OUT:-.}/bench_sglang_weights.log"
