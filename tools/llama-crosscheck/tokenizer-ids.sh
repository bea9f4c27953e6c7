#!/usr/bin/env bash
# Regenerates the tokenizer tests' expected data from llama.cpp itself
# (node-llama-cpp's prebuilt CPU build), on fixtures carrying Qwen3's real
# vocabulary: its tokenization of tests/data/tokenizer/corpus.json
# (qwen3-llama-ids.json), and its greedy decode of a chat prompt on an f32
# fixture (qwen3-llama-greedy.json, with the make-fixture flags that write that
# fixture again). ctest compares against both without node. Needs node and npm.
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

# f32, so near-ties cannot flip between llama.cpp's arithmetic and moegraph's.
flags="--arch qwen3moe --layers 2 --experts 4 --top-k 2 --embd 64 --ff 32 --quant f32 --seed 3"
prompt=$'<|im_start|>user\nWhat is a mixture of experts?<|im_end|>\n<|im_start|>assistant\n'
# shellcheck disable=SC2086
"$moegraph" make-fixture $flags --tokenizer-json "$root/vocab/qwen3/tokenizer.json" \
  -o "$work/qwen3-f32.gguf"
node "$here/greedy-text.mjs" "$work/qwen3-f32.gguf" "$prompt" 24 |
  FLAGS="$flags" node -e '
    const out = JSON.parse(require("fs").readFileSync(0, "utf8"));
    out.make_fixture_flags = process.env.FLAGS;
    process.stdout.write(JSON.stringify(out, null, 1) + "\n");' \
  > "$root/tests/data/tokenizer/qwen3-llama-greedy.json"
echo "wrote tests/data/tokenizer/qwen3-llama-greedy.json"
