#!/usr/bin/env bash
# tools/device-check.sh --dry-run on this tree's binaries, as before a device call:
# it must succeed (every binary built, every library resolved) having run
# nothing, and its plan must hold what a device run needs: the Qwen3-shaped bench
# (on Qwen3's vocabulary) and the peer before the GPU tests, the gates, the decode
# runs and the sanitizers, so that a run cut short still has the speed; Nsight
# Compute leaving the clocks alone; and no more files under $OUT than come back (8).
# Exit 77 (skipped) where the binaries are not built.
# Usage: device_check_dry_run_test.sh SOURCE_DIR BUILD_DIR
# shellcheck disable=SC2016 # '$OUT/...' is the dry run's text, not an expansion
set -euo pipefail
source_dir=$(cd "$1" && pwd)
build_dir=$(cd "$2" && pwd)
for bin in tools/moegraph tools/moegraph_gpu_bench gates/moegraph-gates \
  tests/cuda_conformance_test tests/kernels_test tests/engine_gpu_test; do
  [[ -x $build_dir/$bin ]] || { echo "skip: $build_dir/$bin is not built"; exit 77; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/out"
fail() { echo "FAIL: $*"; echo "--- the dry run's output:"; cat "$work/plan" "$work/err"; exit 1; }

cd "$source_dir"
rc=0
OUT=$work/out bash tools/device-check.sh --dry-run "$build_dir" > "$work/plan" 2> "$work/err" ||
  rc=$?
((rc == 0)) || fail "exit $rc"
[[ -z $(ls -A "$work/out") ]] || fail "the dry run wrote under \$OUT: $(ls -A "$work/out")"

# The step headers, "[N] ID (LIMIT s...) ...", in order; their line numbers.
line_of() {
  local n
  n=$(grep -nE "^\[[0-9]+\] $1 \(" "$work/plan" | head -1 | cut -d: -f1)
  [[ -n $n ]] || fail "no step '$1'"
  echo "$n"
}
first=("qwen3 bench" "qwen3 prefill" "llama\.cpp -ngl 99" "llama\.cpp -ngl 99 --n-cpu-moe 24")
then=(cuda_conformance_test kernels_test engine_gpu_test gates "run resident" "run stage"
  racecheck memcheck)
last_first=0
for id in "${first[@]}"; do
  n=$(line_of "$id")
  ((n > last_first)) || fail "'$id' is not after the step before it"
  last_first=$n
done
for id in "${then[@]}"; do
  n=$(line_of "$id")
  ((n > last_first)) || fail "'$id' runs before the speed steps (line $n, theirs end at $last_first)"
done
# The Qwen3-shaped bench reads the fixture of Qwen3's 151,936-token vocabulary.
fixture=$(($(line_of "qwen3 fixture") + 1))
sed -n "${fixture}p" "$work/plan" | grep -q -- '--vocab 151936' ||
  fail "the Qwen3-shaped fixture is not made with --vocab 151936"
((fixture < $(line_of "qwen3 bench"))) || fail "the Qwen3-shaped fixture is made after its bench"

# Nsight Compute: every command line that runs it leaves the clocks alone.
ncu_lines=$(grep -E '^    \S*ncu ' "$work/plan" || true)
[[ -n $ncu_lines ]] || fail "no ncu command line"
if grep -v -- '--clock-control none' <<< "$ncu_lines"; then
  fail "an ncu command line without --clock-control none (above)"
fi

# Files under $OUT: at most 8, each directly under it, the table and the logs' tarball among them.
grep -oE '\$OUT/[^ ]*' "$work/plan" | sort -u > "$work/out-files"
count=$(wc -l < "$work/out-files")
((count >= 2 && count <= 8)) || fail "$count files under \$OUT: $(tr '\n' ' ' < "$work/out-files")"
if grep -E '^\$OUT/.*/' "$work/out-files"; then fail "a file below a folder of \$OUT (above)"; fi
grep -qx '\$OUT/device-check.md' "$work/out-files" || fail "no \$OUT/device-check.md"
grep -qx '\$OUT/logs.tar.gz' "$work/out-files" || fail "no \$OUT/logs.tar.gz"
echo "ok: $(grep -cE '^\[[0-9]+\] ' "$work/plan") steps; under \$OUT: $(tr '\n' ' ' < "$work/out-files")"
