#!/usr/bin/env bash
# Regenerates the tokenizer test's expected ids: llama.cpp's own tokenization
# (node-llama-cpp's prebuilt CPU build) of tests/data/tokenizer/corpus.json on a
# fixture carrying Qwen3's real vocabulary, written to
# tests/data/tokenizer/qwen3-llama-ids.json. ctest compares against that file
# without node. Needs node and npm.
# Usage: tools/llama-crosscheck/tokenizer-ids.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
moegraph="$1/tools/moegraph"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -d "$here/node_modules/node-llama-cpp" ]]; then
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
fi
"$root/tools/fetch-vocab.sh"

"$moegraph" make-fixture --arch qwen3moe --layers 1 --experts 4 --top-k 2 --embd 64 --ff 32 \
  --quant q8_0 --tokenizer-json "$root/vocab/qwen3/tokenizer.json" -o "$work/qwen3-vocab.gguf"
node "$here/tokenize.mjs" "$work/qwen3-vocab.gguf" "$root/tests/data/tokenizer/corpus.json" \
  > "$root/tests/data/tokenizer/qwen3-llama-ids.json"
echo "wrote tests/data/tokenizer/qwen3-llama-ids.json"
