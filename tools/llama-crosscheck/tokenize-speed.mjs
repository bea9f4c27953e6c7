// llama.cpp's tokenizer speed (node-llama-cpp's prebuilt CPU build) on the text
// tools/bench/bench_text.cc times: the corpus joined by newlines, repeated while the
// whole stays within 1 MiB, special parsing on. Prints one JSON line: the
// text's bytes, the ids, and the seconds of each of REPS runs.
// Usage: node tokenize-speed.mjs FILE.gguf corpus.json [REPS]
import {getLlama} from "node-llama-cpp";
import {readFileSync} from "node:fs";

const [, , modelPath, corpusPath, reps = "5"] = process.argv;
const corpus = JSON.parse(readFileSync(corpusPath, "utf8"));
const joined = corpus.join("\n") + "\n";
const joinedBytes = Buffer.byteLength(joined, "utf8");
let text = "";
let bytes = 0;
while (bytes + joinedBytes <= 1 << 20) {
  text += joined;
  bytes += joinedBytes;
}
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const seconds = [];
let ids = 0;
model.tokenize(text, true);  // warm-up
for (let i = 0; i < Number(reps); ++i) {
  const start = process.hrtime.bigint();
  ids = model.tokenize(text, true).length;
  seconds.push(Number(process.hrtime.bigint() - start) / 1e9);
}
process.stdout.write(JSON.stringify({bytes, ids, seconds}) + "\n");
process.exit(0);
