#!/bin/bash
# Selective activation checkpointing sweep of bench/train_step.py on the GPU machine (from the
# repository root; pydantic wheels travel in .devwheels/ as for bench/gpu_train_step.sh).
# Results: $OUT/train_step.jsonl, one JSON line per configuration.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/pydantic*.whl .devwheels/annotated*.whl .devwheels/typing_insp*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/packages/core/src:$PWD/packages/trainer-fsdp/src
J=$OUT/train_step.jsonl
run() { echo "=== $*"; timeout ${T:-200} torchrun --standalone --nproc-per-node "$@" --json $J 2>&1 | grep -v -E "Loading weights|Writing|^\s*$" | tail -${TAILN:-8}; }
for n in ${LAYERS:-all 18 12 8}; do
  if [ "$n" = all ]; then T=200 run 2 bench/train_step.py --shape 7b --seq-len 8192; else T=200 run 2 bench/train_step.py --shape 7b --seq-len 8192 --checkpoint-layers $n; fi
done
if [ -n "$SMALL" ]; then
  T=120 run 1 bench/train_step.py --shape 1.5b --seq-len 8192 --no-checkpointing
  T=120 run 2 bench/train_step.py --shape 1.5b --seq-len 8192 --no-checkpointing
fi
nvidia-smi --query-gpu=name,memory.total --format=csv
cat $J
