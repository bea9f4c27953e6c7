#!/usr/bin/env bash
# The disk tier's decode speed against the budget (docs/BENCHMARKS.md): a
# model run with every expert in memory, then with --host-cache at shrinking
# budgets (each miss read from the file with O_DIRECT), greedy, one thread,
# each budget twice: a row's experts computed as their reads arrive (the
# default) and after all of them (MOEGRAPH_READ_OVERLAP=0); a markdown row
# per run: tok/s, hit rate, disk MiB per token and the time decode waited on
# reads per token. The tokens are checked equal to the in-memory run's.
# Usage: [N=tokens] tools/host-cache-speed.sh BUILD_DIR [MODEL] [BUDGETS...]
set -euo pipefail
moegraph="$1/tools/moegraph"
model=${2:-models/kjv-moe-f16.gguf}
shift $(( $# < 2 ? $# : 2 ))
budgets=("$@")
[[ ${#budgets[@]} -gt 0 ]] || budgets=(24M 12M 6M 3M)
n=${N:-128}  # tokens generated
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # extra flags -> the summary line on stdout, the text in $work/text
  "$moegraph" run -m "$model" -p "And God said unto Moses," -n "$n" --backend cpu -t 1 "$@" \
    2> "$work/err" > "$work/text"
  grep -E '^backend cpu: [0-9]+ prompt' "$work/err"
}
echo "| budget | reads | tok/s | hit % | disk MiB/token | waiting ms/token | tokens equal |"
echo "| --- | --- | ---: | ---: | ---: | ---: | --- |"
summary=$(run)
cp "$work/text" "$work/want"
echo "| every expert in memory | - | $(sed -E 's/.*generated \(([0-9.]+) tok\/s\).*/\1/' <<< "$summary") | 100.0 | 0 | - | - |"
for b in "${budgets[@]}"; do
  for overlap in 0 1; do
    summary=$(MOEGRAPH_READ_OVERLAP=$overlap run --host-cache "$b")
    tps=$(sed -E 's/.*generated \(([0-9.]+) tok\/s\).*/\1/' <<< "$summary")
    hit=$(sed -E 's/.*hit ([0-9.]+)%.*/\1/' <<< "$summary")
    mib=$(sed -E 's/.* ([0-9.]+) MiB read.*/\1/' <<< "$summary")
    wait=$(sed -E 's/.* ([0-9.]+) ms waiting on them.*/\1/' <<< "$summary")
    equal=$(cmp -s "$work/text" "$work/want" && echo yes || echo NO)
    mode=$([[ $overlap == 1 ]] && echo "as they arrive" || echo "all, then compute")
    awk -v b="$b" -v mode="$mode" -v tps="$tps" -v hit="$hit" -v mib="$mib" -v w="$wait" \
      -v eq="$equal" -v steps=$((n + 6)) \
      'BEGIN { printf "| %s | %s | %s | %s | %.3f | %.3f | %s |\n", b, mode, tps, hit, mib / steps, w / steps, eq }'
  done
done
