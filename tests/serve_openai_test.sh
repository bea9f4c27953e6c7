#!/usr/bin/env bash
# `moegraph serve` with the official openai npm client (tools/openai-client,
# installed by make deps): chat and completions, whole and streamed, sampled with
# a seed, each text equal to `moegraph run`'s for the same prompt and sampling
# flags and each usage equal to `moegraph tokenize`'s counts; logprobs of a
# 100 KB prompt's completion (its prompt_tokens tokenize's) and of a greedy chat
# (each token the likeliest of its alternatives). Skips (77) without
# node, the client package or Qwen3's vocabulary (tools/fetch-vocab.sh).
# Usage: serve_openai_test.sh MOEGRAPH_BIN SOURCE_DIR
set -euo pipefail
bin=$1
src=$2
client=$src/tools/openai-client
vocab=${MOEGRAPH_VOCAB:-$src/vocab}/qwen3/tokenizer.json
command -v node >/dev/null || { echo "SKIP: node is not installed"; exit 77; }
[[ -d $client/node_modules/openai ]] || { echo "SKIP: $client/node_modules/openai is missing (make deps)"; exit 77; }
[[ -f $vocab ]] || { echo "SKIP: $vocab is missing (tools/fetch-vocab.sh)"; exit 77; }

work=$(mktemp -d)
server=0
cleanup() {
  [[ $server -ne 0 ]] && kill -9 "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" make-fixture --arch qwen3moe --layers 2 --experts 4 --top-k 2 --embd 64 --ff 32 --quant f32 \
  --tokenizer-json "$vocab" -o "$work/m.gguf" > /dev/null
# The log exists before the server starts, so the first poll cannot find it
# missing (sed's error would end the script under set -e).
: > "$work/serve.err"
"$bin" serve -m "$work/m.gguf" --backend cpu --port 0 --api-key test-key --ctx 32768 \
  2> "$work/serve.err" &
server=$!
for _ in $(seq 600); do
  port=$(sed -n 's|.*listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$work/serve.err")
  [[ -n $port ]] && break
  sleep 0.1
done
[[ -n $port ]] || { cat "$work/serve.err"; echo "FAIL: the server did not start"; exit 1; }

# About 100 KB of prompt (some 21,000 tokens).
for _ in $(seq 1800); do printf 'A mixture of experts routes each token to a few experts. '; done \
  > "$work/long.txt"
node "$client/check.mjs" "http://127.0.0.1:$port/v1" test-key "$work/long.txt" > "$work/cases.jsonl"
long_tokens=$("$bin" tokenize -m "$work/m.gguf" -p "$(cat "$work/long.txt")" --ids | node -e \
  'console.log(JSON.parse(require("fs").readFileSync(0, "utf8")).length)')

# The same prompts through `moegraph run` (chat: the chatml text the server renders).
sampling=(--temp 0.8 --top-p 0.95 --seed 5 -n 12 --backend cpu)
chat_prompt=$'<|im_start|>user\nWhat is a mixture of experts?<|im_end|>\n<|im_start|>assistant\n'
"$bin" run -m "$work/m.gguf" -p "$chat_prompt" "${sampling[@]}" > "$work/chat.txt" 2> /dev/null
"$bin" run -m "$work/m.gguf" -p "The capital of France is" "${sampling[@]}" > "$work/completion.txt" 2> /dev/null
chat_tokens=$("$bin" tokenize -m "$work/m.gguf" -p "$chat_prompt" --ids | node -e \
  'console.log(JSON.parse(require("fs").readFileSync(0, "utf8")).length)')
completion_tokens=$("$bin" tokenize -m "$work/m.gguf" -p "The capital of France is" --ids | node -e \
  'console.log(JSON.parse(require("fs").readFileSync(0, "utf8")).length)')

kill -TERM "$server"
wait "$server" && status=0 || status=$?
server=0
[[ $status -eq 0 ]] || { cat "$work/serve.err"; echo "FAIL: serve exited $status after SIGTERM"; exit 1; }

CASES=$work/cases.jsonl CHAT=$work/chat.txt COMPLETION=$work/completion.txt \
CHAT_TOKENS=$chat_tokens COMPLETION_TOKENS=$completion_tokens LONG_TOKENS=$long_tokens node -e '
  const fs = require("fs"), env = process.env;
  // run prints raw bytes and a newline; JSON carries a cut-off character as U+FFFD
  const runText = (f) => new TextDecoder().decode(fs.readFileSync(f)).replace(/\n$/, "");
  const want = { chat: runText(env.CHAT), completion: runText(env.COMPLETION) };
  const prompt = { chat: Number(env.CHAT_TOKENS), completion: Number(env.COMPLETION_TOKENS) };
  let failed = 0;
  const check = (ok, what) => { console.log(`${ok ? "ok  " : "FAIL"} ${what}`); if (!ok) ++failed; };
  for (const line of fs.readFileSync(env.CASES, "utf8").trim().split("\n")) {
    const c = JSON.parse(line);
    if (c.name === "models") { check(c.text === "m.gguf", `models: ${c.text}`); continue; }
    if (c.name === "error") { check(c.text === "400 messages", `empty messages: ${c.text}`); continue; }
    if (c.name === "logprobs-long") {
      const lp = c.logprobs, n = c.usage.completion_tokens;
      check(c.usage.prompt_tokens === Number(env.LONG_TOKENS),
            `${c.name}: prompt_tokens ${c.usage.prompt_tokens} = tokenize ${env.LONG_TOKENS}`);
      check(lp && lp.tokens.length === n && lp.token_logprobs.length === n && n >= 1,
            `${c.name}: ${n} tokens, ${lp && lp.token_logprobs.length} token_logprobs`);
      check(lp && lp.token_logprobs.every((v, i) => v <= 0 && v <= Math.max(...Object.values(lp.top_logprobs[i]))),
            `${c.name}: token_logprobs ${JSON.stringify(lp && lp.token_logprobs)} at most the likeliest`);
      continue;
    }
    if (c.name === "logprobs-chat") {
      const content = c.logprobs && c.logprobs.content;
      check(content && content.length === c.usage.completion_tokens,
            `${c.name}: ${content && content.length} logprobs for ${c.usage.completion_tokens} tokens`);
      check(content && content.every((t) => t.top_logprobs.length === 2 &&
                                            t.logprob === t.top_logprobs[0].logprob &&
                                            t.token === t.top_logprobs[0].token),
            `${c.name}: greedy: each token the likeliest of its two`);
      continue;
    }
    const kind = c.name.startsWith("chat") ? "chat" : "completion";
    check(c.text === want[kind], `${c.name}: text ${JSON.stringify(c.text)} = run ${JSON.stringify(want[kind])}`);
    check(c.usage && c.usage.prompt_tokens === prompt[kind],
          `${c.name}: prompt_tokens ${c.usage && c.usage.prompt_tokens} = tokenize ${prompt[kind]}`);
    check(c.usage && c.usage.completion_tokens >= 1 && c.usage.completion_tokens <= 12,
          `${c.name}: completion_tokens ${c.usage && c.usage.completion_tokens} in [1, 12]`);
    check(c.finish_reason === "stop" || c.finish_reason === "length", `${c.name}: finish_reason ${c.finish_reason}`);
  }
  process.exit(failed ? 1 : 0);'
