#!/usr/bin/env bash
# Tokenizer speed, moegraph beside llama.cpp in one run, on the same 1 MiB of
# text (tests/data/tokenizer/corpus.json repeated) with the same real
# vocabularies (tools/fetch-vocab.sh): moegraph's BM_Tokenize1MiB
# (tools/bench/bench_text.cc, Google Benchmark) and llama.cpp's tokenizer through
# node-llama-cpp's prebuilt CPU build (tokenize-speed.mjs: the median of 5 runs
# after a warm-up; its time includes passing the text from JavaScript). Both
# are wall time; moegraph's is the mean over the iterations of at least 1 s.
# Prints a table of MB/s (1 MB = 2^20 bytes). Needs node and npm.
# Usage: tools/llama-crosscheck/tokenizer-speed.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -d "$here/node_modules/node-llama-cpp" ]]; then
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
fi
"$root/tools/fetch-vocab.sh"

"$build/tools/moegraph_bench" --benchmark_filter=Tokenize1MiB --benchmark_min_time=1 \
  --benchmark_format=json > "$work/moegraph.json" 2> "$work/moegraph.err"

printf '| vocabulary | text | ids | moegraph MB/s | llama.cpp MB/s | moegraph / llama.cpp |\n'
printf '| --- | --- | --- | --- | --- | --- |\n'
for pair in qwen3:qwen3moe mistral:mixtral; do
  vocab=${pair%%:*} arch=${pair##*:}
  "$build/tools/moegraph" make-fixture --arch "$arch" --layers 1 --experts 2 --top-k 1 \
    --embd 64 --ff 32 --quant q8_0 --tokenizer-json "$root/vocab/$vocab/tokenizer.json" \
    -o "$work/$vocab.gguf" > /dev/null
  node "$here/tokenize-speed.mjs" "$work/$vocab.gguf" "$root/tests/data/tokenizer/corpus.json" \
    > "$work/$vocab-llama.json"
  VOCAB=$vocab node -e '
    const fs = require("fs");
    const dir = process.argv[1], vocab = process.env.VOCAB;
    const mg = JSON.parse(fs.readFileSync(`${dir}/moegraph.json`, "utf8")).benchmarks
      .find((b) => b.name === `BM_Tokenize1MiB/${vocab}`);
    const ll = JSON.parse(fs.readFileSync(`${dir}/${vocab}-llama.json`, "utf8"));
    const mib = ll.bytes / 2 ** 20;
    const ours = mg.text_bytes / 2 ** 20 / (mg.real_time / 1000);  // time_unit ms
    const sorted = [...ll.seconds].sort((a, b) => a - b);
    const theirs = mib / sorted[Math.floor(sorted.length / 2)];
    const same = mg.ids === ll.ids && mg.text_bytes === ll.bytes ? "" : " (texts differ!)";
    console.log(`| ${vocab} | ${ll.bytes} B | ${ll.ids}${same} | ${ours.toFixed(2)} | ` +
                `${theirs.toFixed(2)} | ${(ours / theirs).toFixed(2)} |`);' "$work"
done
