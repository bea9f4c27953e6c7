// A model's vocabulary as llama.cpp reads it from GGUF metadata: the tokenizer
// model (`tokenizer.ggml.model`), the pre-tokenizer's name, tokens, their types,
// scores or merges, the special ids and whether BOS/EOS are added, with
// llama.cpp's defaults where a key is absent. Bad metadata is an error naming the
// file, the key and the index; nothing here reads a tensor's data.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "loader/gguf.h"

namespace moegraph {

enum class TokenizerModel { kGpt2, kLlama };

// llama.cpp's token types (tokenizer.ggml.token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

inline constexpr int32_t kNoToken = -1;

struct Vocab {
  TokenizerModel model = TokenizerModel::kGpt2;
  std::string model_name;  // "gpt2", "llama"
  std::string pre;         // tokenizer.ggml.pre; "default" when absent
  std::vector<std::string> tokens;
  std::vector<TokenType> types;
  std::vector<float> scores;  // llama; empty for gpt2
  absl::flat_hash_map<std::string, int32_t> token_to_id;
  // gpt2: rank of the merge (left, right), keyed by MergeKey.
  absl::flat_hash_map<std::string, int32_t> merge_rank;

  int32_t bos = kNoToken;
  int32_t eos = kNoToken;
  int32_t eot = kNoToken;
  int32_t eom = kNoToken;  // end of message (GLM-4.5: <|observation|>)
  int32_t unk = kNoToken;
  int32_t pad = kNoToken;
  bool add_bos = false;
  bool add_eos = false;
  // llama: a space before text at the start and after each special token
  // (tokenizer.ggml.add_space_prefix); detokenizing drops it again.
  bool add_space_prefix = false;
  // gpt2 but qwen2 and gpt-4o: detokenizing drops the space before ?!., and in " 's" and
  // the like, as llama.cpp's clean_up_tokenization_spaces.
  bool clean_spaces = false;
  // llama: the token of each byte, for text no merge covers: "<0xXX>", else the
  // byte itself as a token; kNoToken where the vocabulary has neither.
  std::array<int32_t, 256> byte_token{};
  // End-of-generation tokens: EOS, EOT, EOM, and the tokens llama.cpp recognizes by
  // their text (<|im_end|>, <|endoftext|>, <|eot_id|>, </s>, ...), which it also
  // makes control tokens.
  absl::flat_hash_set<int32_t> eog;

  // Tokens matched in the text before pre-tokenization (control, user-defined
  // and unknown), longest text first, as llama.cpp's special-token cache.
  std::vector<int32_t> special_tokens;

  int32_t size() const { return static_cast<int32_t>(tokens.size()); }
  bool IsEog(int32_t id) const { return eog.contains(id); }
  // The id of a token's text, or kNoToken.
  int32_t Find(std::string_view text) const;
  // The rank of merging left and right, or -1.
  int32_t MergeRank(std::string_view left, std::string_view right) const;

  // llama: the byte a byte token ("<0x0A>") stands for.
  uint8_t TokenByte(int32_t id) const;

  static std::string MergeKey(std::string_view left, std::string_view right);
  // The vocabulary of file. Also errors: token_embd.weight with more rows than
  // there are tokens (ids the tokenizer could never produce would be embedded);
  // in a llama vocabulary, a byte token not spelled "<0xXX>".
  static absl::StatusOr<Vocab> FromGguf(const GgufFile& file);
};

}  // namespace moegraph
