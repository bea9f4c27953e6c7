#!/usr/bin/env bash
# Regenerates tests/data/crosscheck/teacher-forced.json: llama.cpp's teacher-forced
# next-token probabilities (the top 5 of each of 64 positions) on quantized
# fixtures, one per expert type with q8_0 dense matrices, which
# tests/crosscheck_test.cc compares moegraph's oracle and CPU backend with (no
# node in CI). Needs node and npm's registry; not part of `make test`.
# Usage: tools/llama-crosscheck/teacher-forced.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
moegraph="$1/tools/moegraph"
out=$root/tests/data/crosscheck/teacher-forced.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ -d $here/node_modules/node-llama-cpp ]] ||
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)

positions=64
vocab=300
# A fixed token sequence every position of which is forced: (11 + 37 i) mod vocab.
tokens=11
for ((i = 1; i < positions; ++i)); do tokens+=",$(((11 + 37 * i) % vocab))"; done
: > "$work/rows"
for arch_type in qwen3moe:q4_1 qwen3moe:q5_0 qwen3moe:q5_1 qwen3moe:q2_K qwen3moe:q3_K \
                 qwen3moe:iq4_nl qwen3moe:iq4_xs qwen3moe:mxfp4 qwen3moe:q4_K gpt-oss:mxfp4 \
                 glm4moe:q4_K qwen35moe:q4_K qwen35moe:q8_0 qwen35moe:mxfp4; do
  arch=${arch_type%%:*}
  type=${arch_type##*:}
  args="--arch $arch --layers 2 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4"
  # qwen35moe: a Gated DeltaNet layer, then gated attention.
  [[ $arch == qwen35moe ]] && args+=" --full-attn-interval 2"
  args+=" --kv-heads 2 --vocab $vocab --quant q8_0,expert=$type --router-skew 1 --seed 7"
  # shellcheck disable=SC2086
  "$moegraph" make-fixture $args -o "$work/f.gguf" >/dev/null
  top=$(node "$here/teacher-forced.mjs" "$work/f.gguf" "$tokens" 5)
  printf '%s\t%s\t%s\n' "$type" "$args" "$top" >> "$work/rows"
  echo "teacher-forced: $arch $type done" >&2
done
node - "$work/rows" "$tokens" > "$out" <<'NODE'
const fs = require("fs");
const [rowsPath, tokens] = process.argv.slice(2);
const fixtures = fs.readFileSync(rowsPath, "utf8").trim().split("\n").map((line) => {
  const [type, args, top] = line.split("\t");
  return {expert_type: type, make_fixture: args, top: JSON.parse(top)};
});
const doc = {
  made_by: "tools/llama-crosscheck/teacher-forced.sh: llama.cpp v0.5.0 (node-llama-cpp 3.22.1, " +
           "prebuilt CPU backend, 1 thread), softmax of its raw logits",
  tokens: tokens.split(",").map(Number),
  fixtures,
};
// One line per fixture: reviewable diffs, a small file.
console.log(`{"made_by": ${JSON.stringify(doc.made_by)},\n "tokens": ${JSON.stringify(doc.tokens)},` +
            `\n "fixtures": [\n  ${doc.fixtures.map((f) => JSON.stringify(f)).join(",\n  ")}\n ]\n}`);
NODE
echo "teacher-forced: wrote $out" >&2
