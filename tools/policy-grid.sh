#!/usr/bin/env bash
# The hazard policy against the better of global and per-layer LRU on a grid of
# synthetic traces (moegraph trace synth), with OPT for scale: per budget, the sum
# over the traces of hazard's hits minus the better LRU's, how many traces are
# below it, the worst one, and OPT's margin over the better LRU. docs/POLICY.md
# quotes its output.
#
# Usage: tools/policy-grid.sh [MOEGRAPH]   (default build/tools/moegraph)
# Environment (defaults in brackets): STEPS [500], SEEDS ["1 2"], ZIPFS
# ["0.6 0.8 1.0 1.2"], REUSES ["0.2 0.45 0.7"], DRIFTS ["0 20"], LAYERS [48],
# EXPERTS [128], TOP_K [8], BUDGETS [10, 25, 50, 75 and 90% of the keys, and 5%
# when that is at least TOP_K], JOBS [2] traces simulated at once.
# Per-layer LRU runs where every layer gets TOP_K slots. Takes about 10 minutes
# for the default 48 traces on 2 cores.
set -euo pipefail

moegraph=${1:-build/tools/moegraph}
[[ -x $moegraph ]] || { echo "policy-grid: $moegraph is not built" >&2; exit 1; }
steps=${STEPS:-500}
layers=${LAYERS:-48}
experts=${EXPERTS:-128}
top_k=${TOP_K:-8}
jobs=${JOBS:-2}
keys=$((layers * experts))
if [[ -z ${BUDGETS:-} ]]; then
  BUDGETS=""
  for pct in 5 10 25 50 75 90; do
    n=$((keys * pct / 100))
    ((n >= top_k)) && BUDGETS+="${BUDGETS:+,}$n"
  done
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One trace: its synth line and simulate's JSON rows, into $work/NAME.rows as
# "budget policy pool hits".
simulate_one() {
  local name=$1 zipf=$2 reuse=$3 drift=$4 seed=$5 trace per_layer="" n
  trace=$work/$name.mgtr
  "$moegraph" trace synth --layers "$layers" --experts "$experts" --top-k "$top_k" \
    --steps "$steps" --zipf "$zipf" --reuse "$reuse" --drift "$drift" --seed "$seed" \
    -o "$trace" > /dev/null
  for n in ${BUDGETS//,/ }; do
    ((n / layers >= top_k)) && per_layer+="${per_layer:+,}$n"
  done
  {
    "$moegraph" simulate --trace "$trace" --policy lru,hazard,opt --slots "$BUDGETS" -o json
    if [[ -n $per_layer ]]; then
      "$moegraph" simulate --trace "$trace" --policy lru --pool per-layer --slots "$per_layer" \
        -o json
    fi
  } | sed -n 's/.*"policy": "\([a-z]*\)".*"slots": \([0-9]*\), "pool": "\([a-z-]*\)", "hits": \([0-9]*\).*/\2 \1 \3 \4/p' \
    > "$work/$name.rows"
  rm -f "$trace"
  echo "policy-grid: $name done" >&2
}
export -f simulate_one
export moegraph work steps layers experts top_k BUDGETS

for seed in ${SEEDS:-1 2}; do
  for zipf in ${ZIPFS:-0.6 0.8 1.0 1.2}; do
    for reuse in ${REUSES:-0.2 0.45 0.7}; do
      for drift in ${DRIFTS:-0 20}; do
        echo "z$zipf-r$reuse-d$drift-s$seed $zipf $reuse $drift $seed"
      done
    done
  done
done | xargs -P "$jobs" -L 1 bash -c 'simulate_one "$@"' _

echo "# policy grid: ${layers} layers x ${experts} experts, top-${top_k}, ${steps} steps"
echo "# hazard - best LRU: sum over traces, traces below, worst trace; OPT - best LRU: sum"
echo
echo "| slots | % of keys | traces | hazard - best LRU | below | worst | OPT - best LRU |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for rows in "$work"/*.rows; do
  # Per budget: hazard and OPT minus the better of the LRU rows (global, per-layer).
  awk -v trace="$(basename "$rows" .rows)" '
    { key = $1; if ($2 == "lru") { if ($4 > best[key]) best[key] = $4 } else hits[$2, key] = $4; seen[key] = 1 }
    END { for (n in seen) print n, trace, hits["hazard", n] - best[n], hits["opt", n] - best[n] }' \
    "$rows"
done | sort -n -k1,1 | awk -v keys="$keys" '
  # Rows come sorted by slots: a table row per run of equal slot counts.
  function flush() {
    if (n == "") return
    printf "| %d | %.0f | %d | %+d | %d | %+d (%s) | %+d |\n", n, 100 * n / keys, count, sum, below, worst, worst_trace, opt
  }
  $1 != n { flush(); n = $1; count = 0; sum = 0; below = 0; opt = 0; worst = ""; worst_trace = "" }
  { count++; sum += $3; opt += $4; if ($3 < 0) below++
    if (worst == "" || $3 < worst) { worst = $3; worst_trace = $2 } }
  END { flush() }'
