#!/usr/bin/env bash
# Cross-check: the CPU oracle's greedy tokens against llama.cpp's on fixtures of
# every architecture. Needs node and npm (the npm registry); not part of `make test`.
# Usage: tools/llama-crosscheck/run.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
moegraph="$1/tools/moegraph"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -d "$here/node_modules/node-llama-cpp" ]]; then
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
fi

prompt=5,6,7
count=12
failed=0
printf '| fixture | tokens equal | moegraph | llama.cpp |\n| --- | --- | --- | --- |\n'
for arch_flags in "qwen3moe --kv-heads 2" "olmoe" "qwen2moe --kv-heads 2" "mixtral --kv-heads 2" \
                  "gpt-oss --kv-heads 2" "glm4moe --kv-heads 2" "glm4moe --kv-heads 2 --qk-norm"; do
  arch=${arch_flags%% *}
  # The row's name: the architecture and any flag beyond --kv-heads.
  label="$arch${arch_flags##*--kv-heads 2}"
  [[ $arch_flags == *--kv-heads* ]] || label=$arch
  file="$work/$arch.gguf"
  # shellcheck disable=SC2086
  "$moegraph" make-fixture --arch $arch_flags --layers 3 --experts 8 --top-k 2 --embd 128 --ff 64 \
    --heads 4 --vocab 300 --quant f32 --seed 7 -o "$file" >/dev/null
  ours=$("$moegraph" run -m "$file" --tokens "$prompt" -n "$count" | sed -n 's/^generated: //p')
  theirs=$(node "$here/greedy.mjs" "$file" "$prompt" "$count")
  verdict=yes
  [[ "$ours" == "$theirs" ]] || { verdict=NO; failed=1; }
  printf '| %s | %s | %s | %s |\n' "$label" "$verdict" "$ours" "$theirs"
done
exit $failed
