# Sourced by bench/gpu_e2e.sh and bench/gpu_modes.sh on the project's GPU machine (no internet):
# the settings the GPU stack needs there (packages/engine-vllm/tools/gpu_env.sh has the story of
# each), the locked wheels and this checkout's packages installed by tools/gpu-install.sh from
# WHEEL_DIR (default /root/w, where the .gpuwheels folders were copied), $OUT and $WORK.
# FERRYMAN_SKIP_INSTALL=1: use what is installed, with this checkout's sources on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/runs/gpu-out}
mkdir -p "$OUT"
WHEEL_DIR=${WHEEL_DIR:-/root/w}
WORK=${WORK:-/tmp/ferryman-gpu}
mkdir -p "$WORK"
if [ -z "${FERRYMAN_SKIP_INSTALL:-}" ]; then
  # the locked wheels (once) and this checkout's packages (every call, with their entry points);
  # sourced, so that its PYTHONPATH and settings stay here
  # shellcheck disable=SC1091
  source "$ROOT/tools/gpu-install.sh" "$WHEEL_DIR" || { echo "tools/gpu-install.sh $WHEEL_DIR failed" >&2; exit 3; }
else
  # the stack is installed already: this checkout's sources, their plugin hooks named
  for pkg in core engine-hf engine-vllm trainer-fsdp sync-nccl router; do
    PYTHONPATH="$ROOT/packages/$pkg/src${PYTHONPATH:+:$PYTHONPATH}"
  done
  export PYTHONPATH
  export FERRYMAN_PLUGINS=ferryman_engine_hf.hooks,ferryman_engine_vllm.hooks,ferryman_trainer_fsdp.hooks,ferryman_sync_nccl.hooks,ferryman_router.hooks
fi
FERRYMAN=(python3 -m ferryman.cli)
# what the machine is, once, for the record
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, vllm, ray, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
} > "$WORK/machine.txt" 2>&1
