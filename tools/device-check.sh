#!/usr/bin/env bash
# One prepared check on a GPU machine (written for an H200, sm_90). The speed comes
# first, so that a run cut short still has it: a Qwen3-30B-A3B-shaped fixture (16 GiB
# of q4_K experts, Qwen3's 151,936-token vocabulary) benchmarked at three slot
# counts and its batched prefill (pp512, pp2048), then llama.cpp's CUDA llama-bench
# on the same file (when bundled: tools/build-llama-cuda.sh) and the miss copy
# (stage copy kernel vs cudaMemcpyAsync). Then the GPU tests (cuda_conformance_test
# first: it holds the CPU emulator of docs/EMULATOR.md to the hardware), the gates,
# a decode of a synthetic qwen3moe fixture in every arm, racecheck and memcheck on
# the engine test, and Nsight Compute's bank conflicts and DRAM throughput of the
# matvecs and attention (where the counters are readable). It ends in one markdown
# table (check | result | detail). Finishes inside 8 minutes: every step has a
# timeout, and steps are skipped once the overall budget is spent. Reads the device
# only; never changes clocks or any setting (Nsight Compute runs with
# --clock-control none: by default it would lock the clocks to base).
#
# Usage, in three places:
#   here, on the build machine:  tools/device-check.sh --bundle BUILD_DIR [DEST]
#     Copies the six binaries the check runs, every shared library they link that
#     is not part of the C/C++ runtime (Abseil, Google Benchmark, the CUDA runtime:
#     the device image has none of them, so it can neither build nor load a carried
#     build tree), and $MOEGRAPH_SHARED/golden/quant (the dequant test's data; the
#     ../shared beside the checkout does not travel) into DEST, default
#     build-device/ (ignored by git). Prints its size and refuses (exit 1, DEST
#     removed) a bundle that with the working tree would pass the device's 64 MiB
#     carry limit. The device call then carries DEST alone:
#     run(command="tools/device-check.sh build-device", carry=["build-device"]).
#   here, before that call:  tools/device-check.sh --dry-run [BUILD_DIR]
#     Prints every step's command line in the order the run executes them (the
#     same plan the run executes: make_plan below), with its time limit, its log
#     and the file under $OUT it writes, and resolves every binary's libraries with
#     ldd (in a bundle: from its lib/). Runs nothing else; exit 1, naming the
#     binary, where a library is not found or a binary is not built.
#     tests/device_check_dry_run_test.sh runs it in CI.
#   on the GPU machine:  tools/device-check.sh [BUILD_DIR]   (from the repository root)
#     BUILD_DIR: a bundle or build folder whose binaries to use; default the first
#     of build-device/, build-sm90/, build/ that holds them, else build-sm90/ is
#     configured and built here (this needs Abseil, GoogleTest and Benchmark).
# At most 8 files come back from $OUT, so the check writes five there (OUT_FILES):
# the table ($OUT/device-check.md), the Qwen3-shaped bench table
# ($OUT/qwen3-bench.md), its prefill rows ($OUT/qwen3-prefill.md), llama-bench's
# tables ($OUT/llama-bench.md) and every step's log in one $OUT/logs.tar.gz
# (logs/NAME under $WORK; packed on every exit). The table is printed on every exit
# (a failed step, a timeout, a signal, a script error), with a row naming the step
# that was cut short.
#
# Host memory of the Qwen3-shaped bench: bench pins the expert store (16.1 GiB) once
# and every engine shares it; each resident engine also holds every expert on the GPU.
# GPU memory peaks in the 6144-slot group (two engines holding every expert, ~35
# GiB). The fixture lives in $WORK (16.8 GiB on disk, or in RAM where /tmp is tmpfs).
set -u

# The binaries the check runs, relative to a build folder or a bundle.
readonly BINARIES=(tools/moegraph tools/moegraph_gpu_bench gates/moegraph-gates
  tests/cuda_conformance_test tests/kernels_test tests/engine_gpu_test)
# The peer, in a bundle only.
readonly PEER=llama/llama-bench
# Libraries the bundle leaves behind. The C and C++ runtime: the device image's own
# is as new or newer. cuBLASLt and cuBLAS (540 MB, over the carry limit): the image
# has its own. The peer also takes the CUDA runtime from the image's toolkit.
readonly RUNTIME_LIBS='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcublasLt|libcublas)\.so'
readonly PEER_CUDA_LIBS='^lib(cuda|cudart|cublas|cublasLt)\.so'
# The driver's, which only a machine with a GPU has: a dry run here lets them be missing.
readonly DRIVER_LIBS='^lib(cuda|nvidia-ml)\.so'
# What one device call may carry: the working tree (git's tracked and untracked,
# not ignored files) and the carried paths together.
readonly CARRY_LIMIT=$((64 * 1024 * 1024))
# The only files written under $OUT (at most 8 come back).
readonly TABLE_FILE=device-check.md LOGS_FILE=logs.tar.gz
readonly OUT_FILES=("$TABLE_FILE" qwen3-bench.md qwen3-prefill.md llama-bench.md "$LOGS_FILE")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
readonly ROOT

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# tree_bytes: the size of the working tree that travels with every device call.
tree_bytes() {
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard 2>/dev/null |
    du -cb --files0-from=- 2>/dev/null | awk 'END { print $1 + 0 }')
}

# carry_check DIR: says DIR's size and fails where DIR and the working tree
# together pass the carry limit.
carry_check() {
  local dir=$1 bytes tree
  bytes=$(du -sb "$dir" | cut -f1)
  tree=$(tree_bytes)
  if ((bytes + tree > CARRY_LIMIT)); then
    echo "device-check: $dir/ is $(mib "$bytes"), with the working tree ($(mib "$tree"))" \
      "$(mib $((bytes + tree))): over the device's carry limit of $(mib "$CARRY_LIMIT")." \
      "The largest files:" >&2
    find "$dir" -type f -printf '%s %p\n' | sort -rn | head -5 |
      while read -r size path; do echo "  $(mib "$size")  $path" >&2; done
    return 1
  fi
  echo "$dir/ is $(mib "$bytes"); with the working tree ($(mib "$tree"))" \
    "$(mib $((bytes + tree))) of the device's $(mib "$CARRY_LIMIT") carry limit"
}

# bundle BUILD_DIR DEST: the --bundle mode of the usage above.
bundle() {
  local build=$1 dest=$2 shared=${MOEGRAPH_SHARED:-$PWD/../shared} bin name path
  for bin in "${BINARIES[@]}"; do
    if [[ ! -x $build/$bin ]]; then
      echo "device-check --bundle: $build/$bin is not built" >&2
      return 1
    fi
    if ldd "$build/$bin" | grep -q 'not found'; then
      echo "device-check --bundle: $build/$bin links a library ldd cannot find here" >&2
      return 1
    fi
  done
  if [[ ! -d $shared/golden/quant ]]; then
    echo "device-check --bundle: no $shared/golden/quant (set MOEGRAPH_SHARED)" >&2
    return 1
  fi
  rm -rf "$dest"
  mkdir -p "$dest/lib" "$dest/shared/golden" || return 1
  for bin in "${BINARIES[@]}"; do
    mkdir -p "$dest/$(dirname "$bin")" && cp "$build/$bin" "$dest/$bin" || return 1
    while read -r name path; do
      [[ $name =~ $RUNTIME_LIBS ]] || cp -L "$path" "$dest/lib/$name" || return 1
    done < <(ldd "$build/$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')
  done
  cp -R "$shared/golden/quant" "$dest/shared/golden/" || return 1
  # The peer, when tools/build-llama-cuda.sh has built it: llama-bench (ggml and
  # llama linked in) without the CUDA toolkit's libraries, which the device has.
  local llama=${LLAMA_CUDA_BUILD:-$PWD/build-llama-cuda}/build/bin/llama-bench
  if [[ -x $llama ]]; then
    mkdir -p "$dest/$(dirname "$PEER")" && strip -o "$dest/$PEER" "$llama" || return 1
    while read -r name path; do
      [[ $name =~ $RUNTIME_LIBS || $name =~ $PEER_CUDA_LIBS ]] ||
        cp -L "$path" "$dest/lib/$name" || return 1
    done < <(ldd "$llama" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')
  else
    echo "device-check --bundle: no $llama (tools/build-llama-cuda.sh builds it): no peer rows"
  fi
  # A call over the limit fails before it starts: no bundle rather than one that
  # cannot travel.
  if ! carry_check "$dest"; then
    rm -rf "$dest"
    echo "device-check --bundle: refused; $dest/ removed" >&2
    return 1
  fi
  echo "bundled $build/ into $dest/; on the device carry [\"$dest\"] and run" \
    "tools/device-check.sh $dest (check it first: tools/device-check.sh --dry-run $dest)"
}

if [[ ${1:-} == --bundle ]]; then
  if [[ -z ${2:-} ]]; then
    echo "usage: tools/device-check.sh --bundle BUILD_DIR [DEST]" >&2
    exit 2
  fi
  bundle "$2" "${3:-build-device}"
  exit
fi
DRY_RUN=0
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi
if [[ ${1:-} == -* || $# -gt 1 ]]; then
  echo "usage: tools/device-check.sh [--dry-run] [BUILD_DIR] | --bundle BUILD_DIR [DEST]" >&2
  exit 2
fi

readonly BUDGET_S=450  # leaves headroom under 8 minutes
readonly START=$SECONDS
ROWS=()

row() { ROWS+=("| $1 | $2 | $3 |"); }
left() { echo $((BUDGET_S - (SECONDS - START))); }

# timed LIMIT LOG CMD...: runs CMD with a timeout capped by the budget left.
timed() {
  local limit=$1 log=$2
  shift 2
  local remaining
  remaining=$(left)
  if ((remaining < 10)); then
    echo "budget spent" >"$log"
    return 124
  fi
  ((limit > remaining)) && limit=$remaining
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
}

# "N passed, N failed, N skipped" from a gtest log.
gtest_counts() {
  local log=$1 passed failed skipped
  passed=$(grep -oE '\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  failed=$(grep -oE '\[  FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | tail -1)
  skipped=$(grep -oE '\[  SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  echo "${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
}

# copy_gbps LOG PATH BLOCK_BYTES: 1e9 bytes per second of BM_Copy/PATH/8/BLOCK_BYTES
# in moegraph_gpu_bench's CSV (name,iterations,real_time,cpu_time,time_unit,
# bytes_per_second,items_per_second,label,error_occurred,...); empty when it failed.
copy_gbps() {
  awk -F, -v name="\"BM_Copy/$2/8/$3/manual_time\"" \
    '$1 == name && $9 != "true" && $6 != "" { printf "%.1f", $6 / 1e9 }' "$1"
}

# The plan: every command the check runs after its setup, in the order it runs
# them. The run executes these entries and --dry-run prints them, so the two
# cannot drift apart. step ID LIMIT_S LOG OUT_FILE CMD...: LOG is a name under
# $LOGS (empty: the console); OUT_FILE, when not empty, one of OUT_FILES, which
# then holds the logs of every step naming it, in plan order.
PLAN=()
declare -A P_CMD P_LIMIT P_LOG P_OUT
step() {
  local id=$1 limit=$2 log=$3 out=$4
  shift 4
  if [[ -n $out && " ${OUT_FILES[*]} " != *" $out "* ]]; then
    echo "device-check: step '$id' writes \$OUT/$out, not one of: ${OUT_FILES[*]}" >&2
    exit 2
  fi
  PLAN+=("$id")
  P_LIMIT[$id]=$limit
  P_LOG[$id]=${log:+$LOGS/$log}
  P_OUT[$id]=$out
  P_CMD[$id]=$(quote "$@")
}

# quote WORD...: the words as a shell reads them back (eval), plain where they can be.
quote() {
  local word
  for word in "$@"; do
    if [[ $word =~ ^[-A-Za-z0-9_./=,:+@%]+$ ]]; then echo -n "$word "; else printf '%q ' "$word"; fi
  done
}

# show ID: the step's command line as a shell reads it, $WORK and $OUT by name.
show() {
  local line=${P_CMD[$1]% }
  line=${line//"$WORK"/\$WORK}
  if [[ -n $OUT_DIR ]]; then line=${line//"$OUT_DIR"/\$OUT}; fi
  echo "$line"
}

# program ID: the program a step runs (after env and its assignments).
program() {
  local -a argv
  eval "argv=(${P_CMD[$1]})"
  while [[ ${argv[0]} == env || ${argv[0]} == *=* ]]; do argv=("${argv[@]:1}"); done
  echo "${argv[0]}"
}

# publish ID: the logs of every step that names the step's file under $OUT, there.
publish() {
  local out=${P_OUT[$1]} id
  [[ -n $out && -n $OUT_DIR && $out != "$LOGS_FILE" ]] || return 0
  for id in "${PLAN[@]}"; do
    if [[ ${P_OUT[$id]} == "$out" && -f ${P_LOG[$id]} ]]; then cat "${P_LOG[$id]}"; fi
  done >"$OUT_DIR/$out"
}

# run_step ID: the planned command, under its limit (capped by the budget left).
run_step() {
  local id=$1 rc
  local -a argv
  eval "argv=(${P_CMD[$id]})"
  echo "\$ $(show "$id")"
  timed "${P_LIMIT[$id]}" "${P_LOG[$id]}" "${argv[@]}"
  rc=$?
  publish "$id"
  return $rc
}

# start_step ID: the planned command in the background; its pid in STARTED.
start_step() {
  local id=$1
  local -a argv
  eval "argv=(${P_CMD[$id]})"
  echo "\$ $(show "$id") &"
  timeout --kill-after=5 "${P_LIMIT[$id]}" "${argv[@]}" >"${P_LOG[$id]}" 2>&1 &
  STARTED=$!
  BACKGROUND+=("$STARTED")
}

# library_problems: "binary: lib, lib;" for each binary whose shared libraries do
# not all resolve (ldd's 'not found'), and each one not built. In a dry run the
# driver's may be missing (no GPU here), and a bundle's must come from its lib/
# unless the bundle leaves them behind on purpose (RUNTIME_LIBS, PEER_CUDA_LIBS):
# ldd here also finds the build machine's copies, which the device does not have.
library_problems() {
  local bin path bad name arrow target ld
  for bin in "${BINARIES[@]}" "$PEER"; do
    path=$BUILD/$bin
    if [[ ! -x $path ]]; then
      [[ $bin == "$PEER" ]] || echo -n " ${bin##*/}: not built;"
      continue
    fi
    ld=${LD_LIBRARY_PATH:-}
    if [[ $bin == "$PEER" ]]; then ld=$PEER_LD_LIBRARY_PATH; fi
    bad=""
    while read -r name arrow target _; do
      [[ $arrow == "=>" ]] || continue
      if [[ $target == not ]]; then
        ((DRY_RUN)) && [[ $name =~ $DRIVER_LIBS ]] && continue
        bad+="${bad:+, }$name not found"
      elif ((DRY_RUN)) && [[ -d $BUILD/lib && $target != "$BUNDLE_LIB"/* ]] &&
        ! [[ $name =~ $RUNTIME_LIBS || $name =~ $DRIVER_LIBS ]] &&
        ! [[ $bin == "$PEER" && $name =~ $PEER_CUDA_LIBS ]]; then
        bad+="${bad:+, }$name (from $target, not the bundle)"
      fi
    done < <(LD_LIBRARY_PATH=$ld ldd "$path" 2>&1)
    if [[ -n $bad ]]; then echo -n " ${bin##*/}: $bad;"; fi
  done
}

STEP=setup     # the step running now; named in the table if the script stops in it
BACKGROUND=()  # fixture writers still running at exit are stopped before $WORK goes
if ((DRY_RUN)); then
  # Names only: nothing is created or written. show prints them as $WORK and $OUT.
  WORK=/device-check-dry-run/work
  OUT_DIR=/device-check-dry-run/out
else
  WORK=$(mktemp -d)
  OUT_DIR=""
  if [[ -n ${OUT:-} && -d $OUT ]]; then OUT_DIR=$(cd "$OUT" && pwd); fi
fi
LOGS=$WORK/logs
((DRY_RUN)) || mkdir -p "$LOGS"

# On every exit: the table (with a row for a step cut short), then the logs packed
# into $OUT, then the cleanup.
finish() {
  local pid table argv
  if [[ $STEP != finished ]]; then
    row "$STEP" "FAIL" "cut short: stopped by a signal, a timeout or a script error"
  fi
  table=$(
    echo "device check, $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - START)) s"
    echo
    echo "| check | result | detail |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
  )
  for pid in "${BACKGROUND[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null
  echo
  echo "$table"
  if [[ -n $OUT_DIR ]]; then
    echo "$table" >"$OUT_DIR/$TABLE_FILE"
    echo "$table" >"$LOGS/$TABLE_FILE"
    if [[ -n ${P_CMD[pack]:-} ]]; then
      eval "argv=(${P_CMD[pack]})"
      timeout 60 "${argv[@]}" || echo "packing the logs failed" >&2
    fi
  fi
  rm -rf "$WORK"
}
((DRY_RUN)) || trap finish EXIT

# Setup: the build to use, the libraries' paths, cuBLASLt.
BUILD=${1:-}
if [[ -z $BUILD ]]; then
  for candidate in build-device build-sm90 build; do
    if [[ -x $candidate/tools/moegraph && -x $candidate/tests/engine_gpu_test ]]; then
      BUILD=$candidate
      break
    fi
  done
fi
BUILD=${BUILD%/}
if ((DRY_RUN)); then
  if [[ -z $BUILD ]]; then
    echo "device-check --dry-run: no build-device/, build-sm90/ or build/ with the binaries" >&2
    exit 1
  fi
elif [[ -n $BUILD && -x $BUILD/tools/moegraph ]]; then
  echo "== build"
  row "build" "ok" "carried $BUILD/"
else
  echo "== build"
  STEP=build
  BUILD=${BUILD:-build-sm90}
  # CMake refuses a cache written at another root (a tree carried from the build
  # machine): configure a fresh tree instead.
  if [[ -f $BUILD/CMakeCache.txt ]] &&
    ! grep -qxF -e "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" \
      -e "CMAKE_HOME_DIRECTORY:INTERNAL=$(pwd -P)" "$BUILD/CMakeCache.txt"; then
    BUILD="build-sm90-here"
  fi
  if timed 60 "$LOGS/configure.log" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
      -DMOEGRAPH_CUDA_ARCHS=90 &&
    timed 300 "$LOGS/build.log" cmake --build "$BUILD" -j "$(nproc)" \
      --target moegraph moegraph-gates cuda_conformance_test kernels_test engine_gpu_test \
      moegraph_gpu_bench; then
    row "build" "ok" "configured and built $BUILD/ for sm_90 in $((SECONDS - START)) s"
  else
    tail -20 "$LOGS/configure.log" "$LOGS/build.log" 2>/dev/null
    row "build" "FAIL" "see the log above"
  fi
fi
MOEGRAPH=$BUILD/tools/moegraph
LLAMA_BENCH=$BUILD/$PEER

if ((!DRY_RUN)); then
  echo "== cublasLt"
  STEP=cublasLt
  # The prefill's GEMMs open cuBLASLt (dlopen, kernels/gemm.cc) and the conformance
  # test links it; the bundle does not carry it: the image's copy (the
  # nvidia-cublas wheel of its Python, or the toolkit's) goes on the path.
  cublaslt=$( (ldconfig -p 2>/dev/null | awk '/libcublasLt\.so\.13 / { print $NF; exit }'
    find /usr/local/cuda/lib64 /usr/local/cuda/targets /opt /usr/lib -name 'libcublasLt.so.13*' \
      2>/dev/null) | head -1)
  if [[ -n $cublaslt ]]; then
    LD_LIBRARY_PATH=$(dirname "$cublaslt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    row "cublasLt" "ok" "$cublaslt"
  else
    row "cublasLt" "FAIL" "no libcublasLt.so.13 on the machine: the conformance test cannot load, prompts run as steps"
  fi
fi

# A bundle brings its own libraries and the tests' shared data.
BUNDLE_LIB=""
if [[ -d $BUILD/lib ]]; then
  BUNDLE_LIB=$(cd "$BUILD/lib" && pwd)
  LD_LIBRARY_PATH=$BUNDLE_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [[ -n ${LD_LIBRARY_PATH:-} ]]; then export LD_LIBRARY_PATH; fi
# The peer's CUDA runtime and cuBLAS: the device toolkit's, first.
PEER_LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [[ -z ${MOEGRAPH_SHARED:-} ]]; then
  if [[ -d $BUILD/shared ]]; then
    MOEGRAPH_SHARED=$(cd "$BUILD/shared" && pwd)
  else
    MOEGRAPH_SHARED=$PWD/../shared
  fi
fi
export MOEGRAPH_SHARED

# The fixtures. The small one decodes in every arm; 512 experts in all, so 128
# slots make the policy arms miss.
FIXTURE=$WORK/qwen3moe-8x64-q4k.gguf
# The Qwen3-30B-A3B-shaped one: 48 layers, 128 experts, top-8, q4_K experts, and
# Qwen3's 151,936 rows of vocabulary: its lm_head (q8_0, 315 MiB) is read every
# token, as the real model's is. Two expert variants per layer copied to all 128
# (the bench's routing comes from a trace, so equal weights do not matter) make it
# in well under a minute.
QWEN3=$WORK/qwen3-30b-a3b-shape-q4k.gguf
QWEN3_TRACE=$WORK/qwen3-trace.bin
readonly TOKENS=1,2,3,4,5,6,7,8
readonly N=64
readonly ARMS=(resident graph graph-nopdl graph-split graph-s4 eager host stage)
declare -A ARGS=(
  [resident]="--arm resident"
  [graph]="--arm graph --slots 128"
  [graph-s4]="--arm graph --slots 128 --steps-per-launch 4"
  [graph-nopdl]="--arm graph --slots 128"
  [graph-split]="--arm graph --slots 128"
  [eager]="--arm eager --slots 128"
  [host]="--arm host --slots 128"
  [stage]="--arm stage"
)
# The arms' doors beyond --arm: graph-nopdl is the graph arm without
# programmatic dependent launch (its one expert pass then starts after the
# copy), graph-split the split passes (the copy on the copy stream, hits
# before the join), each rate beside graph's.
declare -A ENVS=([graph-nopdl]="MOEGRAPH_PDL=0" [graph-split]="MOEGRAPH_SPLIT_PASSES=1")
readonly LLAMA_SETTINGS=("-ngl 99" "-ngl 99 --n-cpu-moe 24")
readonly GPU_TESTS=(cuda_conformance_test kernels_test engine_gpu_test)
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)

make_plan() {
  local setting test arm tool i=0
  local -a prefix
  # The device, read-only. The binaries link CUDA 13's runtime, which needs
  # driver 580 or newer.
  step device 30 device.log "" nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader
  # CPU work; the small fixture is written in the background while the large one
  # is written.
  step fixture 150 fixture.log "" "$MOEGRAPH" make-fixture --arch qwen3moe --layers 8 \
    --experts 64 --top-k 4 --embd 1024 --ff 512 --heads 16 --vocab 4096 \
    --quant q8_0,expert=q4_K --router-skew 1 --seed 3 -o "$FIXTURE"
  step "qwen3 fixture" 240 qwen3-fixture.log "" "$MOEGRAPH" make-fixture --arch qwen3moe \
    --layers 48 --experts 128 --top-k 8 --embd 2048 --ff 768 --heads 32 --kv-heads 4 \
    --head-dim 128 --vocab 151936 --quant q8_0,expert=q4_K --expert-variants 2 -o "$QWEN3"
  step "qwen3 trace" 30 qwen3-trace.log "" "$MOEGRAPH" trace synth --layers 48 --experts 128 \
    --top-k 8 --reuse 0.45 --steps 256 -o "$QWEN3_TRACE"
  # The headline: first, while nothing else runs.
  step "qwen3 bench" 200 qwen3-bench.md qwen3-bench.md "$MOEGRAPH" bench --backend cuda \
    -m "$QWEN3" --routing-trace "$QWEN3_TRACE" --arms resident,graph,host,stage \
    --slots 1536,3072,6144 -p 0 -n 32 -r 2
  # The batched prefill on the same file, the router deciding: resident (every
  # expert in place) and graph at 3072 slots (half the experts; the others
  # streamed through the ring), pp512 and pp2048 as llama-bench's -p.
  step "qwen3 prefill" 150 qwen3-prefill.md qwen3-prefill.md "$MOEGRAPH" bench \
    --backend cuda -m "$QWEN3" --arms resident,graph --slots 3072 -p 512,2048 -n 0 -r 2
  # The cached arm's two walks side by side at the middle slot count: the one
  # expert pass (the default, in the headline table) against the split passes.
  step "qwen3 bench split passes" 90 qwen3-bench-split.log "" env MOEGRAPH_SPLIT_PASSES=1 \
    "$MOEGRAPH" bench --backend cuda -m "$QWEN3" --routing-trace "$QWEN3_TRACE" --arms graph \
    --slots 3072 -p 0 -n 32 -r 2
  # The chained launches (MOEGRAPH_CHAIN, on in the headline) against two
  # launches each: what a kernel node fewer a chain saves, resident and cached.
  step "qwen3 bench unchained" 90 qwen3-bench-unchained.log "" env MOEGRAPH_CHAIN=0 \
    "$MOEGRAPH" bench --backend cuda -m "$QWEN3" --routing-trace "$QWEN3_TRACE" \
    --arms resident,graph --slots 3072 -p 0 -n 32 -r 2
  # The peer on the same file: every layer's experts on the GPU (-ngl 99), then
  # the experts of half the layers on the host (--n-cpu-moe 24: the other 24
  # layers' 3072 experts on the GPU, the graph arm's middle slot count above).
  for setting in "${LLAMA_SETTINGS[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086 # the setting is words
    step "llama.cpp $setting" 150 "llama-bench-$i.md" llama-bench.md \
      env "LD_LIBRARY_PATH=$PEER_LD_LIBRARY_PATH" "$LLAMA_BENCH" -m "$QWEN3" $setting \
      -p 512,2048 -n 32 -r 2 -o md
  done
  # The miss copy: the same bytes both ways, 8 Qwen3 q4_K expert blocks (a layer
  # that misses all top-8), then 8 x 8 MiB. bytes_per_second is over CUDA-event time.
  step "copy bench" 60 copy-bench.csv "" "$BUILD/tools/moegraph_gpu_bench" \
    --benchmark_format=csv
  for test in "${GPU_TESTS[@]}"; do
    step "$test" 150 "$test.log" "" "$BUILD/tests/$test" --gtest_brief=1
  done
  step gates 120 gates.log "" "$BUILD/gates/moegraph-gates" --backend cuda
  for arm in "${ARMS[@]}"; do
    prefix=()
    # shellcheck disable=SC2206 # ENVS holds variable assignments
    if [[ -n ${ENVS[$arm]:-} ]]; then prefix=(env ${ENVS[$arm]}); fi
    # shellcheck disable=SC2086 # ARGS holds several flags
    step "run $arm" 45 "run-$arm.log" "" "${prefix[@]}" "$MOEGRAPH" run --backend cuda \
      -m "$FIXTURE" --tokens "$TOKENS" -n "$N" ${ARGS[$arm]}
  done
  # compute-sanitizer on the engine test's every-arm run (the step's kernels,
  # epilogues and copies): racecheck finds shared-memory hazards, memcheck
  # out-of-bounds and misaligned accesses.
  for tool in racecheck memcheck; do
    step "$tool" 60 "$tool.log" "" "$SANITIZER" --tool "$tool" --error-exitcode 3 \
      "$BUILD/tests/engine_gpu_test" --gtest_filter=EngineArmsTest.EveryArmGivesTheSameTokensAndLogits
  done
  # Where Nsight Compute may read the counters: shared-memory bank conflicts,
  # DRAM throughput and each kernel's time (beside docs/ARCHITECTURE.md's
  # per-kernel estimate) of the matvecs, q/k/v and the attention of 8 decoded
  # tokens on the Qwen3-shaped file (resident: every expert in place).
  # --clock-control none: the device's clocks as they are (ncu would otherwise
  # lock them to base).
  step ncu 60 ncu.csv "" "$NCU" --csv --clock-control none --launch-skip 200 \
    --launch-count 40 -k regex:'grouped_matvec|qkv_kernel|attention_split' \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    "$MOEGRAPH" run -m "$QWEN3" --backend cuda --arm resident --tokens 1,2,3 -n 8
  # On every exit (finish), also a cut-short one: every log in one file.
  if [[ -n $OUT_DIR ]]; then
    step pack 60 "" "$LOGS_FILE" tar -czf "$OUT_DIR/$LOGS_FILE" -C "$WORK" logs
  fi
}
make_plan

if ((DRY_RUN)); then
  echo "device-check --dry-run: $BUILD/ ($([[ -n $BUNDLE_LIB ]] && echo bundle || echo build tree));" \
    "the run's steps in order, each with its limit in seconds (the run's budget: ${BUDGET_S} s)"
  i=0
  for id in "${PLAN[@]}"; do
    i=$((i + 1))
    note=""
    prog=$(program "$id")
    if [[ $prog != */* ]]; then
      command -v "$prog" >/dev/null || note=" (no $prog here)"
    elif [[ $prog == "$LLAMA_BENCH" && ! -x $prog ]]; then
      note=" (not bundled: SKIPPED)"
    elif [[ ! -x $prog ]]; then
      note=" (no $prog here)"
    fi
    where=""
    case $id in
      fixture) where=", in the background" ;;
      pack) where=", on exit" ;;
    esac
    echo "[$i] $id (${P_LIMIT[$id]} s$where)${P_LOG[$id]:+ > ${P_LOG[$id]//"$WORK"/\$WORK}}${P_OUT[$id]:+ -> \$OUT/${P_OUT[$id]}}$note"
    echo "    $(show "$id")"
  done
  echo "[on exit] table -> \$OUT/$TABLE_FILE"
  status=0
  problems=$(library_problems)
  if [[ -n $problems ]]; then
    echo "device-check --dry-run: libraries:$problems" >&2
    status=1
  else
    from=""
    if [[ -n $BUNDLE_LIB ]]; then from=", the bundled ones from $BUILD/lib/"; fi
    echo "libraries: every binary's resolve here (ldd$from)"
  fi
  if [[ -n $BUNDLE_LIB ]]; then carry_check "$BUILD" || status=1; fi
  exit $status
fi

STEP=libraries
MISSING=$(library_problems)
if [[ -n $MISSING ]]; then
  row "libraries" "FAIL" "${MISSING# } (tools/device-check.sh --bundle carries the libraries)"
else
  row "libraries" "ok" "every binary loads its shared libraries"
fi

FIXTURE_PID=""
FIXTURE_OK=""
QWEN3_OK=0
TRACE_OK=0
REFERENCE=""
for id in "${PLAN[@]}"; do
  STEP=$id
  echo "== $id"
  log=${P_LOG[$id]}
  case $id in
    device)
      run_step device
      rc=$?
      cat "$log"
      # The device row first: it says what the others ran on.
      IFS=, read -r name driver memory <"$log"
      if ((rc == 0)) && [[ -n $name ]]; then
        ROWS=("| device | ok | $name, driver${driver}, ${memory# } |" "${ROWS[@]}")
      else
        ROWS=("| device | FAIL | nvidia-smi exit $rc: $(tail -1 "$log") |" "${ROWS[@]}")
      fi
      ;;
    fixture)
      if [[ -x $MOEGRAPH ]]; then
        start_step fixture
        FIXTURE_PID=$STARTED
      fi
      ;;
    "qwen3 fixture")
      if [[ ! -x $MOEGRAPH ]]; then
        row "$id" "FAIL" "no $MOEGRAPH"
        continue
      fi
      started=$SECONDS
      run_step "$id"
      rc=$?
      cat "$log"
      if ((rc == 0)) && [[ -f $QWEN3 ]]; then
        QWEN3_OK=1
        size=$(stat -c %s "$QWEN3" | awk '{ printf "%.1f GiB", $1 / 2^30 }')
        row "$id" "ok" "48L 128x top-8 q4_K, vocab 151936, $size in $((SECONDS - started)) s"
      else
        row "$id" "FAIL" "make-fixture exit $rc: $(tail -1 "$log")"
      fi
      ;;
    "qwen3 trace")
      ((QWEN3_OK)) || continue
      run_step "$id" && TRACE_OK=1
      cat "$log"
      ;;
    "qwen3 bench")
      if ((QWEN3_OK == 0)); then
        row "$id" "FAIL" "no Qwen3-shaped fixture"
        continue
      elif ((TRACE_OK == 0)); then
        row "$id" "FAIL" "trace synth: $(tail -1 "${P_LOG[qwen3 trace]}")"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      # Columns: | model | size | params | backend | threads | arm | slots | test | t/s |
      # ...; t/s is "mean ± sd". graph/host: the mean t/s of graph over host's at each
      # slot count.
      ratios=$(awk -F'|' '
        $5 ~ /cuda/ {
          arm = $7; slots = $8; ts = $10
          gsub(/ /, "", arm); gsub(/ /, "", slots); split(ts, parts, " ")
          if (arm == "graph") { graph[slots] = parts[1]; order[++n] = slots }
          if (arm == "host") host[slots] = parts[1]
        }
        END {
          for (i = 1; i <= n; ++i) {
            s = order[i]
            if (host[s] > 0) { printf "%s%s slots %.2fx", sep, s, graph[s] / host[s]; sep = ", " }
          }
        }' "$log")
      if ((rc != 0)); then
        row "$id" "FAIL" "exit $rc: $(tail -1 "$log")"
      elif [[ -z $ratios ]]; then
        row "$id" "FAIL" "no graph and host rows in the table"
      else
        row "$id" "ok" "48L 128x top-8 q4_K, trace reuse 0.45; t/s graph/host: $ratios"
      fi
      ;;
    "qwen3 prefill")
      if ((QWEN3_OK == 0)); then
        row "$id" "FAIL" "no Qwen3-shaped fixture"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      # Columns as the qwen3 bench's; hit % is the share of experts read in place,
      # MiB/tok and stage GB/s the ring's.
      rates=$(awk -F'|' '
        $5 ~ /cuda/ && $9 ~ /pp/ {
          arm = $7; test = $9; ts = $10; gbs = $13
          gsub(/ /, "", arm); gsub(/ /, "", test); gsub(/ /, "", gbs); split(ts, parts, " ")
          printf "%s%s %s %s t/s (%s GB/s)", sep, arm, test, parts[1], gbs; sep = ", "
        }' "$log")
      if ((rc != 0)); then
        row "$id" "FAIL" "exit $rc: $(tail -1 "$log")"
      elif [[ -z $rates ]]; then
        row "$id" "FAIL" "no pp rows in the table"
      else
        row "$id" "ok" "$rates"
      fi
      ;;
    llama.cpp*)
      if [[ ! -x $LLAMA_BENCH ]]; then
        row "$id" "SKIPPED" "no $LLAMA_BENCH (tools/build-llama-cuda.sh, then --bundle)"
        continue
      elif ((QWEN3_OK == 0)); then
        row "$id" "FAIL" "no Qwen3-shaped fixture"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      # llama-bench's markdown: the last column is "t/s" as "mean ± sd".
      rate=$(awk -F'|' '/tg32/ { gsub(/ /, "", $(NF - 1)); print $(NF - 1) }' "$log" | tail -1)
      pp=$(awk -F'|' '/pp512|pp2048/ {
          test = $(NF - 2); ts = $(NF - 1); gsub(/ /, "", test); gsub(/ /, "", ts)
          printf "%s%s %s", sep, test, ts; sep = ", "
        }' "$log")
      if ((rc != 0)) || [[ -z $rate ]]; then
        row "$id" "FAIL" "exit $rc: $(tail -1 "$log")"
      else
        row "$id" "ok" "tg32 $rate t/s, $pp t/s on the Qwen3-shaped file"
      fi
      ;;
    "copy bench")
      if [[ ! -x $(program "$id") ]]; then
        row "$id" "FAIL" "not built"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      for size in 2654208 8388608; do
        kernel=$(copy_gbps "$log" stage_copy_kernel "$size")
        memcpy=$(copy_gbps "$log" cuda_memcpy_async "$size")
        label="copy 8 x $(awk -v b="$size" 'BEGIN { printf "%.2f", b / 1048576 }') MiB"
        if ((rc == 0)) && [[ -n $kernel && -n $memcpy ]]; then
          row "$label" "ok" "stage copy kernel $kernel GB/s, cudaMemcpyAsync $memcpy GB/s"
        else
          row "$label" "FAIL" "exit $rc: kernel ${kernel:-n/a} GB/s, memcpy ${memcpy:-n/a} GB/s"
        fi
      done
      ;;
    cuda_conformance_test | kernels_test | engine_gpu_test)
      if [[ ! -x $(program "$id") ]]; then
        row "$id" "FAIL" "not built"
        continue
      fi
      run_step "$id"
      rc=$?
      grep -E 'FAILED|Failure|Skipped|^\S+\.cc:[0-9]+' "$log" | head -40
      counts=$(gtest_counts "$log")
      if ((rc == 124 || rc == 137)); then
        row "$id" "FAIL" "timed out ($counts)"
      elif ((rc != 0)); then
        row "$id" "FAIL" "exit $rc: $counts"
      elif [[ $counts == *", 0 skipped" ]]; then
        row "$id" "ok" "$counts"
      else
        row "$id" "SKIPPED" "$counts"
      fi
      ;;
    gates)
      if [[ ! -x $(program "$id") ]]; then
        row "$id" "FAIL" "not built"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$log" | tail -1)
      if ((rc == 0)) && [[ -n $summary ]]; then
        row "$id" "ok" "$summary"
      else
        row "$id" "FAIL" "exit $rc: ${summary:-no summary line}"
      fi
      ;;
    "run "*)
      # The small fixture's writer, started with the large one, is long done.
      if [[ -z $FIXTURE_OK ]]; then
        STEP=fixture
        if [[ -n $FIXTURE_PID ]] && wait "$FIXTURE_PID" && [[ -f $FIXTURE ]]; then
          FIXTURE_OK=1
          row "fixture" "ok" "qwen3moe 8 layers, 64 experts, top-4, embd 1024, ff 512, q4_K experts"
        else
          FIXTURE_OK=0
          cat "${P_LOG[fixture]}" 2>/dev/null
          rm -f "$FIXTURE"
          row "fixture" "FAIL" "make-fixture failed or timed out"
        fi
        STEP=$id
      fi
      if ((FIXTURE_OK == 0)); then
        row "$id" "FAIL" "no fixture"
        continue
      fi
      run_step "$id"
      rc=$?
      cat "$log"
      summary=$(grep -E '^backend cuda \(arm' "$log" | tail -1)
      generated=$(grep -E '^generated:' "$log" | tail -1)
      if ((rc != 0)) || [[ -z $summary ]]; then
        row "$id" "FAIL" "exit $rc: $(tail -1 "$log")"
        continue
      fi
      rate=$(sed -nE 's/.* generated \(([0-9.]+ tok\/s)\).*/\1/p' <<<"$summary")
      hit=$(sed -nE 's/.*; (hit [0-9.]+%, [0-9]+ misses).*/\1/p' <<<"$summary")
      if [[ -z $REFERENCE ]]; then
        REFERENCE=$generated
        row "$id" "ok" "${rate:-n/a} decode, $hit"
      elif [[ $generated == "$REFERENCE" ]]; then
        row "$id" "ok" "${rate:-n/a} decode, $hit, tokens equal resident's"
      else
        row "$id" "FAIL" "${rate:-n/a} decode, tokens differ from resident's"
      fi
      ;;
    racecheck | memcheck)
      if [[ ! -x $SANITIZER || ! -x $BUILD/tests/engine_gpu_test ]]; then
        row "$id" "SKIPPED" "no compute-sanitizer or engine_gpu_test"
        continue
      fi
      run_step "$id"
      rc=$?
      tail -5 "$log"
      summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)
      if ((rc == 0)); then
        row "$id" "ok" "engine every-arm test: ${summary:-no summary line}"
      else
        row "$id" "FAIL" "exit $rc: ${summary:-$(tail -1 "$log")}"
      fi
      ;;
    ncu)
      if [[ ! -x $NCU ]]; then
        row "$id" "SKIPPED" "no ncu"
        continue
      elif ((QWEN3_OK == 0)); then
        row "$id" "FAIL" "no Qwen3-shaped fixture"
        continue
      fi
      run_step "$id"
      rc=$?
      tail -3 "$log"
      # CSV rows: ..."Kernel Name",...,"Metric Name","Metric Unit","Metric Value";
      # the header row's value is no number. Times in us whatever unit ncu chose.
      metrics=$(awk -F'","' '
        NF > 5 {
          kernel = ($0 ~ /attention_split/) ? "attention" : ($0 ~ /qkv_kernel/) ? "qkv" : "matvec"
          metric = $(NF - 2); unit = $(NF - 1); value = $NF; gsub(/[",]/, "", value)
          if (value !~ /^[0-9.]+$/) next
          if (metric ~ /duration/) {
            name = "us"
            if (unit == "nsecond") value /= 1000
            if (unit == "msecond") value *= 1000
          } else {
            name = metric ~ /bank/ ? "bank conflicts" : "DRAM % of peak"
          }
          key = kernel " " name
          sum[key] += value; n[key]++
        }
        END { for (k in sum) { printf "%s%s %.1f", sep, k, sum[k] / n[k]; sep = "; " } }' \
        "$log")
      if ((rc != 0)) && grep -q ERR_NVGPUCTRPERM "$log"; then
        row "$id" "SKIPPED" "the counters are not readable here (ERR_NVGPUCTRPERM)"
      elif ((rc != 0)) || [[ -z $metrics ]]; then
        row "$id" "FAIL" "exit $rc: $(tail -1 "$log")"
      else
        row "$id" "ok" "mean per launch: $metrics"
      fi
      ;;
    pack) ;;  # finish packs the logs, on every exit
    *)
      row "$id" "FAIL" "planned but not handled (device-check.sh's bug)"
      ;;
  esac
done

rm -f "$QWEN3"
STEP=finished
