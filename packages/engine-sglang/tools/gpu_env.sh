# Sourced on the project's GPU machine (no internet): settings SGLang needs there, the ferryman
# sources on PYTHONPATH, and `install_sglang`, which installs the wheels that
# tools/sglang-gpu-wheels.sh gathered (copied, folder by folder, into $WHEELS).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  SGLANG_DISABLE_REQUEST_LOGGING=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
WHEELS=${WHEELS:-/root/w}
SITE=${SITE:-/root/site-sglang}
export PYTHONPATH=$SITE:$ROOT/packages/core/src:$ROOT/packages/engine-hf/src:$ROOT/packages/engine-sglang/src
install_sglang() {
  [ -f "$SITE/.ferryman_done" ] && return 0
  (
    cd "$WHEELS" || exit 1
    # wheels over 56 MiB came split: NAME.whl.part00, NAME.whl.part01, ...
    for first in ./*.whl.part00; do
      [ -e "$first" ] || continue
      whl=${first%.part00}
      cat "$whl".part* > "$whl" && rm "$whl".part*
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" ./*.whl
  ) && touch "$SITE/.ferryman_done"
}
