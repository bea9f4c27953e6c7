#!/usr/bin/env bash
# Regenerates tests/data/kjv-moe/llama.json: what llama.cpp (node-llama-cpp
# 3.22.1's prebuilt CPU build, llama.cpp v0.5.0) makes of the trained model
# models/kjv-moe-f16.gguf (tools/train-moe), which tests/kjv_moe_test.cc and
# tests/cli_cuda_test.cc hold moegraph to (no node in CI):
#   perplexity: models/kjv-held-out.txt at -c 512, every chunk, and at -c 128,
#     the first 4 chunks (perplexity.mjs), with the running value after each chunk;
#   greedy: 20 prompts, 32 tokens each, at f16 and at q8_0 (the file
#     `moegraph quantize ... q8_0` writes: llama-quantize --pure's bytes),
#     with llama.cpp's prompt ids (greedy-prompts.mjs);
#   kld: the mean KL divergence of q4_K (`moegraph quantize ... q4_K`) from f16
#     over the first 8 chunks of 512 (kld.mjs), and its "same top p".
# Needs node and npm's registry; minutes; not part of `make test`.
# Usage: tools/llama-crosscheck/kjv-moe.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
moegraph="$1/tools/moegraph"
model=$root/models/kjv-moe-f16.gguf
text=$root/models/kjv-held-out.txt
out=$root/tests/data/kjv-moe/llama.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ -d $here/node_modules/node-llama-cpp ]] ||
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)

"$moegraph" quantize "$model" "$work/q8_0.gguf" q8_0 >&2
"$moegraph" quantize "$model" "$work/q4_K.gguf" q4_K >&2
cat > "$work/prompts.json" <<'JSON'
["In the beginning", "And God said, Let there be", "The LORD is my shepherd;", "Blessed are the",
 "And it came to pass, when", "Thus saith the LORD,", "For God so loved the world,",
 "And Jesus answered and said unto them,", "Now the serpent was", "Behold, I stand at the door,",
 "O give thanks unto the LORD;", "And the king said unto", "Hear, O Israel:",
 "My son, forsake not", "Vanity of vanities,", "And Moses said unto the people,", "I am the",
 "The heavens declare", "And David", "Let not your heart be troubled:"]
JSON
node "$here/greedy-prompts.mjs" "$model" 32 "$work/prompts.json" > "$work/greedy-f16.jsonl"
node "$here/greedy-prompts.mjs" "$work/q8_0.gguf" 32 "$work/prompts.json" > "$work/greedy-q8_0.jsonl"
echo "kjv-moe: greedy done" >&2
node "$here/perplexity.mjs" "$model" "$text" 512 > "$work/ppl512.json"
node "$here/perplexity.mjs" "$model" "$text" 128 4 > "$work/ppl128.json"
echo "kjv-moe: perplexity $(cat "$work/ppl512.json" | cut -c1-80)" >&2
node "$here/kld.mjs" "$model" "$work/q4_K.gguf" "$text" 512 8 > "$work/kld.json"
echo "kjv-moe: kld $(cat "$work/kld.json")" >&2
node - "$work" > "$out" <<'NODE'
const fs = require("fs");
const dir = process.argv[2];
const read = (f) => JSON.parse(fs.readFileSync(`${dir}/${f}`, "utf8"));
const lines = (f) => fs.readFileSync(`${dir}/${f}`, "utf8").trim().split("\n").map(JSON.parse);
const greedy = (f) => lines(f).map(({prompt, prompt_ids, generated}) => ({prompt, prompt_ids, generated}));
const result = {
  made_by: "tools/llama-crosscheck/kjv-moe.sh: llama.cpp v0.5.0 (node-llama-cpp 3.22.1, prebuilt " +
           "CPU backend) on models/kjv-moe-f16.gguf",
  perplexity: [read("ppl512.json"), read("ppl128.json")].map(({n_ctx, chunks, scored, ppl, error, per_chunk}) =>
      ({n_ctx, chunks, scored, ppl, error, per_chunk})),
  kld_q4_K: read("kld.json"),
  greedy: {f16: greedy("greedy-f16.jsonl"), q8_0: greedy("greedy-q8_0.jsonl")},
};
console.log(JSON.stringify(result, null, 1));
NODE
echo "kjv-moe: wrote $out" >&2
