#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with CUDA for sm_90 only, from the llama.cpp
# v0.5.0 source the node-llama-cpp npm package bundles
# (tools/llama-crosscheck/node_modules/node-llama-cpp/llama/gitRelease.bundle;
# `npm ci` in tools/llama-crosscheck fetches it), for the device check's side by
# side run (tools/device-check.sh --bundle carries it). ggml-cuda's kernels take
# hours on this 2-core machine: run it in the background (nice), once; the result
# is cached in DEST (default build-llama-cuda/, ignored by git) and a finished
# build is left alone. Never run by CI.
#
# Usage: tools/build-llama-cuda.sh [DEST]     (JOBS=N sets the build's parallelism)
# Result: DEST/build/bin/llama-bench, linked statically against ggml and llama;
# the CUDA runtime and cuBLAS stay shared libraries (the device image's toolkit
# has them; the bundle does not carry them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/build-llama-cuda}
bundle=$root/tools/llama-crosscheck/node_modules/node-llama-cpp/llama/gitRelease.bundle
if [[ -x $dest/build/bin/llama-bench ]]; then
  echo "build-llama-cuda: $dest/build/bin/llama-bench is built"
  exit 0
fi
if [[ ! -f $bundle ]]; then
  echo "build-llama-cuda: no $bundle (run npm ci in tools/llama-crosscheck)" >&2
  exit 1
fi
[[ -d $dest/src/.git ]] || git clone -q "$bundle" "$dest/src"
cmake -S "$dest/src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
cmake --build "$dest/build" --target llama-bench -j "${JOBS:-2}"
echo "build-llama-cuda: built $dest/build/bin/llama-bench"
