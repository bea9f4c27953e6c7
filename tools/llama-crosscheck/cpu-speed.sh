#!/usr/bin/env bash
# CPU speed, moegraph's CPU backend beside llama.cpp's CPU build (node-llama-cpp's
# prebuilt one) on the same synthetic fixtures, at 1 and 2 threads, llama-bench's
# tests:
#   pp512: a 512-token prompt, one batch on both (moegraph's resident arm
#          batches the prompt; llama.cpp evaluates one 512-token batch).
#   tg64:  64 greedy tokens after a 1-token prompt: 64 one-token steps, timed.
# moegraph: `moegraph bench --backend cpu --arms resident -p 512 -n 64 -r 1`;
# llama.cpp: cpu-speed.mjs. Both run each test once untimed first and leave
# model loading untimed. Repetitions interleave (moegraph, llama.cpp, moegraph,
# llama.cpp, ...; REPS of each, default 2) and the table gives their means.
# "tokens equal" compares `moegraph run --tokens 10 -n 64` with llama.cpp's 64
# greedy tokens after the same prompt, and where they part, says what llama.cpp
# makes of ours forced along them (cpu-speed.mjs): at how many positions ours
# is its argmax, and the widest gap from its best logit to ours beside the
# median gap between its own best two, and the same along its own tokens (how
# far its forced batch strays from its own decode). Both run at -t 1 and -t 2.
# Fixtures: by default Qwen3-MoE ones (q8_0 dense, q4_K experts, 32000-token
# vocabulary): small (8 layers, 32 experts top-4, embd 1024, ff 512: 305 MiB)
# and large (12 layers, 48 experts top-8, embd 2048, ff 768: about 1.7 GiB; its
# experts are byte copies of 8 per layer, so writing it quantizes 8, not 48,
# while both engines still read 48 experts' bytes at their own addresses);
# --quick runs only the small one. (--ff must be a multiple of 256, q4_K's block.)
# --gpt-oss[=LAYERS] runs one gpt-oss fixture instead: gpt-oss-20b's geometry
# (embd 2880, 32 experts top-4 of ff 2880, 64 query heads and 8 key/value heads
# of 64, a 128-position window on the even layers, the 201088-token vocabulary,
# q8_0 dense and mxfp4 experts, 8 expert variants as above) with LAYERS layers
# (default 24, gpt-oss-20b's: about 12 GiB; fewer for a small machine).
# --qwen35[=LAYERS] runs one qwen35moe fixture instead: Qwen3.5-35B-A3B's
# per-layer geometry (transformers' Qwen3_5MoeTextConfig defaults, v5.8, the
# 35B-A3B checkpoint's: embd 2048, 256 experts top-8 of ff 512 plus a shared
# one of 512, a full-attention layer every 4th with 16 query and 2 key/value
# heads of 256 and RoPE on 64 of them, the others Gated DeltaNets of 16 key
# and 32 value heads of 128 with a conv of 4, the 248320-token vocabulary;
# q8_0 dense, q4_K experts, 8 expert variants) with LAYERS layers (default 16
# of the model's 40: about 9 GiB, which leaves both engines room in 24 GiB).
# --real runs one file of a real model's size instead: Qwen3-30B-A3B's geometry
# (48 layers, 128 experts top-8 of ff 768, embd 2048, 32 query and 4 key/value
# heads of 128, the 151936-token vocabulary; q8_0 dense, q4_K experts, 8 expert
# variants): 17.2 GiB, written once into fixtures/cpu-speed/ (ignored by git)
# and reused while its flags are the same. It needs about 20 GiB of memory.
# Every table gives each engine's peak resident set (GNU time's %M) over its
# timed processes (bench, cpu-speed.mjs), beside the speeds.
# Slow: writing the fixtures takes minutes, and every test runs once untimed
# first. Needs node and npm; not part of `make test`.
# Usage: [REPS=N] tools/llama-crosscheck/cpu-speed.sh BUILD_DIR
#          [--quick | --gpt-oss[=LAYERS] | --qwen35[=LAYERS] | --real]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: [REPS=N] $0 BUILD_DIR [--quick | --gpt-oss[=LAYERS] | --qwen35[=LAYERS] | --real]"
[[ $# -ge 1 && $# -le 2 ]] || { echo "$usage" >&2; exit 2; }
moegraph="$1/tools/moegraph"
set_name=qwen3moe
case ${2:-} in
  "") ;;
  --quick) set_name=quick ;;
  --gpt-oss) set_name=gpt-oss; gpt_oss_layers=24 ;;
  --gpt-oss=*) set_name=gpt-oss; gpt_oss_layers=${2#--gpt-oss=} ;;
  --qwen35) set_name=qwen35; qwen35_layers=16 ;;
  --qwen35=*) set_name=qwen35; qwen35_layers=${2#--qwen35=} ;;
  --real) set_name=real ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
if [[ $set_name == gpt-oss && ! $gpt_oss_layers =~ ^[1-9][0-9]*$ ]]; then
  echo "--gpt-oss=$gpt_oss_layers: a positive layer count" >&2
  exit 2
fi
if [[ $set_name == qwen35 && ! $qwen35_layers =~ ^[1-9][0-9]*$ ]]; then
  echo "--qwen35=$qwen35_layers: a positive layer count" >&2
  exit 2
fi
reps=${REPS:-2}
[[ $reps =~ ^[1-9][0-9]*$ ]] || { echo "REPS=$reps: a positive count" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -d "$here/node_modules/node-llama-cpp" ]]; then
  (cd "$here" && npm install --omit=optional --no-audit --no-fund --silent)
fi

# Each fixture: NAME:make-fixture flags.
qwen3moe="--arch qwen3moe --heads 16 --kv-heads 4 --vocab 32000 --quant q8_0,expert=q4_K --seed 1"
gpt_oss="--arch gpt-oss --experts 32 --top-k 4 --embd 2880 --ff 2880 --heads 64 --kv-heads 8"
gpt_oss+=" --head-dim 64 --swa 128 --vocab 201088 --quant q8_0,expert=mxfp4 --expert-variants 8"
qwen35="--arch qwen35moe --experts 256 --top-k 8 --embd 2048 --ff 512 --heads 16 --kv-heads 2"
qwen35+=" --head-dim 256 --ssm-k-heads 16 --ssm-v-heads 32 --ssm-head-dim 128 --vocab 248320"
qwen35+=" --quant q8_0,expert=q4_K --expert-variants 8 --router-skew 1"
small="small:$qwen3moe --layers 8 --experts 32 --top-k 4 --embd 1024 --ff 512"
large="large:$qwen3moe --layers 12 --experts 48 --top-k 8 --embd 2048 --ff 768 --expert-variants 8"
case $set_name in
  quick) fixtures=("$small") ;;
  qwen3moe) fixtures=("$small" "$large") ;;
  gpt-oss) fixtures=("gpt-oss-${gpt_oss_layers}L:$gpt_oss --layers $gpt_oss_layers --seed 1") ;;
  qwen35) fixtures=("qwen35moe-${qwen35_layers}L:$qwen35 --layers $qwen35_layers --seed 1") ;;
  real) fixtures=("qwen3moe-30b-a3b:--arch qwen3moe --layers 48 --experts 128 --top-k 8 --embd 2048 \
--ff 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936 --quant q8_0,expert=q4_K \
--expert-variants 8 --router-skew 1 --seed 1") ;;
esac
# The real-size file is cached between runs; the others live in $work.
cache="$here/../../fixtures/cpu-speed"
threads_list=(1 2)
load=$(cut -d' ' -f1 /proc/loadavg)

: > "$work/fixtures.txt"
for fixture in "${fixtures[@]}"; do
  name=${fixture%%:*}
  flags=${fixture#*:}
  file="$work/$name.gguf"
  if [[ $set_name == real ]]; then
    mkdir -p "$cache"
    file="$cache/$name.gguf"
    if [[ -f $file && "$(cat "$file.flags" 2> /dev/null)" == "$flags" ]]; then
      echo "cpu-speed: reusing $file" >&2
    else
      rm -f "$file" "$file.flags"
      echo "cpu-speed: writing the $name fixture into $file (once)" >&2
      # shellcheck disable=SC2086
      "$moegraph" make-fixture $flags -o "$file.part" >&2
      mv "$file.part" "$file"
      echo "$flags" > "$file.flags"
    fi
  else
    echo "cpu-speed: writing the $name fixture" >&2
    # shellcheck disable=SC2086
    "$moegraph" make-fixture $flags -o "$file" >&2
  fi
  echo "$name $(stat -c %s "$file") $file" >> "$work/fixtures.txt"
done

# Runs moegraph with stdout to OUT and stderr to ERR, shown only when it fails.
moegraph_to() {
  local out=$1 err=$2
  shift 2
  "$moegraph" "$@" > "$out" 2> "$err" || { cat "$err" >&2; return 1; }
}

# Runs COMMAND... with its peak resident set in KiB written to FILE (GNU time).
peak_rss_to() {
  local file=$1
  shift
  /usr/bin/time -f %M -o "$file" "$@"
}

while read -r -u 3 name _ file; do
  for ((rep = 0; rep <= reps; ++rep)); do  # rep 0: the tokens (moegraph run)
    for t in "${threads_list[@]}"; do
      if [[ $rep -eq 0 ]]; then
        echo "cpu-speed: $name: moegraph run, threads $t" >&2
        moegraph_to "$work/run.out" "$work/run.err" run -m "$file" --backend cpu --tokens 10 -n 64 \
          -t "$t"
        sed -n 's/^generated: //p' "$work/run.out" > "$work/mg-$name-t$t.tokens"
        continue
      fi
      echo "cpu-speed: $name: moegraph bench, threads $t, repetition $rep/$reps" >&2
      peak_rss_to "$work/mg-$name-t$t-r$rep.rss" "$moegraph" bench -m "$file" --backend cpu \
        --arms resident -p 512 -n 64 -t "$t" -r 1 -o json > "$work/mg-$name-t$t-r$rep.json" \
        2> "$work/bench.err" || { cat "$work/bench.err" >&2; exit 1; }
      echo "cpu-speed: $name: llama.cpp, threads $t, repetition $rep/$reps" >&2
      peak_rss_to "$work/ll-$name-t$t-r$rep.rss" node "$here/cpu-speed.mjs" "$file" "$t" \
        "$work/mg-$name-t$t.tokens" > "$work/ll-$name-t$t-r$rep.json"
    done
  done
done 3< "$work/fixtures.txt"

# shellcheck disable=SC2016  # JavaScript, not shell expansions
REPS=$reps LOAD=$load THREADS="${threads_list[*]}" node -e '
  const fs = require("fs");
  const [dir, here] = process.argv.slice(1);
  const env = process.env, reps = Number(env.REPS);
  const read = (f) => JSON.parse(fs.readFileSync(`${dir}/${f}`, "utf8"));
  // The largest peak resident set (KiB, GNU time) of PREFIX-r1.rss ... -rN.rss.
  const rss = (prefix) => Math.max(...Array.from({length: reps}, (_, r) =>
      Number(fs.readFileSync(`${dir}/${prefix}-r${r + 1}.rss`, "utf8").trim().split("\n").pop())));
  const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const human = (b) => b >= 2 ** 30 ? `${(b / 2 ** 30).toFixed(2)} GiB` : `${(b / 2 ** 20).toFixed(0)} MiB`;
  const cpu = (fs.readFileSync("/proc/cpuinfo", "utf8").match(/^model name\s*:\s*(.*)$/m) || [])[1] || "unknown CPU";
  const pkg = (p) => JSON.parse(fs.readFileSync(`${here}/node_modules/node-llama-cpp/${p}`, "utf8"));
  const nlc = pkg("package.json").version, release = pkg("llama/llama.cpp.info.json").tag;
  const date = new Date().toISOString().replace("T", " ").replace(/:\d\d\.\d+Z$/, " UTC");
  console.log(`cpu-speed ${date}; CPU: ${cpu} (${require("os").cpus().length} logical CPUs, ` +
              `load average ${env.LOAD} at the start); llama.cpp: node-llama-cpp ${nlc} prebuilt CPU ` +
              `build (llama.cpp release ${release}); mean of ${reps} repetition(s)`);
  console.log("");
  console.log("| fixture | size | threads | test | moegraph t/s | llama.cpp t/s | ratio | tokens equal | " +
              "moegraph peak RSS | llama.cpp peak RSS |");
  console.log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
  const notes = new Set();
  for (const line of fs.readFileSync(`${dir}/fixtures.txt`, "utf8").trim().split("\n")) {
    const [name, bytes] = line.split(" ");
    for (const t of env.THREADS.split(" ").map(Number)) {
      const ll = Array.from({length: reps}, (_, r) => read(`ll-${name}-t${t}-r${r + 1}.json`));
      const mg = Array.from({length: reps}, (_, r) => read(`mg-${name}-t${t}-r${r + 1}.json`));
      for (const x of ll) {
        if (x.threads !== t) notes.add(`llama.cpp ran ${x.threads} threads where ${t} were asked`);
      }
      const ours = fs.readFileSync(`${dir}/mg-${name}-t${t}.tokens`, "utf8").trim();
      const theirs = ll.map((x) => x.tokens.join(" "));
      let equal = "yes";
      if (ours !== theirs[0]) {  // where they part, counting generated tokens from 1
        const a = ours.split(" "), b = theirs[0].split(" ");
        let i = 0;
        while (i < a.length && i < b.length && a[i] === b[i]) ++i;
        equal = `NO (from token ${i + 1} of ${b.length}`;
        const f = ll[0].forced;
        if (f) {
          equal += `; llama.cpp forced along ours: ours its argmax at ${f.argmax} of ` +
                   `${f.positions}, at most ${f.widest_gap.toPrecision(2)} below its best logit, ` +
                   `its best two ${f.median_top2_gap.toPrecision(2)} apart (median)`;
          const g = ll[0].forced_self;
          equal += `; along its own: its argmax at ${g.argmax} of ${g.positions}, at most ` +
                   `${g.widest_gap.toPrecision(2)} below`;
        }
        equal += ")";
      }
      if (theirs.some((s) => s !== theirs[0])) equal += " (llama.cpp varied between repetitions)";
      const memory = `${human(rss(`mg-${name}-t${t}`) * 1024)} | ${human(rss(`ll-${name}-t${t}`) * 1024)}`;
      for (const test of ["pp512", "tg64"]) {
        const m = mean(mg.map((rows) => rows.find((row) => row.test === test && row.arm === "resident").avg_ts));
        const l = mean(ll.map((x) => x[test]));
        console.log(`| ${name} | ${human(Number(bytes))} | ${t} | ${test} | ${m.toFixed(2)} | ` +
                    `${l.toFixed(2)} | ${(m / l).toFixed(2)} | ${equal} | ${memory} |`);
      }
    }
  }
  console.log("");
  for (const n of notes) console.log(`note: ${n}`);
' "$work" "$here"
