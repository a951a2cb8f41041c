# Sourced by bench/gpu_e2e.sh and bench/gpu_modes.sh on the project's GPU machine (no internet):
# the settings the GPU stack needs there (packages/engine-vllm/tools/gpu_env.sh has the story of
# each), the locked wheels installed from WHEEL_DIR by the lead's tools/gpu-install.sh, this
# checkout's packages on PYTHONPATH with their plugin hooks named in FERRYMAN_PLUGINS (a source
# checkout has no entry points), and $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/runs/gpu-out}
mkdir -p "$OUT"
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.gpuwheels}
WORK=${WORK:-/tmp/ferryman-gpu}
mkdir -p "$WORK"
if [ -z "${FERRYMAN_SKIP_INSTALL:-}" ]; then
  # the installer puts the wheels on PYTHONPATH: sourced, so that its exports stay here
  # shellcheck disable=SC1091
  source "$ROOT/tools/gpu-install.sh" "$WHEEL_DIR" || { echo "gpu-install.sh $WHEEL_DIR failed" >&2; exit 3; }
fi
for pkg in core engine-hf engine-vllm trainer-fsdp sync-nccl router; do
  PYTHONPATH="$ROOT/packages/$pkg/src${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH
export FERRYMAN_PLUGINS=ferryman_engine_hf.hooks,ferryman_engine_vllm.hooks,ferryman_trainer_fsdp.hooks,ferryman_sync_nccl.hooks,ferryman_router.hooks
FERRYMAN=(python3 -m ferryman.cli)
# what the machine is, once, for the record
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, vllm, ray, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
} > "$WORK/machine.txt" 2>&1
