#!/usr/bin/env bash
# What --drop-cold-experts costs in quality and saves in disk bytes
# (docs/BENCHMARKS.md): the model trained here scored on its held-out text
# (`moegraph perplexity`, 4 chunks of 512) with its disk tier at two budgets,
# dropping at F = 0 (none), 0.25, 0.5, 0.75 and 1, prompts included (a
# perplexity chunk is a prompt); the mean KL divergence and "same top p"
# against every expert in memory without dropping, the MiB read from disk and
# the share of it dropping saved, the routings dropped. Then fewer experts a
# token (--n-expert-used N, every routing of the rest kept) at the same
# budgets: the same columns, beside dropping at equal bytes saved.
# Usage: tools/drop-cold-quality.sh BUILD_DIR [MODEL] [TEXT]
set -euo pipefail
moegraph="$1/tools/moegraph"
model=${2:-models/kjv-moe-f16.gguf}
text=${3:-models/kjv-held-out.txt}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$moegraph" perplexity -m "$model" -f "$text" -c 512 --chunks 4 --backend cpu -t 1 \
  --kl-divergence-base "$work/base" > /dev/null 2>&1
declare -A none_read  # budget -> disk MiB read without dropping
# score ARGS...: one perplexity run against the base into $work/out, $work/err.
score() {
  "$moegraph" perplexity -m "$model" --backend cpu -t 1 --kl-divergence-base "$work/base" \
    --kl-divergence "$@" > "$work/out" 2> "$work/err"
  kld=$(sed -nE 's/^Mean +KLD: +([0-9.-]+).*/\1/p' "$work/out")
  same=$(sed -nE 's/^Same top p: +([0-9.]+).*/\1/p' "$work/out")
  read=$(sed -nE 's/.* ([0-9.]+) MiB read.*/\1/p' "$work/err")
}
saved_of() { awk -v r="$1" -v n="$2" 'BEGIN { printf "%.1f", 100 * (1 - r / n) }'; }
echo "| budget | F | mean KLD | same top p % | disk MiB read | saved % | routings dropped | mean dropped weight |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for budget in 6M 12M; do
  for f in 0 0.25 0.5 0.75 1; do
    score --host-cache "$budget" --drop-cold-experts "$f" --drop-in-prompts
    dropped=$(sed -nE 's/.*, ([0-9]+) routings dropped.*/\1/p' "$work/err")
    each=$(sed -nE 's/.*routings dropped \(weight [0-9.]+ in all, ([0-9.]+) each\).*/\1/p' "$work/err")
    [[ -n ${none_read[$budget]:-} ]] || none_read[$budget]=$read
    echo "| $budget | $f | $kld | $same | $read | $(saved_of "$read" "${none_read[$budget]}") | ${dropped:-0} | ${each:--} |"
  done
done
k=$("$moegraph" inspect -m "$model" 2>/dev/null | sed -nE 's/.*, top-([0-9]+),.*/\1/p' | head -n 1)
echo
echo "| budget | experts a token | mean KLD | same top p % | disk MiB read | saved % |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
for budget in 6M 12M; do
  for ((n = k - 1; n >= 1; n--)); do
    score --host-cache "$budget" --n-expert-used "$n"
    echo "| $budget | $n of $k | $kld | $same | $read | $(saved_of "$read" "${none_read[$budget]}") |"
  done
done
