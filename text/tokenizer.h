// Text to token ids and back, as llama.cpp does it (src/llama-vocab.cpp) for a
// vocabulary read from GGUF metadata, so the ids are llama.cpp's:
//   1. special tokens written in the text become their ids: user-defined ones
//      always, control and unknown ones when parse_special (longest first);
//   2. every other stretch is tokenized by the vocabulary's model:
//      `gpt2` (byte-level BPE): pre-tokenized (text/pretokenizer.h), each word
//        merged by rank, the lowest-ranked adjacent pair first (ties: leftmost);
//      `llama` (SentencePiece BPE): spaces written as U+2581, one more in front
//        at the start and after a special token (add_space_prefix), then the
//        adjacent pair whose token scores highest merged first (ties:
//        leftmost); what no token covers falls back to byte tokens <0xXX>;
//   3. BOS and EOS are added as the vocabulary says, when add_special.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "text/pretokenizer.h"
#include "text/vocab.h"

namespace moegraph {

class Tokenizer {
 public:
  // Errors: a pre-tokenizer moegraph does not implement.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(Vocab vocab);

  // llama_tokenize(text, add_special, parse_special). Errors: text that is not
  // valid UTF-8 (naming the byte offset); a llama vocabulary with neither a
  // token nor a byte token for a character of the text (llama.cpp aborts).
  absl::StatusOr<std::vector<int32_t>> Tokenize(std::string_view text, bool add_special,
                                                bool parse_special) const;

  // llama_token_to_piece(id, special): a normal token's bytes (gpt2: byte-level
  // decoded; llama: U+2581 as a space), a llama byte token's byte, a
  // user-defined token's text, a control or unknown token's text when special
  // (else nothing), nothing for unused tokens.
  std::string Piece(int32_t id, bool special) const;
  // llama_detokenize(ids, remove_special = false, special): the pieces, less
  // the space add_space_prefix put in front of the first one, and with
  // llama.cpp's space clean-up where the vocabulary asks for it.
  std::string Detokenize(const std::vector<int32_t>& ids, bool special) const;

  const Vocab& vocab() const { return vocab_; }

 private:
  Tokenizer(Vocab vocab, std::optional<PreTokenizer> pre);
  void TokenizeWord(const std::string& word, std::vector<int32_t>* out) const;
  absl::Status TokenizeSentencePiece(std::string_view text, std::vector<int32_t>* out) const;

  Vocab vocab_;
  std::optional<PreTokenizer> pre_;  // gpt2 only
  bool ignore_merges_ = false;       // llama-bpe: a word that is a token stays whole
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
