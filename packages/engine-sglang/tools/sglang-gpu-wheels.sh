#!/bin/bash
# Gathers SGLang 0.5.17 (CUDA 13, torch 2.11) and the wheels it needs that the project's GPU
# machine lacks (it has python3.12, torch 2.11+cu130 with its nvidia-* CUDA libraries, triton,
# transformers 5.17; no pydantic, no SGLang), and splits them into folders of at most 56 MiB:
# OUT/c1 … OUT/cN (each fits one 64 MiB transfer).
# Run it from the project root on a machine that reaches PyPI:
#     bash packages/engine-sglang/tools/sglang-gpu-wheels.sh .sglwheels
# On the GPU machine copy the folders' files into one directory ($WHEELS, default /root/w) in
# turn; tools/gpu_env.sh joins the split wheels and installs everything (install_sglang).
#
# The requirement set is sglang-0.5.17-requirements.txt beside this script: sglang==0.5.17's
# Requires-Dist resolved for cp312 / manylinux x86_64 (211 pins). Downloaded without
# dependencies, minus what the machine has (torch 2.11 and its CUDA libraries, triton) and what
# text models do not use (torchaudio, torchvision, torchcodec). transformers/tokenizers come at
# SGLang's pins (5.12.1 / 0.22.2) and, on PYTHONPATH first, shadow the machine's 5.17 for these
# runs. The big ones: sglang-kernel 0.4.5 (~380 MB, split), flashinfer-python 0.6.15.post1,
# nvidia-cutlass-dsl 4.6.0, tilelang 0.1.11, flash-attn-4, the CUDA 13 toolchain wheels
# (nvcc, nvvm, cccl, used by JIT kernels). Not yet installed on that machine: the first GPU session
# checks `python3 -c "import sglang.srt.entrypoints.engine"` (tools/gpu_tests.sh does).
set -euo pipefail
out=${1:-.sglwheels}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
skip='^(torch|torchaudio|torchvision|torchcodec|triton|nvidia-cublas|nvidia-cuda-cupti|nvidia-cuda-nvrtc|nvidia-cuda-runtime|nvidia-cudnn-cu13|nvidia-cufft|nvidia-cufile|nvidia-curand|nvidia-cusolver|nvidia-cusparse|nvidia-cusparselt-cu13|nvidia-nccl-cu13|nvidia-nvjitlink|nvidia-nvshmem-cu13|nvidia-nvtx)=='
grep -v '^#' "$here/sglang-0.5.17-requirements.txt" | grep -Ev "$skip" > "$tmp/want.txt"
echo "pytest-asyncio==1.5.0" >> "$tmp/want.txt"
echo "pytest-timeout==2.4.0" >> "$tmp/want.txt"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/w" -r "$tmp/want.txt"
ls "$tmp/w" | sed 's/^/  /' > "$tmp/list.txt"
rm -rf "$out"; mkdir -p "$out"; n=0
for w in "$tmp"/w/*.whl; do
  if [ "$(stat -c %s "$w")" -gt $((56 * 1024 * 1024)) ]; then
    base=$(basename "$w")
    split -b 56m -d -a 2 "$w" "$tmp/${base}.part"
    rm "$w"
    for p in "$tmp/${base}".part*; do n=$((n + 1)); mkdir -p "$out/c$n"; mv "$p" "$out/c$n/"; done
  fi
done
n=$((n + 1)); mkdir -p "$out/c$n"; size=0
for w in "$tmp"/w/*.whl; do
  s=$(stat -c %s "$w")
  if [ $((size + s)) -gt $((56 * 1024 * 1024)) ]; then n=$((n + 1)); mkdir -p "$out/c$n"; size=0; fi
  mv "$w" "$out/c$n/"; size=$((size + s))
done
cp "$tmp/list.txt" "$out/WHEELS.txt"
rm -rf "$tmp"
du -sh "$out" | sed 's/^/total /'
echo "$(ls -d "$out"/c* | wc -l) folders; wheel list in $out/WHEELS.txt. Keep '$out/' out of git (.git/info/exclude)."
