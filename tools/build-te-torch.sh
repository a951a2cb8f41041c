#!/bin/bash
# Build the wheel of Transformer Engine's PyTorch extension (transformer-engine-torch, published on
# PyPI as source only) for the GPU machine, on a machine without a GPU, and put it into the wheel
# cache of tools/gpu_wheels.py (which then carries it with `--extra megatron-te`):
#
#   bash tools/build-te-torch.sh [CACHE]        # default .gpuwheels-cache; about 20 min on 2 cores
#   uv run python tools/gpu_wheels.py download --extra vllm --extra megatron-te
#
# The extension is plain C++ against torch and the CUDA, cuBLAS, cuDNN, NCCL and NVSHMEM headers
# (no .cu files: nvcc is only asked its version), all taken from nvidia-* wheels of the locked
# CUDA 13.0 series (NVTE_BUILD_USE_NVIDIA_WHEELS). Its kernels are in transformer-engine-cu13, a
# binary wheel from the index. The source and its sha256 come from uv.lock; the build runs in a
# virtual environment of its own under $WORK (default /tmp/ferryman-te-build), niced, one
# compile job at a time (MAX_JOBS). The wheel needs glibc 2.34 or newer where it runs.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE=$(realpath -m "${1:-$ROOT/.gpuwheels-cache}")
WORK=${WORK:-/tmp/ferryman-te-build}
export PATH="$HOME/.local/bin:$PATH"
PY=${UV_PYTHON:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3}
read -r VERSION URL SHA < <(python3 - "$ROOT/uv.lock" <<'EOF'
import sys, tomllib
lock = tomllib.load(open(sys.argv[1], "rb"))
for p in lock["package"]:
    if p["name"] == "transformer-engine-torch":
        print(p["version"], p["sdist"]["url"], p["sdist"]["hash"].removeprefix("sha256:"))
        break
else:
    sys.exit("uv.lock has no transformer-engine-torch (the megatron-te extra)")
EOF
)
TORCH=$(python3 -c "import tomllib; print(next(p['version'] for p in tomllib.load(open('$ROOT/uv.lock','rb'))['package'] if p['name']=='torch'))")
OUT="$CACHE/transformer_engine_torch-$VERSION-cp312-cp312-linux_x86_64.whl"
if [ -f "$OUT" ]; then echo "already built: $OUT"; exit 0; fi
mkdir -p "$WORK" "$CACHE"
V=$WORK/venv
SP=$V/lib/python3.12/site-packages
[ -x "$V/bin/python" ] || uv venv -q "$V" --python "$PY"
# torch as locked (its CUDA 13.0 build), the build tools, and the CUDA 13.0 headers and nvcc
uv pip install -q --python "$V/bin/python" pip "torch==$TORCH" setuptools wheel packaging ninja pybind11 \
  "nvidia-cudnn-frontend>=1.28.0" "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-cccl==13.0.*"
SDIST=$WORK/transformer_engine_torch-$VERSION.tar.gz
[ -f "$SDIST" ] || curl -sSL -o "$SDIST" "$URL"
echo "$SHA  $SDIST" | sha256sum --quiet -c -
# a fresh tree every time: the build deletes parts of its own source tree after it
rm -rf "$WORK/src" "$WORK/dist" && mkdir -p "$WORK/src" "$WORK/dist"
tar xzf "$SDIST" -C "$WORK/src"
export PATH="$V/bin:$PATH" NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 \
  CUDA_HOME=$SP/nvidia/cu13 CUDA_PATH=$SP/nvidia/cu13 NVTE_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-1}
t0=$SECONDS
(cd "$WORK/src/transformer_engine_torch-$VERSION" &&
  nice -n 19 "$V/bin/python" -m pip wheel -q --no-build-isolation --no-deps . -w "$WORK/dist") > "$WORK/build.log" 2>&1 || {
  echo "build failed after $((SECONDS - t0)) s; the end of $WORK/build.log:"; tail -30 "$WORK/build.log"; exit 1; }
cp "$WORK"/dist/transformer_engine_torch-"$VERSION"-*.whl "$OUT"
echo "built in $((SECONDS - t0)) s: $OUT ($(du -h "$OUT" | cut -f1))"
