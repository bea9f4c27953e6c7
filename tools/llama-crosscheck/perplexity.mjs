// llama.cpp's perplexity of a text (node-llama-cpp's prebuilt CPU build), as
// llama-perplexity computes it (tools/perplexity/perplexity.cpp, perplexity()):
// the text tokenized with add_special (BOS first where the vocabulary adds it,
// and each chunk's first token replaced by BOS then), chunks of N_CTX tokens
// from an empty sequence, positions N_CTX/2 .. N_CTX-2 each scored by its
// logits' -log p of the next token (the max in float, the sum in double), the
// perplexity exp(mean) and its error exp(mean) x the standard error. node-llama-cpp
// has no llama-perplexity binary; this is the same sum over llama.cpp's logits.
// Usage: node perplexity.mjs FILE.gguf TEXT_FILE N_CTX [CHUNKS] -> JSON
import {readFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [, , modelPath, textPath, ctxArg, chunksArg] = process.argv;
const nCtx = Number(ctxArg);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: nCtx, batchSize: nCtx, threads: 1});
const sequence = context.getSequence();
const bos = model.tokens.shouldPrependBosToken ? [model.tokens.bos] : [];
const tokens = [...bos, ...model.tokenize(readFileSync(textPath, "utf8"), false)];
const available = Math.floor(tokens.length / nCtx);
if (available < 2) {
  console.error(`${textPath}: ${tokens.length} tokens, fewer than 2 x ${nCtx}`);
  process.exit(1);
}
const nChunk = chunksArg === undefined ? available : Math.min(available, Number(chunksArg));
const first = Math.floor(nCtx / 2);
let nll = 0, nll2 = 0, count = 0;
const perChunk = [];
for (let c = 0; c < nChunk; ++c) {
  const chunk = tokens.slice(c * nCtx, (c + 1) * nCtx);
  if (bos.length) chunk[0] = bos[0];
  await sequence.clearHistory();
  const out = await sequence.controlledEvaluate(chunk.map((token, j) =>
      j >= first && j < nCtx - 1 ? [token, {generateNext: {logits: true}}] : token));
  for (let j = first; j < nCtx - 1; ++j) {
    const logits = out[j].next.logits;  // Map id -> logit (float32 from llama.cpp)
    let max = -Infinity;
    for (const l of logits.values()) max = Math.max(max, l);
    let sum = 0;
    for (const l of logits.values()) sum += Math.fround(Math.exp(Math.fround(l - max)));
    const v = -(logits.get(tokens[c * nCtx + j + 1]) - max - Math.log(sum));
    nll += v;
    nll2 += v * v;
    ++count;
  }
  perChunk.push(Math.exp(nll / count));
}
const mean = nll / count, variance = nll2 / count - mean * mean;
console.log(JSON.stringify({
  n_ctx: nCtx, chunks: nChunk, scored: count, ppl: Math.exp(mean),
  error: variance > 0 ? Math.sqrt(variance / (count - 1)) * Math.exp(mean) : 0,
  per_chunk: perChunk,
}));
process.exit(0);
