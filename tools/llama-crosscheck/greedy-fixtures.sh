#!/usr/bin/env bash
# Regenerates tests/data/crosscheck/greedy.json: llama.cpp's greedy tokens on f32
# fixtures of every architecture moegraph reads, which tests/crosscheck_test.cc
# holds the oracle (and the CPU backend where it runs the architecture) to
# (no node in CI). Needs node and npm's registry; not part of `make test`.
# Usage: tools/llama-crosscheck/greedy-fixtures.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
moegraph="$1/tools/moegraph"
out=$root/tests/data/crosscheck/greedy.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ -d $here/node_modules/node-llama-cpp ]] ||
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)

prompt=5,6,7,8,9,10,11,12
count=16
common="--layers 3 --experts 8 --top-k 2 --embd 128 --ff 64 --heads 4 --vocab 300 --quant f32 --seed 7"
: > "$work/rows"
for arch_flags in "qwen3moe --kv-heads 2" "olmoe" "qwen2moe --kv-heads 2" "mixtral --kv-heads 2" \
                  "gpt-oss --kv-heads 2 --swa 4" "glm4moe --kv-heads 2" "glm4moe --kv-heads 2 --qk-norm" \
                  "qwen35moe --kv-heads 2 --full-attn-interval 3" \
                  "qwen35moe --kv-heads 2 --full-attn-interval 2"; do
  args="--arch $arch_flags $common"
  # shellcheck disable=SC2086
  "$moegraph" make-fixture $args -o "$work/f.gguf" >/dev/null
  tokens=$(node "$here/greedy.mjs" "$work/f.gguf" "$prompt" "$count")
  printf '%s\t%s\n' "$args" "$tokens" >> "$work/rows"
  echo "greedy-fixtures: ${arch_flags%% *}: $tokens" >&2
done
node - "$work/rows" "$prompt" > "$out" <<'NODE'
const fs = require("fs");
const [rowsPath, prompt] = process.argv.slice(2);
const cases = fs.readFileSync(rowsPath, "utf8").trim().split("\n").map((line) => {
  const [args, tokens] = line.split("\t");
  return {make_fixture: args, tokens: tokens.split(" ").map(Number)};
});
console.log(`{"made_by": "tools/llama-crosscheck/greedy-fixtures.sh: llama.cpp v0.5.0 ` +
            `(node-llama-cpp 3.22.1, prebuilt CPU backend), greedy",\n "prompt": [${prompt}],\n` +
            ` "cases": [\n  ${cases.map((c) => JSON.stringify(c)).join(",\n  ")}\n ]\n}`);
NODE
echo "greedy-fixtures: wrote $out" >&2
