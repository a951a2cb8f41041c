#!/bin/bash
# 7B (and 1.5B) on one H200 (bench/results/train_step.md). From the repository root on the GPU
# machine; pydantic wheels travel in .devwheels/ as for bench/gpu_train_step.sh.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/pydantic*.whl .devwheels/annotated*.whl .devwheels/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/packages/core/src:$PWD/packages/trainer-fsdp/src
J=$OUT/train_step.jsonl
run() { echo "=== $*"; timeout ${T:-200} torchrun --standalone --nproc-per-node "$@" --json $J 2>&1 | grep -E "OutOfMemory|Error:|step|RESULT|loaded|built" | grep -v Warning | head -8; }
T=200 run 1 bench/train_step.py --shape 7b --seq-len 8192 --steps 2
T=100 run 1 bench/train_step.py --shape 1.5b --seq-len 8192 --no-checkpointing
