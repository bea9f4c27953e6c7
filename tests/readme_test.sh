#!/usr/bin/env bash
# The README's shell blocks run as a user pastes them: every ```sh block, in
# order, in one bash session (-e: any command that fails fails the test), from
# a folder where build/, vocab/, models/ and ../shared are this tree's, with one chat
# message and /exit on stdin for `chat`. `make run` and `make test` are left
# out: they build and test this very tree, which is what runs this test.
# Exit 77 (skipped) without tools/fetch-vocab.sh's vocabulary or curl.
# Usage: readme_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$(cd "$1" && pwd)
build_dir=$(cd "$2" && pwd)
vocab=${MOEGRAPH_VOCAB:-$source_dir/vocab}
shared=${MOEGRAPH_SHARED:-$source_dir/../shared}
[[ -f $vocab/qwen3/tokenizer.json ]] || { echo "skip: no $vocab (tools/fetch-vocab.sh)"; exit 77; }
command -v curl > /dev/null || { echo "skip: no curl"; exit 77; }

work=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; rm -rf "$work"' EXIT
mkdir "$work/checkout"
ln -s "$build_dir" "$work/checkout/build"
ln -s "$vocab" "$work/checkout/vocab"
ln -s "$source_dir/models" "$work/checkout/models"
ln -s "$(cd "$shared" && pwd)" "$work/shared"

# The blocks, with the two make lines left out.
awk '/^```sh$/ { inside = 1; next } /^```$/ { inside = 0 } inside && !/^make (run|test)/' \
  "$source_dir/README.md" > "$work/readme.sh"
blocks=$(grep -c '^```sh$' "$source_dir/README.md")
lines=$(wc -l < "$work/readme.sh")
[[ $blocks -ge 4 && $lines -ge 20 ]] || { echo "FAIL: found $blocks blocks, $lines lines"; exit 1; }
printf 'What is a mixture of experts?\n/exit\n' > "$work/stdin"

cd "$work/checkout"
if ! timeout 900 bash -euo pipefail "$work/readme.sh" < "$work/stdin" > "$work/out" 2> "$work/err"; then
  echo "FAIL: the README's blocks stopped (exit $?); the script:"
  cat -n "$work/readme.sh"
  echo "--- stderr (last 40 lines):"
  tail -n 40 "$work/err"
  exit 1
fi
# What the blocks print that a user would look for.
for expected in "wrote tiny.gguf" "generated:" "| model |" "chat.completion" "data: [DONE]" \
  "moegraph_requests_total" "\"token_logprobs\":[null," "passed, 0 failed" "usage: moegraph run" \
  "Final estimate: PPL = 27.3" "Same top p:" "children of Israel"; do
  grep -qF -- "$expected" "$work/out" || { echo "FAIL: no '$expected' on stdout"; exit 1; }
done
grep -q "^turn 1: prefill" "$work/err" || { echo "FAIL: chat answered no turn"; exit 1; }
echo "readme_test: $blocks blocks, $lines lines ran"
