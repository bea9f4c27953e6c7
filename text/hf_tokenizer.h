// A Hugging Face tokenizer.json, with the tokenizer_config.json (and config.json)
// beside it, converted into the GGUF vocabulary llama.cpp's convert_hf_to_gguf.py
// writes for it: tokens in id order, padded to the model's vocab size with
// "[PADn]" (unused); added tokens as control when marked special or shaped like
// "<|...|>", else user-defined; special ids, add_bos/add_eos and the chat
// template from the config files. Two kinds of BPE model:
//   byte-level (Qwen, Llama 3, GPT-2, GLM-4.5): `gpt2`, merges as "left right" (a
//     space inside a part as U+0120), the pre-tokenizer's name from its regex
//     (Llama 3's with GLM's [gMASK] and <sop> added tokens: glm4, with the special
//     ids GLM-4.5's converter adds);
//   byte fallback (Llama 2, Mistral: SentencePiece converted): `llama`, scores
//     from the merges' order, "<0xXX>" byte tokens, the unk token unknown,
//     add_space_prefix from the normalizer.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "loader/fixture.h"

namespace moegraph {

// vocab_size: the rows to pad to (0: config.json's vocab_size when present, else
// the highest id + 1). Errors name the file and the field: not a BPE model, a
// pre-tokenizer moegraph does not know, a merge that is not two tokens, an id
// out of range, a vocab_size smaller than the tokenizer.
absl::StatusOr<FixtureVocab> ReadHfTokenizer(const std::string& tokenizer_json,
                                             int32_t vocab_size = 0);

}  // namespace moegraph
