#!/usr/bin/env bash
# Regenerates tests/data/golden/quant: the types moegraph reads beyond
# $MOEGRAPH_SHARED/golden/quant's, quantized and dequantized by llama.cpp's own ggml
# (v0.5.0, from the node-llama-cpp bundle) on the same input rows
# (golden/quant/input.f32: 6 rows of 1024). Prints the table in the folder's
# README.md. Needs npm's registry the first time; not part of `make test`.
# Usage: tools/llama-crosscheck/golden-quant.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/tests/data/golden/quant}
shared=${MOEGRAPH_SHARED:-$root/../shared}
bundle=$here/node_modules/node-llama-cpp/llama/gitRelease.bundle
cache=$root/build-llama-ggml
[[ -f $bundle ]] || (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
[[ -d $cache/src/.git ]] || git clone -q "$bundle" "$cache/src"
ggml=$cache/src/ggml
mkdir -p "$cache/obj" "$out"
if [[ ! -x $cache/golden_quant ]]; then
  # ggml-base alone (no CPU backend): ggml.c's quantize_chunk and the types' to_float.
  # Flags as ggml's CMake gives ggml-base: no -march, so no FMA contraction.
  # ggml-version.h as ggml's CMake configures it (src/ggml-version.h.in).
  sed -e 's/@GGML_VERSION@/0.5.0/; s/@GGML_BUILD_COMMIT@/bundle/' \
    "$ggml/src/ggml-version.h.in" > "$cache/obj/ggml-version.h"
  objs=()
  for src in ggml.c ggml-quants.c ggml-alloc.c ggml.cpp ggml-backend.cpp ggml-opt.cpp \
             ggml-threading.cpp gguf.cpp ggml-backend-meta.cpp; do
    obj=$cache/obj/${src%.*}.${src##*.}.o
    if [[ $src == *.c ]]; then cc=(gcc -std=gnu11); else cc=(g++ -std=gnu++17); fi
    "${cc[@]}" -O2 -DNDEBUG -D_GNU_SOURCE -I "$cache/obj" -I "$ggml/include" -I "$ggml/src" \
      -c "$ggml/src/$src" -o "$obj"
    objs+=("$obj")
  done
  gcc -std=gnu11 -O2 -I "$ggml/include" -c "$here/golden_quant.c" -o "$cache/obj/golden_quant.o"
  g++ -o "$cache/golden_quant" "$cache/obj/golden_quant.o" "${objs[@]}" -lm -lpthread
fi
"$cache/golden_quant" "$shared/golden/quant/input.f32" 6 1024 "$out" \
  q4_1 q5_0 q5_1 q2_K q3_K iq4_nl iq4_xs mxfp4
