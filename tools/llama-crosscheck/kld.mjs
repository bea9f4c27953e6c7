// llama.cpp's KL divergence of a model Q from a base model over a text
// (node-llama-cpp's prebuilt CPU build), as llama-perplexity --kl-divergence
// measures it (tools/perplexity/perplexity.cpp, kl_divergence()): chunks of
// N_CTX tokens from an empty sequence, positions N_CTX/2 .. N_CTX-2, at each
// sum_i p_base(i) (log p_base(i) - log p_Q(i)) over the tokens whose base
// log-probability is above -16 (llama.cpp's test on its base file); the mean and
// "same top p" (the share of positions where both argmaxes agree). The base's
// log-probabilities are exact here, llama.cpp's base file rounds them to 16 bits.
// Usage: node kld.mjs BASE.gguf Q.gguf TEXT_FILE N_CTX CHUNKS -> JSON
import {readFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [, , basePath, qPath, textPath, ctxArg, chunksArg] = process.argv;
const nCtx = Number(ctxArg), nChunk = Number(chunksArg), first = Math.floor(nCtx / 2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});

async function logProbs(modelPath, tokens) {
  const model = await llama.loadModel({modelPath});
  const context = await model.createContext({contextSize: nCtx, batchSize: nCtx, threads: 1});
  const sequence = context.getSequence();
  const rows = [];
  for (let c = 0; c < nChunk; ++c) {
    await sequence.clearHistory();
    const chunk = tokens.slice(c * nCtx, (c + 1) * nCtx);
    const out = await sequence.controlledEvaluate(chunk.map((token, j) =>
        j >= first && j < nCtx - 1 ? [token, {generateNext: {logits: true}}] : token));
    for (let j = first; j < nCtx - 1; ++j) {
      const logits = [...out[j].next.logits.entries()].sort((a, b) => a[0] - b[0]).map(([, l]) => l);
      const max = Math.max(...logits);
      let sum = 0;
      for (const l of logits) sum += Math.exp(l - max);
      const norm = max + Math.log(sum);
      rows.push(Float64Array.from(logits, (l) => l - norm));
    }
  }
  await context.dispose();
  await model.dispose();
  return rows;
}

const baseModel = await llama.loadModel({modelPath: basePath});
const tokens = baseModel.tokenize(readFileSync(textPath, "utf8"), false);
await baseModel.dispose();
if (tokens.length < nChunk * nCtx) {
  console.error(`${textPath}: ${tokens.length} tokens, fewer than ${nChunk} x ${nCtx}`);
  process.exit(1);
}
const base = await logProbs(basePath, tokens);
const q = await logProbs(qPath, tokens);
let sum = 0, same = 0;
const argmax = (row) => row.reduce((best, v, i) => (v > row[best] ? i : best), 0);
for (let p = 0; p < base.length; ++p) {
  const b = base[p], r = q[p];
  let kld = 0;
  for (let i = 0; i < b.length; ++i) {
    if (b[i] > -16) kld += Math.exp(b[i]) * (b[i] - r[i]);
  }
  sum += kld;
  same += argmax(b) === argmax(r) ? 1 : 0;
}
console.log(JSON.stringify({n_ctx: nCtx, chunks: nChunk, positions: base.length,
                            mean_kld: sum / base.length, same_top: same / base.length}));
process.exit(0);
