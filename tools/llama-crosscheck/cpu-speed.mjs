// llama.cpp's CPU speed on a GGUF file (node-llama-cpp's prebuilt CPU build),
// llama-bench's two tests: pp512 evaluates a 512-token prompt (ids i % 1000 + 10)
// as one batch (batch size 512, no token generated) and times it; tg64 evaluates
// the 1-token prompt [10] and generates 64 greedy tokens, timing the 64 one-token
// decodes (the first of them is the prompt token's, as llama-bench's tg times n
// decodes). Each test runs once untimed first (as `moegraph bench` does) and the
// sequence's KV cache is cleared before every run. Model loading is not timed.
// Given moegraph's 64 greedy tokens (a file of ids), llama.cpp then runs forced
// along them (the prompt [10], then each of ours in turn, one batch) and keeps
// its logits after each: where ours is its argmax, and how far below its best
// logit ours is elsewhere, which tells a near-tie (random weights have many)
// from a wrong token; the same along llama.cpp's own greedy tokens is the
// control: how far its forced batch strays from its own decode.
// Prints one JSON line: {"pp512": t/s, "tg64": t/s, "tokens": [64 ids],
// "threads": threads llama.cpp used, "flash_attention": the context's setting,
// "forced": {"positions", "argmax": positions where ours is llama.cpp's argmax,
// "widest_gap": the largest best-minus-ours logit gap, "median_top2_gap": the
// median gap between llama.cpp's own best two logits, for scale} or null,
// "forced_self": the same along llama.cpp's own tokens}.
// Usage: node cpu-speed.mjs FILE.gguf THREADS [OUR_TOKENS_FILE]
import {readFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [, , modelPath, threadsArg, oursPath] = process.argv;
const threads = Number(threadsArg);
if (!modelPath || !Number.isInteger(threads) || threads < 1) {
  console.error("usage: node cpu-speed.mjs FILE.gguf THREADS");
  process.exit(2);
}
const promptTokens = 512;
const generateTokens = 64;

// maxThreads 0: no library-wide cap, so the context's `threads` is what runs
// (otherwise node-llama-cpp treats it as a hint it may lower).
const llama = await getLlama({gpu: false, build: "never", logLevel: "error", maxThreads: 0});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({
  contextSize: 1024,
  batchSize: 512,
  threads: {ideal: threads, min: threads},
});
const sequence = context.getSequence();
const prompt = Array.from({length: promptTokens}, (_, i) => (i % 1000) + 10);

const seconds = (start) => Number(process.hrtime.bigint() - start) / 1e9;

async function pp() {
  await sequence.clearHistory();
  const start = process.hrtime.bigint();
  await sequence.evaluateWithoutGeneratingNewTokens(prompt);
  return seconds(start);
}

async function tg() {
  await sequence.clearHistory();
  const tokens = [];
  const start = process.hrtime.bigint();
  for await (const token of sequence.evaluate([10], {temperature: 0})) {
    tokens.push(token);
    if (tokens.length >= generateTokens) break;
  }
  return {time: seconds(start), tokens};
}

await pp();  // warm-up
const ppTime = await pp();
const usedThreads = context.currentThreads;
await tg();  // warm-up
const {time: tgTime, tokens} = await tg();

async function forcedAlong(ours) {
  await sequence.clearHistory();
  const out = await sequence.controlledEvaluate(
      [10, ...ours.slice(0, -1)].map((token) => [token, {generateNext: {logits: true}}]));
  let argmax = 0, widest = 0;
  const top2 = [];
  ours.forEach((token, i) => {
    const logits = out[i].next.logits;
    let best = -Infinity, second = -Infinity;
    for (const l of logits.values()) {
      if (l > best) [best, second] = [l, best];
      else if (l > second) second = l;
    }
    const gap = best - logits.get(token);  // NaN where ours is not in the vocabulary
    if (gap === 0) ++argmax;
    widest = Math.max(widest, gap);
    top2.push(best - second);
  });
  top2.sort((a, b) => a - b);
  return {positions: ours.length, argmax, widest_gap: widest, median_top2_gap: top2[top2.length >> 1]};
}
const forced =
    oursPath ? await forcedAlong(readFileSync(oursPath, "utf8").trim().split(/\s+/).map(Number)) : null;
const forcedSelf = await forcedAlong(tokens);
process.stdout.write(JSON.stringify({
  pp512: promptTokens / ppTime,
  tg64: tokens.length / tgTime,
  tokens,
  threads: usedThreads,
  flash_attention: context.flashAttention,
  forced,
  forced_self: forcedSelf,
}) + "\n");
process.exit(0);
