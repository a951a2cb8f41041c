#!/bin/bash
# Megatron on one H200 (issue "GPU runs on one H200", run 6): the trainer-megatron GPU tests
# (TrainerContract on the real runtime; log-probs and a PPO step beside trainer-fsdp at the
# Qwen2.5-1.5B shape in bf16), then bench/train_step.py --trainer both (fsdp, then megatron, on
# the same model and batches; megatron/fsdp ratios) at 1.5B and 7B with 8k-token rows. One
# command, from the repository root:
#
#   OUT=/some/dir WHEEL_DIR=/root/w bench/gpu_megatron.sh
#
# WHEEL_DIR must hold the set with megatron-core (`tools/gpu_wheels.py download --extra vllm
# --extra megatron`). The pipeline with the Megatron trainer (run 2) is bench/gpu_e2e.sh:
#   RUN_NAME=one_gpu_megatron bench/gpu_e2e.sh trainer.type=megatron
# $OUT gets: megatron_tests.txt, train_step.jsonl, train_step.txt (and megatron_parity.txt/.jsonl
# with PARITY=1: bench/megatron_parity.py, log-probs per layer spec and TE kernel choice). TESTS=0 skips the tests,
# SHAPES="7b" picks the train_step rows (default "1.5b 7b"), MEG_IMPL=transformer_engine runs
# them with TE's layer spec (trainer.transformer_impl; needs the set from `--extra megatron-te`;
# the GPU tests run with TE as well whenever it imports), T_TESTS / T_PARITY / T_15B / T_7B bound each.
set -u
source "$(dirname "$0")/gpu_common.sh"
cd "$ROOT" || exit 1
python3 -c "import megatron.core" 2>/dev/null || { echo "megatron-core is not installed (carry it: --extra megatron)"; exit 4; }
MEG_IMPL=${MEG_IMPL:-local}
if [ "$MEG_IMPL" = transformer_engine ]; then
  # TE's version, and the cuDNN files the process has open once TE is imported the way
  # trainer-megatron imports it (after cuda_libs.share_torch_cudnn): one folder is right
  python3 -W ignore -c "
from ferryman_trainer_megatron.cuda_libs import share_torch_cudnn
share_torch_cudnn()
import os, transformer_engine as te, transformer_engine.pytorch
print('transformer_engine', te.__version__, 'CUDNN_PATH', os.environ.get('CUDNN_PATH'))
print('cuDNN open:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn' in l}))" ||
    { echo "transformer_engine does not import (carry --extra megatron-te)"; exit 4; }
  # cuDNN names the failing step itself when TE's fused attention fails
  export CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr
fi
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${T_TESTS:-360}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider -s --durations=8 packages/trainer-megatron/tests/test_gpu.py \
    > "$OUT/megatron_tests.txt" 2>&1
  echo "megatron GPU tests exited with $?"; grep -E "PARITY|passed|failed|Error|SKIP" "$OUT/megatron_tests.txt" | tail -14
fi
if [ "${PARITY:-0}" = 1 ]; then
  # log-probs beside FSDP per layer spec and TE kernel choice (bench/megatron_parity.py)
  timeout "${T_PARITY:-240}" python3 bench/megatron_parity.py --json "$OUT/megatron_parity.jsonl" > "$OUT/megatron_parity.txt" 2>&1
  echo "megatron_parity exited with $?"; grep -E "mean \||FAILED|skipped|Error|batch tokens" "$OUT/megatron_parity.txt" | tail -20
fi
# 7B: FSDP fits one H200 (16 bytes a parameter of states); Megatron's mixed-precision optimizer
# needs 18 (its bf16 weights besides float32 main weights): 128 GiB of states at 7.6 B
# parameters, of the H200's 140), so with the local spec part of its optimizer is offloaded to
# host memory (MEG_OFFLOAD_7B, trainer.optimizer_offload_fraction). Measured: 0.1 ran out of
# memory when Adam's states were first made (135.5 GiB allocated); 0.3 ran with a peak of
# 130.5 GiB. With TE the main weights are kept as 16-bit remainders of the bf16 ones
# (trainer.optimizer_param_remainders, on by default there): 16 bytes, as FSDP, so no offload.
[ "$MEG_IMPL" = transformer_engine ] && OFF7=0 || OFF7=0.3
for spec in "1.5b ${T_15B:-150} 0" "7b ${T_7B:-300} ${MEG_OFFLOAD_7B:-$OFF7}"; do
  set -- $spec
  case " ${SHAPES:-1.5b 7b} " in *" $1 "*) ;; *) continue ;; esac
  echo "=== train_step --trainer both --shape $1 --megatron-offload-fraction $3 --megatron-impl $MEG_IMPL" | tee -a "$OUT/train_step.txt"
  timeout "$2" torchrun --standalone --nproc-per-node 1 bench/train_step.py --shape "$1" --seq-len 8192 --steps 2 \
    --trainer both --megatron-offload-fraction "$3" --megatron-impl "$MEG_IMPL" --json "$OUT/train_step.jsonl" >> "$OUT/train_step.txt" 2>&1
  echo "exit $?" >> "$OUT/train_step.txt"
done
grep -E "^\[|RESULT|RATIO|OutOfMemory|Error:|exit" "$OUT/train_step.txt" | grep -v Warning | tail -20
