// Teacher-forced next-token probabilities from llama.cpp's CPU backend
// (node-llama-cpp's prebuilt binary): the tokens go in one at a time in one
// sequence, and after each the softmax of llama.cpp's raw logits is taken.
// Usage: node teacher-forced.mjs FILE.gguf 1,2,3,... TOP -> JSON: per position,
// the TOP most probable tokens as [id, probability] pairs, best first.
import {getLlama} from "node-llama-cpp";

const [, , modelPath, tokenList, top] = process.argv;
const tokens = tokenList.split(",").map(Number);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: tokens.length + 8, threads: 1});
const sequence = context.getSequence();
const out = await sequence.controlledEvaluate(
    tokens.map((token) => [token, {generateNext: {logits: true}}]));
const positions = [];
for (let i = 0; i < tokens.length; ++i) {
  const logits = [...out[i].next.logits.entries()];
  const max = Math.max(...logits.map(([, l]) => l));
  const total = logits.reduce((sum, [, l]) => sum + Math.exp(l - max), 0);
  const probs = logits.map(([id, l]) => [id, Math.exp(l - max) / total]);
  probs.sort((a, b) => b[1] - a[1] || a[0] - b[0]);
  positions.push(probs.slice(0, Number(top)).map(([id, p]) => [id, Number(p.toPrecision(6))]));
}
console.log(JSON.stringify(positions));
process.exit(0);
