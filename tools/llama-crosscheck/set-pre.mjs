// Copies a GGUF file with its tokenizer.ggml.pre set to PRE, every other key,
// tensor and byte of data as they were (the data section is realigned after the
// header's new length). For running one real vocabulary under another
// pre-tokenizer in llama.cpp (tokenizer-ids.sh: gpt-oss's under glm4).
// Usage: node set-pre.mjs IN.gguf OUT.gguf PRE
import {readFileSync, writeFileSync} from "node:fs";

const [, , inPath, outPath, pre] = process.argv;
const file = readFileSync(inPath);
if (file.toString("latin1", 0, 4) !== "GGUF") throw new Error(`${inPath}: not a GGUF file`);

let at = 4 + 4;  // magic, version
const nTensors = file.readBigUInt64LE(at);
const nKv = file.readBigUInt64LE(at + 8);
at += 16;
const readString = () => {
  const n = Number(file.readBigUInt64LE(at));
  const s = file.toString("utf8", at + 8, at + 8 + n);
  at += 8 + n;
  return s;
};
// Bytes of one value of each fixed-size GGUF type (string 8 and array 9 are read).
const SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8};
const skipValue = (type) => {
  if (type === 8) return void readString();
  if (type === 9) {
    const itemType = file.readUInt32LE(at);
    const n = Number(file.readBigUInt64LE(at + 4));
    at += 12;
    if (itemType === 8 || itemType === 9) {
      for (let i = 0; i < n; ++i) skipValue(itemType);
    } else {
      at += n * SIZE[itemType];
    }
    return;
  }
  if (!(type in SIZE)) throw new Error(`${inPath}: GGUF value type ${type}`);
  at += SIZE[type];
};

const parts = [];
let copiedTo = 0;
let alignment = 32;
let found = false;
for (let i = 0n; i < nKv; ++i) {
  const key = readString();
  const type = file.readUInt32LE(at);
  at += 4;
  if (key === "tokenizer.ggml.pre") {
    if (type !== 8) throw new Error(`${inPath}: tokenizer.ggml.pre is not a string`);
    parts.push(file.subarray(copiedTo, at));
    const text = Buffer.from(pre, "utf8");
    const length = Buffer.alloc(8);
    length.writeBigUInt64LE(BigInt(text.length));
    parts.push(length, text);
    readString();
    copiedTo = at;
    found = true;
    continue;
  }
  if (key === "general.alignment" && type === 4) alignment = file.readUInt32LE(at);
  skipValue(type);
}
if (!found) throw new Error(`${inPath}: no tokenizer.ggml.pre`);
for (let i = 0n; i < nTensors; ++i) {
  readString();
  const nDims = file.readUInt32LE(at);
  at += 4 + 8 * nDims + 4 + 8;  // dims, type, offset (relative to the data section)
}
parts.push(file.subarray(copiedTo, at));
const dataStart = at + ((alignment - (at % alignment)) % alignment);
const header = Buffer.concat(parts);
const padding = Buffer.alloc((alignment - (header.length % alignment)) % alignment);
writeFileSync(outPath, Buffer.concat([header, padding, file.subarray(dataStart)]));
