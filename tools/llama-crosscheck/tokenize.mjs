// Token ids from llama.cpp itself (node-llama-cpp's prebuilt CPU build) for each
// string of a corpus, with special-token parsing off and on, and for the long
// document made of the corpus (DOCUMENT_COPIES copies of its strings joined by
// "\n", each copy ending in "\n"); never adding BOS/EOS (add_special false).
// With each case, llama.cpp's detokenization of its ids (llama_detokenize,
// special tokens rendered).
// Usage: node tokenize.mjs FILE.gguf corpus.json > ids.json
import {getLlama} from "node-llama-cpp";
import {readFileSync} from "node:fs";

const DOCUMENT_COPIES = 40;
const [, , modelPath, corpusPath] = process.argv;
const corpus = JSON.parse(readFileSync(corpusPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const cases = [];
for (const [index, text] of corpus.entries()) {
  for (const special of [false, true]) {
    const ids = Array.from(model.tokenize(text, special));
    cases.push({index, special, ids, text: model.detokenize(ids, true)});
  }
}
const document = Array(DOCUMENT_COPIES).fill(corpus.join("\n") + "\n").join("");
const output = {
  generator: "tools/llama-crosscheck/tokenize.mjs (llama.cpp through node-llama-cpp)",
  document_copies: DOCUMENT_COPIES,
  cases,
  document: Array.from(model.tokenize(document, false)),
};
process.stdout.write(JSON.stringify(output) + "\n");
process.exit(0);
