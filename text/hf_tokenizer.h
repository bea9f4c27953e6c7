// A Hugging Face tokenizer.json, with the tokenizer_config.json (and config.json)
// beside it, converted into the GGUF vocabulary llama.cpp's convert_hf_to_gguf.py
// writes for it: tokens in id order, padded to the model's vocab size with
// "[PADn]" (unused); added tokens as control when marked special or shaped like
// "<|...|>", else user-defined; merges as "left right" (a space inside a part as
// U+0120); the pre-tokenizer's name from its regex; special ids, add_bos/add_eos
// and the chat template from the config files.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "loader/fixture.h"

namespace moegraph {

// vocab_size: the rows to pad to (0: config.json's vocab_size when present, else
// the highest id + 1). Errors name the file and the field: not a byte-level BPE
// tokenizer, a pre-tokenizer moegraph does not know, an id out of range, a
// vocab_size smaller than the tokenizer.
absl::StatusOr<FixtureVocab> ReadHfTokenizer(const std::string& tokenizer_json,
                                             int32_t vocab_size = 0);

}  // namespace moegraph
