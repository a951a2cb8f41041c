# Sourced on the project's GPU machine (no internet): the settings SGLang needs there and
# `install_sglang`, which installs the locked SGLang wheel set (`uv run python tools/gpu_wheels.py
# download --extra sglang DIR`, its folders copied one device call each into $WHEELS) and this
# checkout's packages through tools/gpu-install.sh, into a site of its own ($FERRYMAN_SITE): the
# SGLang set pins other versions than the vLLM one. bench/gpu_sglang.sh uses the same.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# JIT kernels (FlashInfer, sgl-kernel's) need nvcc, c++ and ninja, on PATH there, and CUDA_HOME
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
  export CUDA_HOME=/usr/local/cuda
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
WHEELS=${WHEELS:-/root/wsg}
export FERRYMAN_SITE=${FERRYMAN_SITE:-/root/site-sg}
# SGLang puts torch_memory_saver's hook library into its scheduler processes (LD_PRELOAD); it
# needs libcudart.so.13 and has no RUNPATH: torch's CUDA 13 libraries (nvidia/cu13/lib beside
# torch) go on LD_LIBRARY_PATH. Run by install_sglang, once torch is importable.
sglang_lib_env() {
  local lib
  lib=$(python3 -c 'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.join(os.path.dirname(os.path.dirname(s.origin)), "nvidia", "cu13", "lib") if s and s.origin else "")' 2>/dev/null)
  if [ -n "$lib" ] && [ -d "$lib" ]; then
    case ":${LD_LIBRARY_PATH:-}:" in
      *":$lib:"*) ;;
      *) export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
  else
    echo "gpu_env.sh: no nvidia/cu13/lib beside torch; torch_memory_saver's hook may not load" >&2
  fi
}
install_sglang() {
  # shellcheck disable=SC1091
  source "$ROOT/tools/gpu-install.sh" "$WHEELS" || return 3
  sglang_lib_env
}
