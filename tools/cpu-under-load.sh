#!/usr/bin/env bash
# The CPU backend's decode beside busy processes: `moegraph run` at -t 1 and -t
# 2 on a 32 MiB fixture (4 layers, 16 experts top-4, embd 512, q8_0 dense, q4_K
# experts), idle, beside one `nice -n 19` busy loop (lower-priority work: the
# pool must keep its cores) and beside 2 busy-looping processes per logical CPU
# (equal priority: it must share them), each binary given (a moegraph of
# another commit, to compare pools side by side), repetitions interleaved.
# Prints a markdown table of decode tok/s (the mean of REPS runs), the -t 2 /
# -t 1 ratio and -t 2 against its idle rate. Not part of `make test`: speed is
# a benchmark (ThreadPoolUnderLoadTest asserts the equal-priority ratio).
# Usage: [REPS=N] tools/cpu-under-load.sh MOEGRAPH [MOEGRAPH ...]
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: [REPS=N] $0 MOEGRAPH [MOEGRAPH ...]" >&2; exit 2; }
reps=${REPS:-3}
work=$(mktemp -d)
busy_pids=()
stop_busy() {
  for pid in "${busy_pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  busy_pids=()
}
trap 'stop_busy; rm -rf "$work"' EXIT

"$1" make-fixture --arch qwen3moe --layers 4 --experts 16 --top-k 4 --embd 512 --ff 512 \
  --heads 8 --kv-heads 4 --vocab 2048 --quant q8_0,expert=q4_K --seed 1 -o "$work/f.gguf" >&2

# Decode tok/s of one run: the second rate on the summary line.
decode_rate() {
  "$1" run -m "$work/f.gguf" --backend cpu --tokens 1,2,3 -n 128 -t "$2" 2>&1 |
    grep -o '[0-9.]* tok/s' | sed -n 2p | cut -d' ' -f1
}

cpus=$(nproc)
printf '| binary | busy processes | tg128 t/s at -t 1 | tg128 t/s at -t 2 | -t 2 / -t 1 | -t 2 / idle -t 2 |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: |\n'
declare -A idle=()
for load in none nice19 "$((2 * cpus))"; do
  case $load in
    none) busy=0 ;;
    nice19) busy=1 ;;
    *) busy=$load ;;
  esac
  for ((i = 0; i < busy; ++i)); do
    if [[ $load == nice19 ]]; then
      nice -n 19 bash -c 'while :; do :; done' &
    else
      bash -c 'while :; do :; done' &
    fi
    busy_pids+=($!)
  done
  sleep 1
  declare -A sum=()
  for ((rep = 0; rep < reps; ++rep)); do
    for bin in "$@"; do
      for t in 1 2; do
        rate=$(decode_rate "$bin" "$t")
        sum["$bin $t"]=$(awk -v a="${sum["$bin $t"]:-0}" -v b="$rate" 'BEGIN { print a + b }')
      done
    done
  done
  for bin in "$@"; do
    [[ $load == none ]] && idle["$bin"]=${sum["$bin 2"]}
    label=$([[ $load == nice19 ]] && echo "1 at nice 19" || echo "$busy")
    awk -v bin="$bin" -v label="$label" -v one="${sum["$bin 1"]}" -v two="${sum["$bin 2"]}" \
      -v idle2="${idle["$bin"]}" -v reps="$reps" 'BEGIN { printf "| %s | %s | %.1f | %.1f | %.2f | %.2f |\n",
        bin, label, one / reps, two / reps, two / one, two / idle2 }'
  done
  unset sum
  stop_busy
done
