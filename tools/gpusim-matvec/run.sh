#!/bin/bash
# Issue 40's simulator proof: moegraph's decode matvec (NEW: the working
# tree's grouped_matvec_kernel; OLD: the kernel before the rewrite) against
# llama.cpp's mul_mat_vec_q (GGML, compiled from build-peer/llama.cpp) under
# gpusim (GPGPU-Sim, RTX 3070-like), one kernel per process (cold L2), and one
# markdown table of what the simulator reports. Not part of CI: each run takes
# seconds to minutes on 2 cores (about 25 minutes in all).
#
#   tools/gpusim-matvec/run.sh [--table] [CASE...]
#     CASE: q8_0 (4096 x 2048), q4_K (768 x 2048), q4_K_pair (gate/up, 768 x 2048 each);
#           default all three
#     --table: print the table from the last runs' outputs, simulating nothing
#   Environment: GPUSIM (default ../shared/gpusim beside the checkout), PEER (default
#   build-peer/llama.cpp), OLD_REV (default c082d5c, the commit before the
#   matvec rewrite 9bea7ed), KERNELS (default "NEW GGML OLD"; NEWNC adds NEW
#   with its weight loads ld.global.nc instead of .cg / .ca, a PTX edit for
#   diagnosis, not the committed kernel), NVCC.
# Build output and logs: build-gpusim/ (ignored).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
HERE=$ROOT/tools/gpusim-matvec
B=$ROOT/build-gpusim
GPUSIM=${GPUSIM:-$(cd "$ROOT/../shared/gpusim" 2>/dev/null && pwd -P)}
PEER=${PEER:-$ROOT/build-peer/llama.cpp}
OLD_REV=${OLD_REV:-c082d5c}
KERNELS=${KERNELS:-NEW GGML OLD}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
BUNDLE=$ROOT/tools/llama-crosscheck/node_modules/node-llama-cpp/llama/gitRelease.bundle

TABLE_ONLY=0
CASES=()
for a in "$@"; do
  case "$a" in
    --table) TABLE_ONLY=1 ;;
    q8_0|q4_K|q4_K_pair) CASES+=("$a") ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run.sh: unknown argument '$a'" >&2; exit 2 ;;
  esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(q8_0 q4_K q4_K_pair)
mkdir -p "$B/logs"
if [ "$TABLE_ONLY" = 0 ] && [ ! -x "${GPUSIM:-}/run.sh" ]; then
  echo "run.sh: no gpusim at '${GPUSIM:-}' (set GPUSIM to the folder holding gpusim's run.sh)" >&2
  exit 2
fi

# ---- build ----

# gpusim_root, sim_ptx, ptxas_wrapper.
. "$ROOT/tools/gpusim-common.sh"

HOST_FLAGS=(-O2 -arch=compute_86 -code=compute_86 -cudart shared -std=c++17)
PTX_FLAGS=(-arch=compute_86 -code=compute_86 -ptx -std=c++17)

# build_variant DIR INCLUDE_ROOT [DEFINES...]: ours_harness against one tree.
build_ours() {
  local dir=$1 tree=$2; shift 2
  mkdir -p "$dir"
  "$NVCC" "${HOST_FLAGS[@]}" "$@" -I"$tree" -I"$ROOT" "$HERE/ours_harness.cu" "$HERE/problem.cc" \
    "$tree/kernels/launch.cc" "$tree/loader/quantize.cc" "$tree/loader/ggml_type.cc" -o "$dir/harness"
  "$NVCC" "${PTX_FLAGS[@]}" "$@" -I"$tree" -I"$ROOT" "$HERE/ours_harness.cu" -o "$dir/harness.ptx"
  sim_ptx "$dir/harness.ptx" "$dir/harness.sim.ptx"
}

build_ggml() {
  local dir=$B/ggml src=$PEER/ggml/src/ggml-cuda/mmvq.cu
  if [ ! -f "$src" ]; then
    [ -f "$BUNDLE" ] || { echo "run.sh: no $src and no $BUNDLE to clone it from" >&2; exit 1; }
    git clone -q "$BUNDLE" "$PEER"
  fi
  mkdir -p "$dir"
  # mmvq.cu up to its MoE kernel, verbatim: the helpers and mul_mat_vec_q.
  awk '/^\/\/ Dedicated MoE multi-token kernel/ { found = 1; exit } { print } END { exit !found }' \
    "$src" > "$dir/mmvq_kernel.cuh" || { echo "run.sh: mmvq.cu's MoE kernel marker not found" >&2; exit 1; }
  local inc=(-I"$ROOT" -I"$dir" -I"$PEER/ggml/include" -I"$PEER/ggml/src" -I"$PEER/ggml/src/ggml-cuda")
  "$NVCC" "${HOST_FLAGS[@]}" "${inc[@]}" "$HERE/ggml_harness.cu" "$HERE/problem.cc" \
    "$ROOT/loader/quantize.cc" "$ROOT/loader/ggml_type.cc" -o "$dir/harness"
  "$NVCC" "${PTX_FLAGS[@]}" "${inc[@]}" "$HERE/ggml_harness.cu" -o "$dir/harness.ptx"
  sim_ptx "$dir/harness.ptx" "$dir/harness.sim.ptx"
}

kernel_dir() {
  case "$1" in NEW) echo "$B/new" ;; NEWNC) echo "$B/newnc" ;; OLD) echo "$B/old" ;; GGML) echo "$B/ggml" ;; esac
}

T0=$(date +%s)
if [ "$TABLE_ONLY" = 0 ]; then
  SIM=$(gpusim_root)
  GPUSIM_REAL_PTXAS=$(ptxas_wrapper)
  export GPUSIM_REAL_PTXAS
  echo "== build ($(date -u +%FT%TZ))" >&2
  for k in $KERNELS; do
    case "$k" in
      NEW) build_ours "$B/new" "$ROOT"; NEW_BUILT=1 ;;
      OLD)
        rm -rf "$B/old/src" && mkdir -p "$B/old/src"
        git -C "$ROOT" archive "$OLD_REV" kernels loader residency | tar -x -C "$B/old/src"
        build_ours "$B/old" "$B/old/src" -DGPUSIM_OLD ;;
      GGML) build_ggml ;;
      NEWNC)
        # NEW's binary; its PTX with the weight words' 32-bit integer loads
        # (ld.global.cg or .ca, .u32 / .s32: the kernels' other .cg loads are
        # the epilogues' f32) as ld.global.nc, the read-only path ggml's take.
        [ "${NEW_BUILT:-0}" = 1 ] || { build_ours "$B/new" "$ROOT"; NEW_BUILT=1; }
        mkdir -p "$B/newnc"
        sed -E 's/ld\.global\.(cg|ca)\.([us]32)/ld.global.nc.\2/g' "$B/new/harness.sim.ptx" > "$B/newnc/harness.sim.ptx"
        ln -sf ../new/harness "$B/newnc/harness" ;;
      *) echo "run.sh: unknown kernel '$k'" >&2; exit 2 ;;
    esac
  done
  # One line a run (the table's rows may come from several).
  {
    echo "$(date -u +%FT%TZ) built $KERNELS for ${CASES[*]}: moegraph HEAD $(git -C "$ROOT" rev-parse --short HEAD)," \
      "kernels/ loader/ $(git -C "$ROOT" diff --quiet HEAD -- kernels loader && echo "as HEAD" ||
        echo "modified (diff sha1 $(git -C "$ROOT" diff HEAD -- kernels loader | sha1sum | cut -c1-12))");" \
      "OLD $OLD_REV; peer llama.cpp $(git -C "$PEER" rev-parse --short HEAD 2>/dev/null || echo '?')"
  } >> "$B/logs/provenance.txt"

  # ---- simulate, one process at a time ----
  for c in "${CASES[@]}"; do
    for k in $KERNELS; do
      d=$(kernel_dir "$k")
      echo "== $c $k ($(date -u +%T))" >&2
      t=$(date +%s)
      rc=0
      "$SIM/run.sh" --ptx "$d/harness.sim.ptx" --sm 86 --log "$B/logs/$c-$k.log" -- "$d/harness" "$c" \
        > "$B/logs/$c-$k.out" 2> "$B/logs/$c-$k.err" || rc=$?
      echo "   rc $rc, $(( $(date +%s) - t )) s wall" >&2
      echo "wall_s $(( $(date +%s) - t ))" >> "$B/logs/$c-$k.out"
      [ "$rc" = 0 ] || tail -n 5 "$B/logs/$c-$k.err" >&2
    done
  done
fi

# ---- the table ----
# field FILE KEY: the numbers of the summary's lines in one .out.
row() {  # row CASE KERNEL -> "grid|block|bytes|cycles|gbs|gbs_nolat|bwutil|check"
  local f=$B/logs/$1-$2.out
  [ -f "$f" ] || { echo "missing"; return; }
  awk '
    /^\[1\] / { g = $0; sub(/.* grid \(/, "", g); sub(/\).*/, "", g)
                b = $0; sub(/.* block \(/, "", b); sub(/\).*/, "", b) }
    /^    cycles / { cyc = $2 }
    /^    DRAM read / { rd = $3; wr = $6; gbs = $8
                      nl = $0; if (sub(/.*\(/, "", nl)) { sub(/ GB\/s without.*/, "", nl) } else nl = "" }
    /^    bwutil / { bw = $2 }
    /^check / { chk = ($0 ~ /mismatches=0 /) ? "ok" : "MISMATCH"; m = $0; sub(/.*bitwise_equal=/, "", m); sub(/ .*/, "", m); eq = m }
    /^RESULT: FAIL/ { chk = "FAIL" }
    END { if (cyc == "") { print "missing"; exit }
          printf "%s|%s|%d|%s|%s|%s|%s|%s|%s\n", g, b, rd + wr, cyc, gbs, nl, bw, chk, eq }
  ' "$f"
}

echo
[ -f "$B/logs/provenance.txt" ] && sed 's/^/run /' "$B/logs/provenance.txt"
echo "gpusim SM86_RTX3070 (46 SMs, 1132 MHz, 448.1 GB/s DRAM peak), cold L2, one launch per process."
echo
echo "| case | kernel | grid x block | DRAM bytes | cycles | GB/s | GB/s w/o launch latency | bwutil | NEW/GGML |"
echo "|---|---|---|---|---|---|---|---|---|"
checks=()
for c in "${CASES[@]}"; do
  case "$c" in
    q8_0) label="q8_0 4096x2048" ;;
    q4_K) label="q4_K 768x2048 (expert gate)" ;;
    q4_K_pair) label="q4_K gate+up 2x768x2048, silu" ;;
  esac
  ggml=$(row "$c" GGML)
  for k in $KERNELS; do
    r=$(row "$c" "$k")
    if [ "$r" = missing ]; then echo "| $label | $k | (no run) | | | | | | |"; continue; fi
    IFS='|' read -r grid block bytes cyc gbs nl bw chk eq <<< "$r"
    ratio=""
    if { [ "$k" = NEW ] || [ "$k" = NEWNC ]; } && [ "$ggml" != missing ]; then
      IFS='|' read -r _ _ _ _ g_gbs g_nl _ _ _ <<< "$ggml"
      ratio=$(awk -v a="$gbs" -v b="$g_gbs" -v c="$nl" -v d="$g_nl" \
        'BEGIN { printf "%.3f (w/o latency %.3f)", a / b, c / d }')
    fi
    echo "| $label | $k | ($grid) x ($block) | $bytes | $cyc | $gbs | $nl | $bw | $ratio |"
    checks+=("$c $k: $chk (rows bitwise equal to the reference: $eq)")
  done
done
echo
echo "Output checks (|out - ref| <= 1e-5 max(|ref|, rms ref); NEW, GGML against the working tree's"
echo "matvec_row_reference, OLD against $OLD_REV's):"
for s in "${checks[@]}"; do echo "  $s"; done
if [ "$TABLE_ONLY" = 0 ]; then echo; echo "wall time: $(( $(date +%s) - T0 )) s"; fi
