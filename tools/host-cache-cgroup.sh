#!/usr/bin/env bash
# A model bigger than memory, both engines in one run (docs/BENCHMARKS.md):
# the Qwen3-30B-A3B-shaped q4_K file (17 GB; made here when missing) decoded
# inside a memory cgroup limited to each LIMIT, which counts the page cache
# (cgroup v1 memory.limit_in_bytes). moegraph on the CPU backend with its
# defaults: the file does not fit, so a host cache of what the cgroup leaves
# (--host-cache's default) and the experts read with O_DIRECT; llama.cpp's
# llama-completion (built from the peer's source) with its defaults (it
# repacks q4_K weights into anonymous memory) and with --no-repack (the file
# mapped, pages faulted in as touched). A row per engine and limit: decode
# tok/s, the disk bytes read during the run (the device's sector counter: the
# machine otherwise idle) per token evaluated, the cgroup's peak memory; a run
# the cgroup kills says so. Page cache dropped before each run.
# Needs root (cgroups, drop_caches); says so otherwise.
# Usage: [N=8] [LIMITS="8G 4G"] tools/host-cache-cgroup.sh BUILD_DIR LLAMA_BIN_DIR [MODEL]
set -euo pipefail
moegraph="$1/tools/moegraph"
llama_bin="$2"
model=${3:-fixtures/disk/qwen3-30b-a3b-shape-q4k.gguf}
n=${N:-8}
read -r -a limits <<< "${LIMITS:-8G 4G}"
prompt="Hello world"
cgroups=/sys/fs/cgroup/memory
if [[ $(id -u) != 0 || ! -w $cgroups ]]; then
  echo "host-cache-cgroup.sh: needs root and cgroup v1's memory controller at $cgroups" >&2
  exit 1
fi
if [[ ! -f $model ]]; then
  mkdir -p "$(dirname "$model")"
  echo "making $model (17 GB, a few minutes)" >&2
  "$moegraph" make-fixture --arch qwen3moe --layers 48 --experts 128 --top-k 8 --embd 2048 \
    --ff 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936 \
    --quant q8_0,expert=q4_K --router-skew 1 --expert-variants 2 --seed 3 -o "$model" >&2
fi
dev=$(basename "$(df --output=source "$model" | tail -1)")
sectors() { awk '{ print $3 }' "/sys/class/block/$dev/stat"; }
work=$(mktemp -d)
group="$cgroups/moegraph-host-cache-bench"
cleanup() { rmdir "$group" 2> /dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$group"

# run NAME CMD...: one run in the cgroup -> a table row.
run() {
  local name=$1 limit=$2
  shift 2
  sync
  echo 3 > /proc/sys/vm/drop_caches
  echo 0 > "$group/memory.max_usage_in_bytes"
  local before after rc=0
  before=$(sectors)
  sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$group" timeout 900 "$@" \
    > "$work/out" 2> "$work/err" || rc=$?
  after=$(sectors)
  local peak tps tokens
  peak=$(awk '{ printf "%.2f GiB", $1 / 2^30 }' "$group/memory.max_usage_in_bytes")
  local read_gib
  read_gib=$(awk -v s=$((after - before)) 'BEGIN { printf "%.2f", s * 512 / 2^30 }')
  if ((rc != 0)); then
    local why="exit $rc"
    ((rc == 137)) && why="killed (the cgroup's OOM killer)"
    ((rc == 124)) && why="timed out (900 s)"
    echo "| $limit | $name | - | $why | $read_gib | - | $peak |"
    return
  fi
  if [[ $name == moegraph* ]]; then
    tps=$(sed -nE 's/.*\+ [0-9]+ generated \(([0-9.]+) tok\/s\).*/\1/p' "$work/err")
    tokens=$(sed -nE 's/^backend cpu: ([0-9]+) prompt tokens? .* = ([0-9]+);.*/\2/p' "$work/err")
  else
    tps=$(sed -nE 's/.* eval time = .* ([0-9.]+) tokens per second\)/\1/p' "$work/err" | tail -1)
    tokens=$(awk '/prompt eval time|  eval time/ { for (i = 1; i <= NF; ++i) if ($i == "/") { s += $(i + 1) } } END { print s }' "$work/err")
  fi
  local note="ok"
  [[ $name == moegraph* ]] && note=$(grep -oE '^host cache: (auto|off)[^;]*' "$work/err" | head -1 || true)
  echo "| $limit | $name | $tps | $note | $read_gib | $(awk -v g="$read_gib" -v t="$tokens" 'BEGIN { printf "%.2f", (t > 0 ? g * 1024 / t : 0) }') | $peak |"
  grep -E '^backend cpu: [0-9]+ prompt|^host cache:' "$work/err" >> "$work/details" || true
  grep -E 'eval time' "$work/err" >> "$work/details" || true
}

echo "model: $model ($(du -h --apparent-size "$model" | cut -f1)), $n tokens after \"$prompt\", 2 threads"
echo
echo "| limit | engine | decode tok/s | note | disk GiB read | disk MiB per token | peak memory |"
echo "| --- | --- | ---: | --- | ---: | ---: | ---: |"
for limit in "${limits[@]}"; do
  echo "$limit" > "$group/memory.limit_in_bytes"
  run "moegraph" "$limit" "$moegraph" run -m "$model" -p "$prompt" -n "$n" --backend cpu -t 2
  run "llama.cpp" "$limit" env "LD_LIBRARY_PATH=$llama_bin" "$llama_bin/llama-completion" \
    -m "$model" -p "$prompt" -n "$n" -t 2 -no-cnv --temp 0 -c 256
  run "llama.cpp --no-repack" "$limit" env "LD_LIBRARY_PATH=$llama_bin" \
    "$llama_bin/llama-completion" -m "$model" -p "$prompt" -n "$n" -t 2 -no-cnv --temp 0 -c 256 \
    --no-repack
done
echo
echo "Each run's own lines:"
sed 's/^/    /' "$work/details"
