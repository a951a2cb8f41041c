#!/bin/bash
# On a GPU machine without internet: install the wheels that tools/gpu_wheels.py packed, then
# the workspace packages from this checkout, and set the environment. Source it:
#
#   source tools/gpu-install.sh [WHEEL_DIR]      # WHEEL_DIR: where the folders' files were
#                                                # gathered (default /root/w)
#
# The folders c1..cN travel one device call each (at most 64 MiB a call); each call copies its
# folder's files into WHEEL_DIR (`cp .gpuwheels/cK/* /root/w/`). The wheels are installed once
# into $FERRYMAN_SITE (default /root/site; marked done by a file holding the MANIFEST's hash); the
# workspace packages (ferryman, its plugins) are installed again on every call into
# $FERRYMAN_WS (default /root/ws), since the checkout changes between calls. Afterwards
# `python3 -m ferryman.cli ...` (or $FERRYMAN_WS/bin/ferryman) runs with its plugins found
# through their entry points.
W=${1:-/root/w}
FERRYMAN_SITE=${FERRYMAN_SITE:-/root/site}
FERRYMAN_WS=${FERRYMAN_WS:-/root/ws}
_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 \
  VLLM_WORKER_MULTIPROC_METHOD=spawn RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0

_ferryman_gpu_install() {
  [ -f "$W/MANIFEST" ] || { echo "gpu-install: no $W/MANIFEST (copy every folder c1..cN into $W first)"; return 3; }
  local want; want=$(sha256sum "$W/MANIFEST" | cut -c1-64)
  if [ "$(cat "$FERRYMAN_SITE/.ferryman_manifest" 2>/dev/null)" != "$want" ]; then
    (
      cd "$W" || exit 3
      for first in *.part00; do
        [ -e "$first" ] || continue
        whl=${first%.part00}
        cat "$whl".part* > "$whl" && rm "$whl".part*
      done
      sha256sum --quiet -c MANIFEST || { echo "gpu-install: a wheel is missing or corrupt (see above)"; exit 3; }
      rm -rf "$FERRYMAN_SITE"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FERRYMAN_SITE" \
        $(cut -c67- MANIFEST) || exit 3
    ) || return 3
    echo "$want" > "$FERRYMAN_SITE/.ferryman_manifest"
    echo "gpu-install: $(wc -l < "$W/MANIFEST") wheels installed into $FERRYMAN_SITE"
  fi
  export PYTHONPATH="$FERRYMAN_SITE${PYTHONPATH:+:$PYTHONPATH}"
  rm -rf "$FERRYMAN_WS"
  # the workspace packages from this checkout (hatchling comes with the wheels: no index, no isolation)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --target "$FERRYMAN_WS" "$_ROOT"/packages/* || { echo "gpu-install: installing the workspace packages failed"; return 3; }
  export PYTHONPATH="$FERRYMAN_WS:$PYTHONPATH" PATH="$FERRYMAN_WS/bin:$PATH"
}
_ferryman_gpu_install
