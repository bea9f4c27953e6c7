// The pre-tokenizer of a byte-level BPE vocabulary: the regexes llama.cpp picks
// by `tokenizer.ggml.pre`, applied in turn (each splits every piece the one
// before left into its matches and the gaps between them), then each piece
// byte-encoded. Compiled with PCRE2 (UTF, UCP, JIT); `\s` is spelled out as the
// Unicode White_Space set llama.cpp's tables hold, so both split alike.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moegraph {

class PreTokenizer {
 public:
  // The pre-tokenizer for a `tokenizer.ggml.pre` value; an error listing the
  // names moegraph knows for any other.
  static absl::StatusOr<PreTokenizer> ForName(std::string_view pre);
  // The names ForName accepts.
  static std::vector<std::string> Names();

  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // text (valid UTF-8) split into words, each byte-encoded (text/unicode.h).
  std::vector<std::string> Split(std::string_view text) const;

 private:
  struct Regexes;
  explicit PreTokenizer(std::unique_ptr<Regexes> regexes);
  std::unique_ptr<Regexes> regexes_;
};

}  // namespace moegraph
