// llama.cpp's greedy decode of several text prompts with one model load
// (node-llama-cpp's prebuilt CPU build), each as greedy-text.mjs decodes one:
// the prompt tokenized with specials parsed (BOS first where the vocabulary
// adds it), N tokens generated from an empty sequence.
// Usage: node greedy-prompts.mjs FILE.gguf N PROMPTS.json -> JSON lines
//   {"prompt", "prompt_ids", "generated"}, one a prompt, in order.
import {readFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [, , modelPath, count, promptsPath] = process.argv;
const prompts = JSON.parse(readFileSync(promptsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
// One thread, as perplexity.mjs and kld.mjs: ggml's spinning workers crawl when
// another process shares the cores.
const context = await model.createContext({contextSize: 512, threads: 1});
const sequence = context.getSequence();
const bos = model.tokens.shouldPrependBosToken ? [model.tokens.bos] : [];
for (const prompt of prompts) {
  await sequence.clearHistory();
  const promptIds = [...bos, ...model.tokenize(prompt, true)];
  const generated = [];
  for await (const token of sequence.evaluate(promptIds, {temperature: 0})) {
    generated.push(token);
    if (generated.length >= Number(count)) break;
  }
  process.stdout.write(JSON.stringify({prompt, prompt_ids: promptIds, generated}) + "\n");
}
process.exit(0);
