// llama.cpp's CPU speed on a GGUF file (node-llama-cpp's prebuilt CPU build),
// llama-bench's two tests: pp512 evaluates a 512-token prompt (ids i % 1000 + 10)
// as one batch (batch size 512, no token generated) and times it; tg64 evaluates
// the 1-token prompt [10] and generates 64 greedy tokens, timing the 64 one-token
// decodes (the first of them is the prompt token's, as llama-bench's tg times n
// decodes). Each test runs once untimed first (as `moegraph bench` does) and the
// sequence's KV cache is cleared before every run. Model loading is not timed.
// Prints one JSON line: {"pp512": t/s, "tg64": t/s, "tokens": [64 ids],
// "threads": threads llama.cpp used, "flash_attention": the context's setting}.
// Usage: node cpu-speed.mjs FILE.gguf THREADS
import {getLlama} from "node-llama-cpp";

const [, , modelPath, threadsArg] = process.argv;
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
process.stdout.write(JSON.stringify({
  pp512: promptTokens / ppTime,
  tg64: tokens.length / tgTime,
  tokens,
  threads: usedThreads,
  flash_attention: context.flashAttention,
}) + "\n");
process.exit(0);
