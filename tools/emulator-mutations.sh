#!/usr/bin/env bash
# The emulator's mutation proof (docs/EMULATOR.md, "Mutations"): each mutation
# breaks the CUDA code in a way a GPU may well not show, and the emulated test
# named for it must then FAIL.
#
# For speed the script does not rebuild a tree: it recompiles the one mutated
# file with the command the emulated tree recorded (compile_commands.json),
# swaps the object into a copy of its static library, and relinks the one test
# binary with that copy. The working tree is never touched. Each named test is
# first run unmutated, and must pass.
#
# Usage: tools/emulator-mutations.sh [EMULATED_BUILD_DIR]   (default: build-emu, built)
# Exit status 1 when a mutation survives (its test passed) or a step fails.
set -euo pipefail
shopt -s extglob

root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-emu}" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/moegraph-mutants.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export MOEGRAPH_EMU_SEED=${MOEGRAPH_EMU_SEED:-1}

commands="$build/compile_commands.json"
[[ -f "$commands" ]] || { echo "emulator-mutations: $commands is missing: build the emulated tree first (make test-emulated)" >&2; exit 1; }

# The compile command of a source file, from compile_commands.json.
compile_command() {
  awk -v file="\"file\": \"$1\"" '
    /"command":/ { command = $0 }
    index($0, file) { sub(/^ *"command": "/, "", command); sub(/",$/, "", command); print command; exit }
  ' "$commands"
}

# run_test BINARY FILTER LOG: the test's exit status, its output in LOG.
run_test() {
  local status=0
  (cd "$build/tests" && "$1" --gtest_filter="$2") > "$3" 2>&1 || status=$?
  return $status
}

# mutate NAME SOURCE LIBRARY TEST FILTER PERL_SEARCH PERL_REPLACE
#   SOURCE: the file, relative to the tree; LIBRARY: its static library,
#   relative to the build; TEST: the test binary, relative to the build's tests/.
survivors=0
mutate() {
  local name=$1 source=$2 library=$3 test=$4 filter=$5 search=$6 replace=$7
  local dir="$scratch/$name" log="$scratch/$name.log"
  mkdir -p "$dir"
  echo "== $name: $source; $test --gtest_filter=$filter"

  if ! run_test "./$test" "$filter" "$log"; then
    echo "emulator-mutations: $filter fails unmutated:" >&2
    tail -20 "$log" >&2
    exit 1
  fi

  local mutant="$dir/$(basename "$source")"
  SEARCH="$search" REPLACE="$replace" perl -0777 -pe '
    $n = () = /$ENV{SEARCH}/g;
    die "the mutation matches $n places (the code changed: update tools/emulator-mutations.sh)\n" if $n != 1;
    s/$ENV{SEARCH}/$ENV{REPLACE}/ee;
  ' "$root/$source" > "$mutant"
  if cmp -s "$root/$source" "$mutant"; then
    echo "emulator-mutations: $name changed nothing" >&2
    exit 1
  fi

  local command object
  command=$(compile_command "$root/$source")
  [[ -n "$command" ]] || { echo "emulator-mutations: no compile command for $source" >&2; exit 1; }
  object="$dir/$(basename "$source").o"
  command=${command/" -o "+([^ ])" -c $root/$source"/" -o $object -c $mutant"}
  if ! (cd "$build/$(dirname "$library")" && eval "$command") > "$dir/compile.log" 2>&1; then
    echo "emulator-mutations: the $name mutant does not compile:" >&2
    cat "$dir/compile.log" >&2
    exit 1
  fi

  local archive="$dir/$(basename "$library")"
  cp "$build/$library" "$archive"
  ar r "$archive" "$object" 2> /dev/null

  local test_dir="$build/tests" link
  link=$(< "$test_dir/CMakeFiles/$test.dir/link.txt")
  link=${link/" -o $test "/" -o $dir/$test "}
  link=${link//" ../$library "/" $archive "}
  (cd "$test_dir" && eval "$link")

  if run_test "$dir/$test" "$filter" "$log"; then
    echo "SURVIVED $name: $filter passed with the mutation"
    survivors=$((survivors + 1))
  else
    echo "caught $name: $filter failed:"
    grep -m 3 -E "moegraph-emu:|emulator: a kernel called|ERROR: AddressSanitizer|runtime error|Failure$|Which is|cudaError" "$log" |
      cut -c1-200 | sed 's/^/    /'
  fi
}

# 1. The main stream no longer waits for the copy stream's join event: the
#    split passes' graph capture has an unjoined fork.
mutate join-wait-removed capture/engine_walk.cc capture/libmg_capture.a engine_gpu_test \
  'EngineArmsTest.SplitExpertPassesGiveTheSameBits' \
  'return cudaStreamWaitEvent\(ms, join_events\[static_cast<size_t>\(l\)\], 0\);' \
  '"return cudaSuccess;"'

# 2. One __syncthreads removed from the residency step kernel: threads read
#    thread 0's demotion decision before it is written.
mutate syncthreads-removed kernels/moe.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.ResidencyStepEqualsHostStepBitForBit' \
  '(\+\+outcome\.n_hits;\n    \}\n)    __syncthreads\(\);\n' \
  '$1'

# 3. A stream synchronize inside the captured walk: capture refuses it.
mutate sync-in-capture capture/engine_walk.cc capture/libmg_capture.a engine_gpu_test \
  'EngineArmsTest.EveryArmGivesTheSameTokensAndLogits' \
  '(case StepOp::kQkv: \{\n      const QkvRope rope = Rope\(l, pos, q_rope\);\n      return \[=, this\] \{\n)' \
  '$1 . "        if (const cudaError_t e = cudaStreamSynchronize(ms); e != cudaSuccess) return e;\n"'

# 4. The matvec kernel's bounds check removed: the last block's spare groups
#    read rows past the end of the weights.
mutate bounds-check-removed kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.MatvecMatchesReferenceForEveryType' \
  'const bool live = row < a\.rows;' \
  '"const bool live = true;"'

# 5. The residual projection's epilogue one ticket early: the norm runs in the
#    next-to-last block to finish, before the last one has added its rows.
mutate epilogue-one-block-early kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.MatvecResidualAddsIntoTheResidualThenRunsTheNorm' \
  'last_block_done\(a\.tickets, place\.blocks_x \* place\.ranks, shared\)' \
  '"last_block_done(a.tickets, place.blocks_x * place.ranks - 1, shared)"'

# 6. A block's top-k candidates without its boundary key: a token top-k keeps
#    is missing from the sampler's candidates.
mutate sample-candidates-drop-the-boundary kernels/tokens.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.SamplingWithTiesNansAndInfinitiesEqualsTheHostDecision' \
  'sample_order_key\(v\[i\]\) >= lo;' \
  '"sample_order_key(v[i]) > lo;"'

# 7. A windowed head's merge waits for the splits before its window too: they
#    never run, so its ticket never reaches the count and the head is never
#    merged (nor its ticket reset).
mutate window-merge-miscounted kernels/dense.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.AttentionMatchesReferenceAtEveryLength' \
  'const int32_t live = keys\.end_split\(\) - keys\.first_split\(\);' \
  '"const int32_t live = keys.end_split();"'

# 8. The stage copy never marks a rank copied: the one expert pass's missed
#    ranks find their flags still staging (the emulator's __trap).
mutate copy-never-marked kernels/moe.cu kernels/libmg_kernels.a engine_gpu_test \
  'EngineArmsTest.EveryArmGivesTheSameTokensAndLogits' \
  'mark_rank_copied\(missed \+ r\);' \
  '""'

# 9. A chain's first-launch blocks never count themselves done: the router's
#    blocks find the residual's count short (the emulator's __trap).
mutate chain-never-counted kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.TheResidualChainedToTheRouterGivesTheTwoLaunchesBits' \
  'if \(threadIdx\.x == 0\) atomicAdd\(a\.ready \+ place\.r, 1u\);' \
  '""'

# 10. A chain's blocks by launch index instead of the order they start: a down
#     block run before its rank's gate/up blocks reads act they have not written.
mutate chain-launch-order kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.ExpertPassesAndCombineMatchReferenceWhateverThePassSplit' \
  'logical = take_block_index\(a\.order, first_total \+ second_total\);' \
  '"logical = blockIdx.x;"'

# 11. The router chained to attn_out reads the residual without its norm's
#     scale: its logits are not the two launches' (the router's own norm,
#     MatvecArgs::input_norm).
mutate router-norm-unscaled kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.TheResidualChainedToTheRouterGivesTheTwoLaunchesBits' \
  'block_rms_scale\(a\.x, a\.cols, norm\.eps, &shared->epilogue\)\}' \
  '"1.0f}"'

# 12. The projections' launch writes the layer's attn_norm without its scale:
#     q, k, v and the norm's output are not a single-block norm's and then the
#     launch's (NormPrologue, launch_qkv's input_norm).
mutate qkv-norm-unscaled kernels/matvec.cu kernels/libmg_kernels.a kernels_test \
  'KernelsGpuTest.TheProjectionsLaunchNormalizesItsInputFirst' \
  'block_rms_scale\(in\.residual, cols, in\.norm\.eps, &shared->epilogue\)\}' \
  '"1.0f}"'

if (( survivors > 0 )); then
  echo "emulator-mutations: $survivors mutation(s) survived" >&2
  exit 1
fi
echo "emulator-mutations: all 12 mutations caught"
