#!/bin/bash
# GPU tests of the sglang engine on the project's GPU machine; logs to ${OUT:-.}.
source "$(dirname "$0")/gpu_env.sh"
install_sglang || { echo "SGLang install failed"; exit 3; }
cd "$ROOT" || exit 1
python3 -c "import sglang, sglang.srt.entrypoints.engine; print('sglang', sglang.__version__)" > "${OUT:-.}/import.log" 2>&1 \
  || { tail -5 "${OUT:-.}/import.log"; exit 4; }
timeout -s KILL 480 python3 -m pytest -o addopts="" -m gpu --import-mode=importlib -p no:cacheprovider -q -rA \
  --durations=25 --timeout 300 packages/engine-sglang/tests/test_gpu.py > "${OUT:-.}/gpu_sglang.log" 2>&1
echo "sglang GPU tests: $(tail -1 "${OUT:-.}/gpu_sglang.log")"
