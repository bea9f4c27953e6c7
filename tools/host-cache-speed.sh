#!/usr/bin/env bash
# The disk tier's decode speed against the budget (docs/BENCHMARKS.md): a
# model run with every expert in memory, then with --host-cache at shrinking
# budgets (each miss read from the file with O_DIRECT), greedy, one thread;
# a markdown row per run: tok/s, hit rate, disk MiB per token and the reads'
# rate. The tokens are checked equal to the in-memory run's.
# Usage: tools/host-cache-speed.sh BUILD_DIR [MODEL] [BUDGETS...]
set -euo pipefail
moegraph="$1/tools/moegraph"
model=${2:-models/kjv-moe-f16.gguf}
shift $(( $# < 2 ? $# : 2 ))
budgets=("$@")
[[ ${#budgets[@]} -gt 0 ]] || budgets=(24M 12M 6M 3M)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # extra flags -> the summary line on stdout, the text in $work/text
  "$moegraph" run -m "$model" -p "And God said unto Moses," -n 128 --backend cpu -t 1 "$@" \
    2> "$work/err" > "$work/text"
  grep -E '^backend cpu: [0-9]+ prompt' "$work/err"
}
echo "| budget | tok/s | hit % | disk MiB/token | read MiB/s | tokens equal |"
echo "| --- | ---: | ---: | ---: | ---: | --- |"
summary=$(run)
cp "$work/text" "$work/want"
echo "| every expert in memory | $(sed -E 's/.*generated \(([0-9.]+) tok\/s\).*/\1/' <<< "$summary") | 100.0 | 0 | - | - |"
for b in "${budgets[@]}"; do
  summary=$(run --host-cache "$b")
  tps=$(sed -E 's/.*generated \(([0-9.]+) tok\/s\).*/\1/' <<< "$summary")
  hit=$(sed -E 's/.*hit ([0-9.]+)%.*/\1/' <<< "$summary")
  mib=$(sed -E 's/.* ([0-9.]+) MiB read.*/\1/' <<< "$summary")
  rate=$(sed -E 's/.* ([0-9.]+) MiB\/s\).*/\1/' <<< "$summary")
  equal=$(cmp -s "$work/text" "$work/want" && echo yes || echo NO)
  echo "| $b | $tps | $hit | $(awk -v m="$mib" 'BEGIN { printf "%.3f", m / (128 + 6) }') | $rate | $equal |"
done
