// Text to token ids and back, as llama.cpp does it (src/llama-vocab.cpp) for a
// vocabulary read from GGUF metadata, so the ids are llama.cpp's:
//   1. special tokens written in the text become their ids: user-defined ones
//      always, control and unknown ones when parse_special (longest first);
//   2. every other stretch is pre-tokenized (text/pretokenizer.h) and each word
//      merged by BPE, the lowest-ranked adjacent pair first (ties: leftmost);
//   3. BOS and EOS are added as the vocabulary says, when add_special.
// Tokenizer models: `gpt2` (byte-level BPE). SentencePiece (`llama`) is issue
// 10's next step and is refused by name until then.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "text/pretokenizer.h"
#include "text/vocab.h"

namespace moegraph {

class Tokenizer {
 public:
  // Errors: a tokenizer model or pre-tokenizer moegraph does not implement.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(Vocab vocab);

  // llama_tokenize(text, add_special, parse_special). Text that is not valid
  // UTF-8 is an error naming the byte offset.
  absl::StatusOr<std::vector<int32_t>> Tokenize(std::string_view text, bool add_special,
                                                bool parse_special) const;

  // llama_token_to_piece(id, special): a normal token's bytes (byte-level
  // decoded), a user-defined token's text, a control or unknown token's text
  // when special (else nothing), nothing for unused and byte tokens.
  std::string Piece(int32_t id, bool special) const;
  // The pieces of ids, concatenated.
  std::string Detokenize(const std::vector<int32_t>& ids, bool special) const;

  const Vocab& vocab() const { return vocab_; }

 private:
  Tokenizer(Vocab vocab, PreTokenizer pre);
  void TokenizeWord(const std::string& word, std::vector<int32_t>* out) const;

  Vocab vocab_;
  PreTokenizer pre_;
  bool ignore_merges_ = false;  // llama-bpe: a word that is a token stays whole
};

// Pieces to text as they are generated, never splitting a UTF-8 character: the
// bytes of a character still incomplete at the end wait for the next piece.
class TextStream {
 public:
  std::string Push(std::string_view piece);
  // What was held back (an incomplete character at the end of the generation).
  std::string Flush();

 private:
  std::string pending_;
};

}  // namespace moegraph
