#!/usr/bin/env bash
# Regenerates tests/data/chat/llama-chat.json: llama.cpp's own detection and
# rendering (src/llama-chat.cpp, from the llama.cpp source node-llama-cpp ships
# as a git bundle) of the cases in tests/data/chat/cases.json, plus Qwen3's real
# chat template from vocab/qwen3/tokenizer_config.json (tools/fetch-vocab.sh;
# its text stays out of the repository, its result goes in as "vocab:qwen3").
# chat_template_test compares moegraph's text/chat_template against it without
# node or llama.cpp. Needs node, npm, git and g++.
# Usage: tools/llama-crosscheck/chat-templates.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -d "$here/node_modules/node-llama-cpp" ]]; then
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
fi
"$root/tools/fetch-vocab.sh"

git -c advice.detachedHead=false clone --quiet "$here/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$work/llama.cpp"
commit=$(git -C "$work/llama.cpp" rev-parse HEAD)
g++ -std=c++17 -O1 -I"$work/llama.cpp/include" -I"$work/llama.cpp/ggml/include" \
  -I"$work/llama.cpp/src" "$here/chat_templates.cc" "$work/llama.cpp/src/llama-chat.cpp" \
  -o "$work/chat_templates"
node -e '
  const fs = require("fs");
  const config = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
  fs.writeFileSync(process.argv[2], config.chat_template);' \
  "$root/vocab/qwen3/tokenizer_config.json" "$work/qwen3.jinja"
"$work/chat_templates" "$root/tests/data/chat/cases.json" vocab:qwen3 "$work/qwen3.jinja" |
  COMMIT=$commit node -e '
    const out = JSON.parse(require("fs").readFileSync(0, "utf8"));
    out.llama_cpp_commit = process.env.COMMIT;
    process.stdout.write(JSON.stringify(out, null, 1) + "\n");' \
  > "$root/tests/data/chat/llama-chat.json"
echo "wrote tests/data/chat/llama-chat.json (llama.cpp $commit)"
