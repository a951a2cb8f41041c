# Sourced on the project's GPU machine (no internet): settings SGLang needs there, the ferryman
# sources on PYTHONPATH, and `install_sglang`, which installs the wheels that
# tools/sglang-gpu-wheels.sh gathered (copied, folder by folder, into $WHEELS).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# JIT kernels (FlashInfer, sgl-kernel's) need nvcc, c++ and ninja, on PATH there, and CUDA_HOME
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
  export CUDA_HOME=/usr/local/cuda
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
WHEELS=${WHEELS:-/root/w}
SITE=${SITE:-/root/site-sglang}
export PYTHONPATH=$SITE:$ROOT/packages/core/src:$ROOT/packages/engine-hf/src:$ROOT/packages/engine-sglang/src
# SGLang puts torch_memory_saver's hook library into its scheduler processes (LD_PRELOAD); it
# needs libcudart.so.13 and has no RUNPATH: torch's CUDA 13 libraries (nvidia/cu13/lib beside
# torch in the site) go on LD_LIBRARY_PATH. Run by install_sglang, once torch is installed.
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
  [ -f "$SITE/.ferryman_done" ] && { sglang_lib_env; return 0; }
  (
    cd "$WHEELS" || exit 1
    # wheels over 56 MiB came split: NAME.whl.part00, NAME.whl.part01, ...
    for first in ./*.whl.part00; do
      [ -e "$first" ] || continue
      whl=${first%.part00}
      cat "$whl".part* > "$whl" && rm "$whl".part*
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" ./*.whl
  ) && touch "$SITE/.ferryman_done" && sglang_lib_env
}
