#!/bin/bash
# Gathers SGLang 0.5.17 (CUDA 13, torch 2.11) and the wheels it needs that the project's GPU
# machine lacks (it has python3.12, torch 2.11+cu130 with its nvidia-* CUDA libraries, triton,
# transformers, tokenizers, safetensors, huggingface_hub, numpy; no pydantic, no SGLang), and
# splits them into folders of at most 56 MiB: OUT/c1 … OUT/cN (each fits one 64 MiB transfer).
# Run it from the project root on a machine that reaches PyPI:
#     bash packages/engine-sglang/tools/sglang-gpu-wheels.sh .sglwheels
# On the GPU machine copy the folders' files into one directory ($WHEELS, default /root/w) in
# turn; tools/gpu_env.sh joins the split wheels and installs everything (install_sglang).
#
# The requirement set is sglang==0.5.17's (Requires-Dist of its wheel) resolved by pip for
# cp312 / manylinux x86_64, with torch pinned to the machine's 2.11.0 and then every wheel the
# machine already has removed. The big ones: sglang-kernel 0.4.5 (~380 MB, split), flashinfer
# python/cubin 0.6.15.post1, nvidia-cutlass-dsl 4.6.0, tilelang 0.1.11, flash-attn-4, sglang
# itself (~22 MB). Not seen installed on that machine yet: the first GPU session checks
# `python3 -c "import sglang.srt.entrypoints.engine"` and adds what an ImportError names.
set -euo pipefail
out=${1:-.sglwheels}
version=${SGLANG_VERSION:-0.5.17}
tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any)
printf 'torch==2.11.0\ntorchaudio==2.11.0\n' > "$tmp/constraints.txt"
python3 -m pip download -q "${plat[@]}" -c "$tmp/constraints.txt" -d "$tmp/w" \
  "sglang==$version" pytest-asyncio pytest-timeout
# what the GPU machine has already (torch's CUDA libraries included)
( cd "$tmp/w" && rm -f torch-* torchaudio-* torchvision-* triton-* nvidia_cublas* nvidia_cuda_* \
  nvidia_cudnn* nvidia_cufft* nvidia_cufile* nvidia_curand* nvidia_cusolver* nvidia_cusparse* \
  nvidia_nccl* nvidia_nvjitlink* nvidia_nvtx* nvidia_nvshmem* transformers-* tokenizers-* \
  safetensors-* huggingface_hub-* hf_xet-* numpy-* sympy-* mpmath-* networkx-* jinja2-* \
  markupsafe-* filelock-* fsspec-* typing_extensions-* setuptools-* packaging-* pyyaml-* \
  regex-* requests-* urllib3-* idna-* certifi-* charset_normalizer-* tqdm-* pytest-[0-9]* \
  pluggy-* iniconfig-* )
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
