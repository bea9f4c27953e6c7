#!/usr/bin/env bash
# One prepared check on a GPU machine (written for an H200, sm_90): build or reuse a
# build, run the GPU tests (cuda_conformance_test first: it holds the CPU emulator
# of docs/EMULATOR.md to the hardware), time the miss copy (stage copy kernel vs cudaMemcpyAsync),
# decode a synthetic qwen3moe fixture in every arm, benchmark a Qwen3-30B-A3B-shaped
# fixture (16 GiB of q4_K experts) at three slot counts and its batched prefill
# (pp512, pp2048, beside llama-bench's), racecheck and memcheck on
# the engine test, Nsight Compute's bank conflicts and DRAM throughput of the
# matvecs and attention (where the counters are readable), beside llama.cpp's CUDA
# llama-bench on the same file (when bundled: tools/build-llama-cuda.sh), and end
# in one markdown table (check | result | detail). Finishes inside 8 minutes: every step has a
# timeout, and steps are skipped once the overall budget is spent. Reads the device
# only; never changes clocks or any setting.
#
# Usage, in two places:
#   here, on the build machine:  tools/device-check.sh --bundle BUILD_DIR [DEST]
#     Copies the six binaries the check runs, every shared library they link that
#     is not part of the C/C++ runtime (Abseil, Google Benchmark, the CUDA runtime:
#     the device image has none of them, so it can neither build nor load a carried
#     build tree), and $MOEGRAPH_SHARED/golden/quant (the dequant test's data; the
#     ../shared beside the checkout does not travel) into DEST, default
#     build-device/ (ignored by git). The device call then carries DEST alone:
#     run(command="tools/device-check.sh build-device", carry=["build-device"]).
#   on the GPU machine:  tools/device-check.sh [BUILD_DIR]   (from the repository root)
#     BUILD_DIR: a bundle or build folder whose binaries to use; default the first
#     of build-device/, build-sm90/, build/ that holds them, else build-sm90/ is
#     configured and built here (this needs Abseil, GoogleTest and Benchmark).
# The table also goes to $OUT/device-check.md when OUT is set, the copy benchmark's
# output (CSV) to $OUT/copy-bench.log, the Qwen3-shaped bench table to
# $OUT/qwen3-bench.md, its prefill rows to $OUT/qwen3-prefill.md, and the logs
# of the GPU tests, the gates and the decode runs to $OUT/{cuda_conformance_test,kernels_test,engine_gpu_test,gates,runs}.log.
# The table is printed on every exit (a failed step, a timeout, a signal, a script
# error), with a row naming the step that was cut short.
#
# Host memory of the Qwen3-shaped bench: bench pins the expert store (16.1 GiB) once
# and every engine shares it; each resident engine also holds every expert on the GPU.
# GPU memory peaks in the 6144-slot group (two engines holding every expert, ~34
# GiB). The fixture lives in $WORK (16.2 GiB on disk, or in RAM where /tmp is tmpfs).
set -u

# The binaries the check runs, relative to a build folder or a bundle.
readonly BINARIES=(tools/moegraph tools/moegraph_gpu_bench gates/moegraph-gates
  tests/cuda_conformance_test tests/kernels_test tests/engine_gpu_test)

# bundle BUILD_DIR DEST: the --bundle mode of the usage above.
bundle() {
  local build=$1 dest=$2 shared=${MOEGRAPH_SHARED:-$PWD/../shared} bin name path
  # The C and C++ runtime stay behind: the device image's own is as new or newer.
  # So does cuBLASLt (540 MB, over the carry limit): the image has its own.
  local runtime='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcublasLt|libcublas)\.so'
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
      [[ $name =~ $runtime ]] || cp -L "$path" "$dest/lib/$name" || return 1
    done < <(ldd "$build/$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')
  done
  cp -R "$shared/golden/quant" "$dest/shared/golden/" || return 1
  # The peer, when tools/build-llama-cuda.sh has built it: llama-bench (ggml and
  # llama linked in) without the CUDA toolkit's libraries, which the device has.
  local llama=${LLAMA_CUDA_BUILD:-$PWD/build-llama-cuda}/build/bin/llama-bench
  if [[ -x $llama ]]; then
    mkdir -p "$dest/llama" && strip -o "$dest/llama/llama-bench" "$llama" || return 1
    while read -r name path; do
      [[ $name =~ $runtime || $name =~ ^lib(cuda|cudart|cublas|cublasLt)\.so ]] ||
        cp -L "$path" "$dest/lib/$name" || return 1
    done < <(ldd "$llama" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')
  else
    echo "device-check --bundle: no $llama (tools/build-llama-cuda.sh builds it): no peer rows"
  fi
  echo "bundled $build/ into $dest/ ($(du -sh "$dest" | cut -f1)); on the device carry" \
    "[\"$dest\"] and run tools/device-check.sh $dest"
}

if [[ ${1:-} == --bundle ]]; then
  if [[ -z ${2:-} ]]; then
    echo "usage: tools/device-check.sh --bundle BUILD_DIR [DEST]" >&2
    exit 2
  fi
  bundle "$2" "${3:-build-device}"
  exit
fi

readonly BUDGET_S=450  # leaves headroom under 8 minutes
readonly START=$SECONDS
ROWS=()

row() { ROWS+=("| $1 | $2 | $3 |"); }
left() { echo $((BUDGET_S - (SECONDS - START))); }

# run_step LIMIT_S LOG CMD...: runs CMD with a timeout capped by the budget left.
run_step() {
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

WORK=$(mktemp -d)
BACKGROUND=()  # fixture writers still running at exit are stopped before $WORK goes
STEP=device    # the step running now; named in the table if the script stops in it

# On every exit: the table (with a row for a step cut short), then the cleanup.
finish() {
  local pid table log
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
  echo
  echo "$table"
  if [[ -n ${OUT:-} && -d $OUT ]]; then
    echo "$table" >"$OUT/device-check.md"
    # The whole logs of the steps that can fail in detail (at most 8 files come back).
    for log in cuda_conformance_test kernels_test engine_gpu_test gates; do
      if [[ -f $WORK/$log.log ]]; then cp "$WORK/$log.log" "$OUT/$log.log"; fi
    done
    cat "$WORK"/run-*.log >"$OUT/runs.log" 2>/dev/null
  fi
  for pid in "${BACKGROUND[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap finish EXIT

echo "== device"
if timeout 60 nvidia-smi -L >"$WORK/smi.log" 2>&1; then
  cat "$WORK/smi.log"
  # The binaries link CUDA 13's runtime, which needs driver 580 or newer.
  driver=$(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null |
    head -1)
  row "device" "ok" "$(head -1 "$WORK/smi.log" | sed 's/ (UUID.*//'), driver ${driver:-unknown}"
else
  cat "$WORK/smi.log"
  row "device" "FAIL" "nvidia-smi -L failed"
fi

echo "== cublasLt"
# The prefill's GEMMs open cuBLASLt (dlopen, kernels/gemm.cc) and the conformance
# test links it; the bundle does not carry it: the image's copy (the
# nvidia-cublas wheel of its Python, or the toolkit's) goes on the path.
cublaslt=$( (ldconfig -p 2>/dev/null | awk '/libcublasLt\.so\.13 / { print $NF; exit }'
  find /usr/local/cuda/lib64 /usr/local/cuda/targets /opt /usr/lib -name 'libcublasLt.so.13*' \
    2>/dev/null) | head -1)
if [[ -n $cublaslt ]]; then
  LD_LIBRARY_PATH=$(dirname "$cublaslt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
  row "cublasLt" "ok" "$cublaslt"
else
  row "cublasLt" "FAIL" "no libcublasLt.so.13 on the machine: the conformance test cannot load, prompts run as steps"
fi

echo "== build"
STEP=build
BUILD=${1:-}
if [[ -z $BUILD ]]; then
  for candidate in build-device build-sm90 build; do
    if [[ -x $candidate/tools/moegraph && -x $candidate/tests/engine_gpu_test ]]; then
      BUILD=$candidate
      break
    fi
  done
fi
if [[ -n $BUILD && -x $BUILD/tools/moegraph ]]; then
  row "build" "ok" "carried $BUILD/"
else
  BUILD=${BUILD:-build-sm90}
  # CMake refuses a cache written at another root (a tree carried from the build
  # machine): configure a fresh tree instead.
  if [[ -f $BUILD/CMakeCache.txt ]] &&
    ! grep -qxF -e "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" \
      -e "CMAKE_HOME_DIRECTORY:INTERNAL=$(pwd -P)" "$BUILD/CMakeCache.txt"; then
    BUILD="build-sm90-here"
  fi
  if run_step 60 "$WORK/configure.log" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
      -DMOEGRAPH_CUDA_ARCHS=90 &&
    run_step 300 "$WORK/build.log" cmake --build "$BUILD" -j "$(nproc)" \
      --target moegraph moegraph-gates cuda_conformance_test kernels_test engine_gpu_test \
      moegraph_gpu_bench; then
    row "build" "ok" "configured and built $BUILD/ for sm_90 in $((SECONDS - START)) s"
  else
    tail -20 "$WORK/configure.log" "$WORK/build.log" 2>/dev/null
    row "build" "FAIL" "see the log above"
  fi
fi
MOEGRAPH=$BUILD/tools/moegraph

# A bundle brings its own libraries and the tests' shared data.
if [[ -d $BUILD/lib ]]; then
  LD_LIBRARY_PATH=$(cd "$BUILD/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
fi
if [[ -z ${MOEGRAPH_SHARED:-} ]]; then
  if [[ -d $BUILD/shared ]]; then
    MOEGRAPH_SHARED=$(cd "$BUILD/shared" && pwd)
  else
    MOEGRAPH_SHARED=$PWD/../shared
  fi
fi
export MOEGRAPH_SHARED
STEP=libraries
MISSING=""
for bin in "${BINARIES[@]}"; do
  if [[ -x $BUILD/$bin ]]; then
    libs=$(ldd "$BUILD/$bin" 2>&1 | awk '/not found/ { printf "%s%s", sep, $1; sep = "," }')
    if [[ -n $libs ]]; then MISSING+=" ${bin##*/}: $libs;"; fi
  fi
done
if [[ -n $MISSING ]]; then
  row "libraries" "FAIL" "not found:$MISSING (bundle them: tools/device-check.sh --bundle)"
else
  row "libraries" "ok" "every binary loads its shared libraries"
fi

# The fixture is CPU work: make it while the GPU tests run.
FIXTURE=$WORK/qwen3moe-8x64-q4k.gguf
FIXTURE_PID=""
if [[ -x $MOEGRAPH ]]; then
  timeout --kill-after=5 150 "$MOEGRAPH" make-fixture --arch qwen3moe --layers 8 --experts 64 \
    --top-k 4 --embd 1024 --ff 512 --heads 16 --vocab 4096 --quant q8_0,expert=q4_K \
    --router-skew 1 --seed 3 -o "$FIXTURE" >"$WORK/fixture.log" 2>&1 &
  FIXTURE_PID=$!
  BACKGROUND+=("$FIXTURE_PID")
fi
# The Qwen3-30B-A3B-shaped fixture: 48 layers, 128 experts, top-8, q4_K experts.
# Two expert variants per layer copied to all 128 (the bench's routing comes from
# a trace, so equal weights do not matter) make it in well under a minute.
QWEN3=$WORK/qwen3-30b-a3b-shape-q4k.gguf
QWEN3_PID=""
if [[ -x $MOEGRAPH ]]; then
  timeout --kill-after=5 240 "$MOEGRAPH" make-fixture --arch qwen3moe --layers 48 \
    --experts 128 --top-k 8 --embd 2048 --ff 768 --heads 32 --kv-heads 4 --head-dim 128 \
    --vocab 4096 --quant q8_0,expert=q4_K --expert-variants 2 -o "$QWEN3" \
    >"$WORK/qwen3-fixture.log" 2>&1 &
  QWEN3_PID=$!
  BACKGROUND+=("$QWEN3_PID")
fi

for test in cuda_conformance_test kernels_test engine_gpu_test; do
  echo "== $test"
  STEP=$test
  binary=$BUILD/tests/$test
  if [[ ! -x $binary ]]; then
    row "$test" "FAIL" "not built"
    continue
  fi
  run_step 150 "$WORK/$test.log" "$binary" --gtest_brief=1
  rc=$?
  grep -E 'FAILED|Failure|Skipped|^\S+\.cc:[0-9]+' "$WORK/$test.log" | head -40
  counts=$(gtest_counts "$WORK/$test.log")
  if ((rc == 124 || rc == 137)); then
    row "$test" "FAIL" "timed out ($counts)"
  elif ((rc != 0)); then
    row "$test" "FAIL" "exit $rc: $counts"
  elif [[ $counts == *", 0 skipped" ]]; then
    row "$test" "ok" "$counts"
  else
    row "$test" "SKIPPED" "$counts"
  fi
done

# compute-sanitizer on the engine test's every-arm run (the step's kernels,
# epilogues and copies): racecheck finds shared-memory hazards, memcheck
# out-of-bounds and misaligned accesses.
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck memcheck; do
  echo "== $tool"
  STEP=$tool
  if [[ ! -x $SANITIZER || ! -x $BUILD/tests/engine_gpu_test ]]; then
    row "$tool" "SKIPPED" "no compute-sanitizer or engine_gpu_test"
    continue
  fi
  run_step 60 "$WORK/$tool.log" "$SANITIZER" --tool "$tool" --error-exitcode 3 \
    "$BUILD/tests/engine_gpu_test" --gtest_filter=EngineArmsTest.EveryArmGivesTheSameTokensAndLogits
  rc=$?
  tail -5 "$WORK/$tool.log"
  summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$WORK/$tool.log" | tail -1)
  if ((rc == 0)); then
    row "$tool" "ok" "engine every-arm test: ${summary:-no summary line}"
  else
    row "$tool" "FAIL" "exit $rc: ${summary:-$(tail -1 "$WORK/$tool.log")}"
  fi
done

echo "== copy bench"
STEP="copy bench"
# The same bytes both ways: 8 Qwen3 q4_K expert blocks (a layer that misses all
# top-8), then 8 x 8 MiB. bytes_per_second is over CUDA-event time.
COPY_BENCH=$BUILD/tools/moegraph_gpu_bench
if [[ -x $COPY_BENCH ]]; then
  run_step 60 "$WORK/copy-bench.log" "$COPY_BENCH" --benchmark_format=csv
  rc=$?
  cat "$WORK/copy-bench.log"
  if [[ -n ${OUT:-} && -d $OUT ]]; then cp "$WORK/copy-bench.log" "$OUT/copy-bench.log"; fi
  for size in 2654208 8388608; do
    kernel=$(copy_gbps "$WORK/copy-bench.log" stage_copy_kernel "$size")
    memcpy=$(copy_gbps "$WORK/copy-bench.log" cuda_memcpy_async "$size")
    label="copy 8 x $(awk -v b="$size" 'BEGIN { printf "%.2f", b / 1048576 }') MiB"
    if ((rc == 0)) && [[ -n $kernel && -n $memcpy ]]; then
      row "$label" "ok" "stage copy kernel $kernel GB/s, cudaMemcpyAsync $memcpy GB/s"
    else
      row "$label" "FAIL" "exit $rc: kernel ${kernel:-n/a} GB/s, memcpy ${memcpy:-n/a} GB/s"
    fi
  done
else
  row "copy bench" "FAIL" "not built"
fi

echo "== gates"
STEP=gates
GATES=$BUILD/gates/moegraph-gates
if [[ -x $GATES ]]; then
  run_step 120 "$WORK/gates.log" "$GATES" --backend cuda
  rc=$?
  cat "$WORK/gates.log"
  summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$WORK/gates.log" | tail -1)
  if ((rc == 0)) && [[ -n $summary ]]; then
    row "gates" "ok" "$summary"
  else
    row "gates" "FAIL" "exit $rc: ${summary:-no summary line}"
  fi
else
  row "gates" "FAIL" "not built"
fi

echo "== fixture"
STEP=fixture
if [[ -n $FIXTURE_PID ]] && wait "$FIXTURE_PID"; then
  row "fixture" "ok" "qwen3moe 8 layers, 64 experts, top-4, embd 1024, ff 512, q4_K experts"
else
  cat "$WORK/fixture.log" 2>/dev/null
  rm -f "$FIXTURE"
  row "fixture" "FAIL" "make-fixture failed or timed out"
fi

# Decode runs: 512 experts in all; 128 slots make the policy arms miss.
readonly TOKENS=1,2,3,4,5,6,7,8
readonly N=64
declare -A ARGS=(
  [resident]="--arm resident"
  [graph]="--arm graph --slots 128"
  [graph-s4]="--arm graph --slots 128 --steps-per-launch 4"
  [graph-nopdl]="--arm graph --slots 128"
  [eager]="--arm eager --slots 128"
  [host]="--arm host --slots 128"
  [stage]="--arm stage"
)
# The arms' doors beyond --arm: graph-nopdl is the graph arm without
# programmatic dependent launch, its rate beside graph's.
declare -A ENVS=([graph-nopdl]="MOEGRAPH_PDL=0")
REFERENCE=""
for arm in resident graph graph-nopdl graph-s4 eager host stage; do
  echo "== run $arm"
  STEP="run $arm"
  log=$WORK/run-$arm.log
  if [[ ! -f $FIXTURE ]]; then
    row "run $arm" "FAIL" "no fixture"
    continue
  fi
  # shellcheck disable=SC2086  # ARGS holds several flags, ENVS variable assignments
  run_step 45 "$log" env ${ENVS[$arm]:-} "$MOEGRAPH" run --backend cuda -m "$FIXTURE" \
    --tokens "$TOKENS" -n "$N" ${ARGS[$arm]}
  rc=$?
  cat "$log"
  summary=$(grep -E '^backend cuda \(arm' "$log" | tail -1)
  generated=$(grep -E '^generated:' "$log" | tail -1)
  if ((rc != 0)) || [[ -z $summary ]]; then
    row "run $arm" "FAIL" "exit $rc: $(tail -1 "$log")"
    continue
  fi
  rate=$(sed -nE 's/.* generated \(([0-9.]+ tok\/s)\).*/\1/p' <<<"$summary")
  hit=$(sed -nE 's/.*; (hit [0-9.]+%, [0-9]+ misses).*/\1/p' <<<"$summary")
  if [[ -z $REFERENCE ]]; then
    REFERENCE=$generated
    row "run $arm" "ok" "${rate:-n/a} decode, $hit"
  elif [[ $generated == "$REFERENCE" ]]; then
    row "run $arm" "ok" "${rate:-n/a} decode, $hit, tokens equal resident's"
  else
    row "run $arm" "FAIL" "${rate:-n/a} decode, tokens differ from resident's"
  fi
done

echo "== qwen3 bench"
STEP="qwen3 bench"
# Waits for the fixture only while the budget lasts.
while [[ -n $QWEN3_PID ]] && kill -0 "$QWEN3_PID" 2>/dev/null && (($(left) > 10)); do
  sleep 1
done
if [[ -n $QWEN3_PID ]] && kill -0 "$QWEN3_PID" 2>/dev/null; then
  kill "$QWEN3_PID" 2>/dev/null
  QWEN3_OK=0
elif [[ -n $QWEN3_PID ]] && wait "$QWEN3_PID"; then
  QWEN3_OK=1
else
  QWEN3_OK=0
fi
cat "$WORK/qwen3-fixture.log" 2>/dev/null
QWEN3_LOG=$WORK/qwen3-bench.md
if ((QWEN3_OK == 0)); then
  row "qwen3 bench" "FAIL" "make-fixture failed or timed out"
elif ! run_step 30 "$WORK/qwen3-trace.log" "$MOEGRAPH" trace synth --layers 48 --experts 128 \
  --top-k 8 --reuse 0.45 --steps 256 -o "$WORK/qwen3-trace.bin"; then
  cat "$WORK/qwen3-trace.log"
  row "qwen3 bench" "FAIL" "trace synth: $(tail -1 "$WORK/qwen3-trace.log")"
else
  cat "$WORK/qwen3-trace.log"
  run_step 200 "$QWEN3_LOG" "$MOEGRAPH" bench --backend cuda -m "$QWEN3" \
    --routing-trace "$WORK/qwen3-trace.bin" --arms resident,graph,host,stage \
    --slots 1536,3072,6144 -p 0 -n 32 -r 2
  rc=$?
  cat "$QWEN3_LOG"
  if [[ -n ${OUT:-} && -d $OUT ]]; then cp "$QWEN3_LOG" "$OUT/qwen3-bench.md"; fi
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
    }' "$QWEN3_LOG")
  if ((rc != 0)); then
    row "qwen3 bench" "FAIL" "exit $rc: $(tail -1 "$QWEN3_LOG")"
  elif [[ -z $ratios ]]; then
    row "qwen3 bench" "FAIL" "no graph and host rows in the table"
  else
    row "qwen3 bench" "ok" "48L 128x top-8 q4_K, trace reuse 0.45; t/s graph/host: $ratios"
  fi
fi

echo "== qwen3 prefill"
STEP="qwen3 prefill"
# The batched prefill on the same file, the router deciding: resident (every
# expert in place) and graph at 3072 slots (half the experts; the others
# streamed through the ring), pp512 and pp2048 as llama-bench's -p.
PREFILL_LOG=$WORK/qwen3-prefill.md
if ((QWEN3_OK == 0)); then
  row "qwen3 prefill" "FAIL" "no Qwen3-shaped fixture"
else
  run_step 150 "$PREFILL_LOG" "$MOEGRAPH" bench --backend cuda -m "$QWEN3" \
    --arms resident,graph --slots 3072 -p 512,2048 -n 0 -r 2
  rc=$?
  cat "$PREFILL_LOG"
  if [[ -n ${OUT:-} && -d $OUT ]]; then cp "$PREFILL_LOG" "$OUT/qwen3-prefill.md"; fi
  # Columns as the qwen3 bench's; hit % is the share of experts read in place,
  # MiB/tok and stage GB/s the ring's.
  rates=$(awk -F'|' '
    $5 ~ /cuda/ && $9 ~ /pp/ {
      arm = $7; test = $9; ts = $10; gbs = $13
      gsub(/ /, "", arm); gsub(/ /, "", test); gsub(/ /, "", gbs); split(ts, parts, " ")
      printf "%s%s %s %s t/s (%s GB/s)", sep, arm, test, parts[1], gbs; sep = ", "
    }' "$PREFILL_LOG")
  if ((rc != 0)); then
    row "qwen3 prefill" "FAIL" "exit $rc: $(tail -1 "$PREFILL_LOG")"
  elif [[ -z $rates ]]; then
    row "qwen3 prefill" "FAIL" "no pp rows in the table"
  else
    row "qwen3 prefill" "ok" "$rates"
  fi
fi

echo "== llama.cpp"
STEP="llama.cpp"
# The peer on the same file: every layer's experts on the GPU (-ngl 99), then
# the experts of half the layers on the host (--n-cpu-moe 24: the other 24
# layers' 3072 experts on the GPU, the graph arm's middle slot count above).
LLAMA_BENCH=$BUILD/llama/llama-bench
if [[ ! -x $LLAMA_BENCH ]]; then
  row "llama.cpp" "SKIPPED" "no $LLAMA_BENCH (tools/build-llama-cuda.sh, then --bundle)"
elif ((QWEN3_OK == 0)); then
  row "llama.cpp" "FAIL" "no Qwen3-shaped fixture"
else
  for setting in "-ngl 99" "-ngl 99 --n-cpu-moe 24"; do
    log=$WORK/llama-bench.log
    # shellcheck disable=SC2086 # the setting is words
    LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} run_step 150 "$log" \
      "$LLAMA_BENCH" -m "$QWEN3" $setting -p 512,2048 -n 32 -r 2 -o md
    rc=$?
    cat "$log"
    if [[ -n ${OUT:-} && -d $OUT ]]; then cat "$log" >>"$OUT/llama-bench.md"; fi
    # llama-bench's markdown: the last column is "t/s" as "mean ± sd".
    rate=$(awk -F'|' '/tg32/ { gsub(/ /, "", $(NF - 1)); print $(NF - 1) }' "$log" | tail -1)
    pp=$(awk -F'|' '/pp512|pp2048/ {
        test = $(NF - 2); ts = $(NF - 1); gsub(/ /, "", test); gsub(/ /, "", ts)
        printf "%s%s %s", sep, test, ts; sep = ", "
      }' "$log")
    if ((rc != 0)) || [[ -z $rate ]]; then
      row "llama.cpp $setting" "FAIL" "exit $rc: $(tail -1 "$log")"
    else
      row "llama.cpp $setting" "ok" "tg32 $rate t/s, $pp t/s on the Qwen3-shaped file"
    fi
  done
fi
echo "== ncu"
STEP=ncu
# Where Nsight Compute may read the counters: shared-memory bank conflicts and
# DRAM throughput of the expert matvecs and the attention of 8 decoded tokens on
# the Qwen3-shaped file (resident: every expert in place).
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [[ ! -x $NCU ]]; then
  row "ncu" "SKIPPED" "no ncu"
elif ((QWEN3_OK == 0)); then
  row "ncu" "FAIL" "no Qwen3-shaped fixture"
else
  run_step 60 "$WORK/ncu.log" "$NCU" --csv --launch-skip 200 --launch-count 40 \
    -k regex:'grouped_matvec|attention_split' \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    "$MOEGRAPH" run -m "$QWEN3" --backend cuda --arm resident --tokens 1,2,3 -n 8
  rc=$?
  tail -3 "$WORK/ncu.log"
  if [[ -n ${OUT:-} && -d $OUT ]]; then cp "$WORK/ncu.log" "$OUT/ncu.csv"; fi
  # CSV rows: ..."Kernel Name",...,"Metric Name","Metric Unit","Metric Value".
  metrics=$(awk -F'","' '
    NF > 5 {
      kernel = ($0 ~ /attention_split/) ? "attention" : "matvec"
      metric = $(NF - 2); value = $NF; gsub(/[",]/, "", value)
      key = kernel " " (metric ~ /bank/ ? "bank conflicts" : "DRAM % of peak")
      sum[key] += value; n[key]++
    }
    END { for (k in sum) { printf "%s%s %.1f", sep, k, sum[k] / n[k]; sep = "; " } }' \
    "$WORK/ncu.log")
  if ((rc != 0)) && grep -q ERR_NVGPUCTRPERM "$WORK/ncu.log"; then
    row "ncu" "SKIPPED" "the counters are not readable here (ERR_NVGPUCTRPERM)"
  elif ((rc != 0)) || [[ -z $metrics ]]; then
    row "ncu" "FAIL" "exit $rc: $(tail -1 "$WORK/ncu.log")"
  else
    row "ncu" "ok" "mean per launch: $metrics"
  fi
fi

rm -f "$QWEN3"
STEP=finished
