// llama.cpp's greedy decode of a text prompt (node-llama-cpp's prebuilt CPU
// build): the prompt tokenized as llama_tokenize(add_special, parse_special)
// does it (BOS first where the vocabulary adds it), N tokens generated whatever
// they are (EOS included), and their text as llama.cpp detokenizes it after
// the prompt (control tokens hidden), which is what llama-cli prints.
// Usage: node greedy-text.mjs FILE.gguf PROMPT N -> JSON
import {getLlama} from "node-llama-cpp";

const [, , modelPath, prompt, count] = process.argv;
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 512});
const sequence = context.getSequence();
const bos = model.tokens.shouldPrependBosToken ? [model.tokens.bos] : [];
const promptIds = [...bos, ...model.tokenize(prompt, true)];
const generated = [];
for await (const token of sequence.evaluate(promptIds, {temperature: 0})) {
  generated.push(token);
  if (generated.length >= Number(count)) break;
}
process.stdout.write(JSON.stringify({
  prompt,
  prompt_ids: promptIds,
  generated,
  text: model.detokenize(generated, false, promptIds),
}) + "\n");
process.exit(0);
