#!/bin/bash
# The decode step's serial tails under gpusim: an epilogue's last block alone
# (tools/gpusim-epilogue/harness.cu), the working tree's (NEW) against an
# older commit's (OLD), and one markdown table of the cycles the simulator
# reports for the second launch (x in L2). Not part of CI (minutes a run).
#
#   tools/gpusim-epilogue/run.sh [--table] [CASE...]
#     CASE: norm (block_rmsnorm of 2048 with q8_1 blocks, 128 threads),
#           norm-cold (the same, its weights not in L2: as the step finds them),
#           router (the router's top-k, 128 experts, top 8, softmax),
#           router-512 (the same, 512 experts, top 10: Qwen3.5's),
#           attn-out-router (launch_matvec_residual_router at Qwen3-30B-A3B's
#           shape: attn_out q4_K 2048 x 4096 with ffn_norm, the f32 router
#           128 x 2048 top 8; tools/gpusim-epilogue/chain_harness.cu, minutes),
#           attn-norm-qkv (the layer's attn_norm and qkv at that shape: OLD a
#           single-block norm kernel then launch_qkv, NEW launch_qkv with its
#           input norm, both the working tree's, tools/gpusim-epilogue/
#           qkv_harness.cu; OLD's row adds both kernels' cycles less one
#           launch latency, as the norm ran in the combine's last block;
#           half an hour); default all but the last two
#   Environment: GPUSIM (default ../shared/gpusim beside the checkout), OLD_REV
#   (default 58b6001: one norm round at a time, the router's softmax in f64;
#   attn-out-router needs one whose launcher it calls, 9459ca7 or later),
#   NVCC.
# Build output and logs: build-gpusim/epilogue/ (ignored).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
HERE=$ROOT/tools/gpusim-epilogue
B=$ROOT/build-gpusim/epilogue
GPUSIM=${GPUSIM:-$(cd "$ROOT/../shared/gpusim" 2>/dev/null && pwd -P)}
OLD_REV=${OLD_REV:-58b6001}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

TABLE_ONLY=0
CASES=()
for a in "$@"; do
  case "$a" in
    --table) TABLE_ONLY=1 ;;
    norm|norm-cold|router|router-512|attn-out-router|attn-norm-qkv) CASES+=("$a") ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run.sh: unknown argument '$a'" >&2; exit 2 ;;
  esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(norm norm-cold router router-512)
mkdir -p "$B/logs"

# gpusim_root, sim_ptx, ptxas_wrapper.
. "$ROOT/tools/gpusim-common.sh"

args_of() {  # args_of CASE [OLD|NEW]
  case "$1" in
    norm) echo "norm 2048" ;;
    norm-cold) echo "norm 2048 cold" ;;
    router) echo "router 128 8" ;;
    router-512) echo "router 512 10" ;;
    attn-out-router) echo "attn-out-router" ;;
    attn-norm-qkv) [ "${2:-}" = OLD ] && echo single || echo prologue ;;
  esac
}

# The harness binary a case runs.
harness_of() {
  case "$1" in
    attn-out-router) echo chain_harness ;;
    attn-norm-qkv) echo qkv_harness ;;
    *) echo harness ;;
  esac
}

# Whether a case's OLD runs the old tree (else the working tree's other way).
old_tree() { [ "$1" != attn-norm-qkv ]; }

build() {  # build DIR TREE [old]: the harnesses the cases run, against TREE's kernels/
  mkdir -p "$1"
  local h c sources defines=()
  # A tree from before block_router_topk: its one-warp top-k.
  grep -q warp_router_topk "$2/kernels/epilogue.cuh" && defines=(-DHARNESS_WARP_ROUTER)
  for h in $(for c in "${CASES[@]}"; do
               { [ -z "${3:-}" ] || old_tree "$c"; } && harness_of "$c"
             done | sort -u); do
    sources=()
    [ "$h" = chain_harness ] || [ "$h" = qkv_harness ] &&
      sources=("$2/kernels/launch.cc" "$2/loader/quantize.cc" "$2/loader/ggml_type.cc")
    "$NVCC" -O2 -arch=compute_86 -code=compute_86 -cudart shared -std=c++17 "${defines[@]}" -I"$2" \
      -I"$ROOT" "$HERE/$h.cu" "${sources[@]}" -o "$1/$h"
    "$NVCC" -arch=compute_86 -code=compute_86 -ptx -std=c++17 "${defines[@]}" -I"$2" -I"$ROOT" \
      "$HERE/$h.cu" -o "$1/$h.ptx"
    sim_ptx "$1/$h.ptx" "$1/$h.sim.ptx"
  done
}

if [ "$TABLE_ONLY" = 0 ]; then
  [ -x "${GPUSIM:-}/run.sh" ] || { echo "run.sh: no gpusim at '${GPUSIM:-}'" >&2; exit 2; }
  SIM=$(gpusim_root)
  GPUSIM_REAL_PTXAS=$(ptxas_wrapper)
  export GPUSIM_REAL_PTXAS
  build "$B/new" "$ROOT"
  old="OLD the working tree's other way"
  for c in "${CASES[@]}"; do
    if old_tree "$c"; then
      rm -rf "$B/old/src" && mkdir -p "$B/old/src"
      git -C "$ROOT" archive "$OLD_REV" kernels loader residency | tar -x -C "$B/old/src"
      build "$B/old" "$B/old/src" old
      old="OLD $OLD_REV"
      break
    fi
  done
  echo "$(date -u +%FT%TZ) moegraph HEAD $(git -C "$ROOT" rev-parse --short HEAD)," \
    "kernels/ $(git -C "$ROOT" diff --quiet HEAD -- kernels && echo "as HEAD" || echo modified);" \
    "$old" > "$B/logs/provenance.txt"
  # A case's NEW and OLD side by side (one core each).
  for c in "${CASES[@]}"; do
    pids=()
    for k in NEW OLD; do
      d=$B/$(echo "$k" | tr A-Z a-z)
      old_tree "$c" || d=$B/new
      echo "== $c $k ($(date -u +%T))" >&2
      h=$(harness_of "$c")
      # shellcheck disable=SC2046
      "$SIM/run.sh" --ptx "$d/$h.sim.ptx" --sm 86 --log "$B/logs/$c-$k.log" -- \
        "$d/$h" $(args_of "$c" "$k") > "$B/logs/$c-$k.out" 2> "$B/logs/$c-$k.err" &
      pids+=($!)
    done
    for i in 0 1; do
      wait "${pids[$i]}" || { tail -n 5 "$B/logs/$c-$([ $i = 0 ] && echo NEW || echo OLD).err" >&2; exit 1; }
    done
  done
fi

# One launch's cycles (LAUNCH 1: the first, 2: the second) of one run and its
# check line: "cycles|check". The harness launches twice, each launch the same
# kernels; a launch of several kernels counts the simulator's launch latency
# (5000 cycles, in every kernel's count) once, as one kernel's would.
row() {  # row CASE OLD|NEW [LAUNCH]
  local f=$B/logs/$1-$2.out
  [ -f "$f" ] || { echo "missing|"; return; }
  awk -v launch="${3:-2}" '
    /^    cycles / { cyc[++n] = $2 }
    /^check / { chk = $0; sub(/^check /, "", chk) }
    END {
      per = n / 2; sum = 0
      for (i = (launch - 1) * per + 1; i <= launch * per; ++i) sum += cyc[i]
      if (per >= 1) sum -= 5000 * (per - 1)
      printf "%s|%s\n", (n < 2 || n % 2 ? "missing" : sum), chk
    }
  ' "$f"
}

echo
[ -f "$B/logs/provenance.txt" ] && sed 's/^/run /' "$B/logs/provenance.txt"
echo "gpusim SM86_RTX3070 (46 SMs, 1132 MHz; f64 at 1/64 of f32's rate), the second launch (its inputs in L2; a cold case's weights not)."
echo
echo "| case | OLD cycles | NEW cycles | NEW/OLD | OLD output | NEW output |"
echo "|---|---:|---:|---:|---|---|"
line() {  # line CASE LABEL LAUNCH
  local old_c old_chk new_c new_chk ratio
  IFS='|' read -r old_c old_chk <<< "$(row "$1" OLD "$3")"
  IFS='|' read -r new_c new_chk <<< "$(row "$1" NEW "$3")"
  ratio=$(awk -v a="$new_c" -v b="$old_c" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b }')
  echo "| $2 | $old_c | $new_c | $ratio | $old_chk | $new_chk |"
}
for c in "${CASES[@]}"; do
  case "$c" in
    # Its first launch is the one a decode step makes (the weights in DRAM).
    attn-norm-qkv)
      line "$c" "attn-norm-qkv, first launch (cold)" 1
      line "$c" "attn-norm-qkv" 2 ;;
    *) line "$c" "$(args_of "$c")" 2 ;;
  esac
done
