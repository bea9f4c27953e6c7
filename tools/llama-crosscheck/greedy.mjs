// Greedy decode of a GGUF file with llama.cpp's CPU backend (node-llama-cpp's
// prebuilt binary). Usage: node greedy.mjs FILE.gguf 1,2,3 N -> "id id id ..."
import {getLlama} from "node-llama-cpp";

const [, , modelPath, prompt, count] = process.argv;
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 256});
const sequence = context.getSequence();
const generated = [];
for await (const token of sequence.evaluate(prompt.split(",").map(Number), {temperature: 0, yieldEogToken: true})) {
  generated.push(token);
  if (generated.length >= Number(count)) break;
}
console.log(generated.join(" "));
process.exit(0);
