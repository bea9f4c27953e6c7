#!/usr/bin/env bash
# Prints the golden dot products of tests/cpu_kernels_test.cc (kGgmlDots): each
# type's ggml_vec_dot_* as llama.cpp v0.5.0's CPU backend runs it, from
# node-llama-cpp 3.22.1's prebuilt libggml-cpu-VARIANT.so (default haswell: the
# AVX2 build, whose order moegraph's AVX2 and AVX3 kernels follow; zen4 gives the
# same bits), on inputs the test makes alike (golden_dot.c). Needs an AVX2 CPU,
# and npm's registry the first time; not part of `make test`.
# Usage: [VARIANT=haswell] tools/llama-crosscheck/golden-dot.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bundle=$here/node_modules/node-llama-cpp/llama/gitRelease.bundle
bins=$here/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
cache=$root/build-llama-ggml
variant=${VARIANT:-haswell}
[[ -f $bundle ]] || (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
[[ -d $cache/src/.git ]] || git -c advice.detachedHead=false clone -q "$bundle" "$cache/src"
[[ -f $bins/libggml-cpu-$variant.so ]] || { echo "no $bins/libggml-cpu-$variant.so" >&2; exit 1; }
mkdir -p "$cache"
gcc -std=gnu11 -O2 -I "$cache/src/ggml/include" "$here/golden_dot.c" -o "$cache/golden_dot-$variant" \
  -L "$bins" -l:libggml-cpu-"$variant".so -l:libggml-base.so -Wl,-rpath,"$bins"
"$cache/golden_dot-$variant" q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl mxfp4 q2_K q3_K q4_K q5_K q6_K iq4_xs
