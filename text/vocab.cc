#include "text/vocab.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/status_util.h"
#include "text/unicode.h"

namespace moegraph {
namespace {

// A key that may be absent: its value, or `absent`.
template <typename T, typename Getter>
absl::StatusOr<T> Optional(const GgufFile& file, std::string_view key, T absent, Getter get) {
  if (file.FindKey(key) == nullptr) return absent;
  return get(key);
}

absl::Status KeyError(const GgufFile& file, std::string_view key, std::string_view what) {
  return file.KeyError(*file.FindKey(key), what);
}

// A special id: absent keeps `fallback`; present must name a token.
bool IsHexDigit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

int HexValue(char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

// "<0xXX>", as SentencePiece spells its byte tokens.
bool IsByteTokenText(std::string_view text) {
  return text.size() == 6 && text.starts_with("<0x") && IsHexDigit(text[3]) &&
         IsHexDigit(text[4]) && text[5] == '>';
}

absl::StatusOr<int32_t> SpecialId(const GgufFile& file, std::string_view key, int32_t fallback,
                                  int32_t n_tokens) {
  if (file.FindKey(key) == nullptr) return fallback;
  MG_ASSIGN_OR_RETURN(const int64_t id, file.GetInt(key));
  if (id < 0 || id >= n_tokens) {
    return KeyError(file, key,
                    absl::StrFormat("token id %d is outside the vocabulary [0, %d)", id, n_tokens));
  }
  return static_cast<int32_t>(id);
}

}  // namespace

int32_t Vocab::Find(std::string_view text) const {
  auto it = token_to_id.find(Av(text));
  return it == token_to_id.end() ? kNoToken : it->second;
}

std::string Vocab::MergeKey(std::string_view left, std::string_view right) {
  // Tokens hold no NUL byte (gpt2 writes byte 0 as U+0100), so the key is unique.
  std::string key;
  key.reserve(left.size() + 1 + right.size());
  key.append(left).push_back('\0');
  key.append(right);
  return key;
}

uint8_t Vocab::TokenByte(int32_t id) const {
  const std::string& text = tokens[static_cast<size_t>(id)];
  return static_cast<uint8_t>(HexValue(text[3]) * 16 + HexValue(text[4]));
}

int32_t Vocab::MergeRank(std::string_view left, std::string_view right) const {
  auto it = merge_rank.find(MergeKey(left, right));
  return it == merge_rank.end() ? -1 : it->second;
}

absl::StatusOr<Vocab> Vocab::FromGguf(const GgufFile& file) {
  Vocab v;
  MG_ASSIGN_OR_RETURN(const std::string_view model, file.GetString("tokenizer.ggml.model"));
  v.model_name = std::string(model);
  if (model == "gpt2") {
    v.model = TokenizerModel::kGpt2;
  } else if (model == "llama") {
    v.model = TokenizerModel::kLlama;
  } else {
    return KeyError(
        file, "tokenizer.ggml.model",
        absl::StrFormat("tokenizer model '%s' is not one moegraph reads (gpt2, llama)", Av(model)));
  }
  MG_ASSIGN_OR_RETURN(
      const std::string_view pre,
      Optional<std::string_view>(file, "tokenizer.ggml.pre", "default",
                                 [&](std::string_view k) { return file.GetString(k); }));
  v.pre = pre.empty() ? "default" : std::string(pre);

  MG_ASSIGN_OR_RETURN(const std::vector<std::string_view> tokens,
                      file.GetStringArray("tokenizer.ggml.tokens"));
  if (tokens.empty()) return KeyError(file, "tokenizer.ggml.tokens", "no tokens");
  const int32_t n = static_cast<int32_t>(tokens.size());
  v.tokens.reserve(tokens.size());
  v.token_to_id.reserve(tokens.size());
  for (int32_t i = 0; i < n; ++i) {
    const std::string_view text = tokens[static_cast<size_t>(i)];
    if (const size_t bad = FindInvalidUtf8(text); bad != std::string_view::npos) {
      return KeyError(file, "tokenizer.ggml.tokens",
                      absl::StrFormat("token %d is not valid UTF-8 (byte %d)", i, bad));
    }
    v.tokens.emplace_back(text);
    // A repeated text keeps its first id, as llama.cpp's map keeps the last
    // write; neither happens in a real vocabulary.
    v.token_to_id.emplace(v.tokens.back(), i);
  }

  if (file.FindKey("tokenizer.ggml.token_type") == nullptr) {
    v.types.assign(tokens.size(), TokenType::kNormal);
  } else {
    MG_ASSIGN_OR_RETURN(const std::vector<int64_t> types,
                        file.GetIntArray("tokenizer.ggml.token_type"));
    if (types.size() != tokens.size()) {
      return KeyError(file, "tokenizer.ggml.token_type",
                      absl::StrFormat("%d types for %d tokens", types.size(), tokens.size()));
    }
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] < 0 || types[i] > static_cast<int64_t>(TokenType::kByte)) {
        return KeyError(file, "tokenizer.ggml.token_type",
                        absl::StrFormat("token %d has type %d (0..6 are defined)", i, types[i]));
      }
      v.types.push_back(static_cast<TokenType>(types[i]));
    }
  }

  if (v.model == TokenizerModel::kLlama) {
    MG_ASSIGN_OR_RETURN(const std::vector<double> scores,
                        file.GetFloatArray("tokenizer.ggml.scores"));
    if (scores.size() != tokens.size()) {
      return KeyError(file, "tokenizer.ggml.scores",
                      absl::StrFormat("%d scores for %d tokens", scores.size(), tokens.size()));
    }
    v.scores.assign(scores.begin(), scores.end());
  } else {
    MG_ASSIGN_OR_RETURN(const std::vector<std::string_view> merges,
                        file.GetStringArray("tokenizer.ggml.merges"));
    v.merge_rank.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      // "left right", split at the first space after the first byte, as llama.cpp does.
      const std::string_view merge = merges[i];
      const size_t space = merge.size() > 1 ? merge.find(' ', 1) : std::string_view::npos;
      if (space == std::string_view::npos) {
        return KeyError(file, "tokenizer.ggml.merges",
                        absl::StrFormat("merge %d ('%s') is not two tokens", i, Av(merge)));
      }
      const std::string_view left = merge.substr(0, space);
      const std::string_view right = merge.substr(space + 1);
      for (std::string_view part : {left, right}) {
        if (!v.token_to_id.contains(Av(part))) {
          return KeyError(file, "tokenizer.ggml.merges",
                          absl::StrFormat("merge %d ('%s') names '%s', which is not a token", i,
                                          Av(merge), Av(part)));
        }
      }
      v.merge_rank.emplace(MergeKey(left, right), static_cast<int32_t>(i));
    }
  }

  // llama.cpp's defaults: gpt2 ids 11 ("," in GPT-2) for BOS and EOS, no BOS
  // added but for llama-bpe; SentencePiece <unk> 0, <s> 1, </s> 2, BOS added.
  // glm4 and chatglm-bpe have no default BOS (llama_vocab::impl::load sets
  // special_bos_id to LLAMA_TOKEN_NULL for LLAMA_VOCAB_PRE_TYPE_CHATGLM4).
  const bool spm = v.model == TokenizerModel::kLlama;
  const bool llama3 = v.pre == "llama3" || v.pre == "llama-v3" || v.pre == "llama-bpe";
  const bool chatglm4 = !spm && (v.pre == "glm4" || v.pre == "chatglm-bpe");
  const int32_t default_bos = spm ? 1 : chatglm4 ? kNoToken : 11;
  const int32_t default_eos = spm ? 2 : 11;
  const int32_t default_unk = spm ? 0 : kNoToken;
  MG_ASSIGN_OR_RETURN(v.bos, SpecialId(file, "tokenizer.ggml.bos_token_id",
                                       default_bos < n ? default_bos : kNoToken, n));
  MG_ASSIGN_OR_RETURN(v.eos, SpecialId(file, "tokenizer.ggml.eos_token_id",
                                       default_eos < n ? default_eos : kNoToken, n));
  MG_ASSIGN_OR_RETURN(v.eot, SpecialId(file, "tokenizer.ggml.eot_token_id", kNoToken, n));
  MG_ASSIGN_OR_RETURN(v.eom, SpecialId(file, "tokenizer.ggml.eom_token_id", kNoToken, n));
  MG_ASSIGN_OR_RETURN(v.unk, SpecialId(file, "tokenizer.ggml.unknown_token_id", default_unk, n));
  MG_ASSIGN_OR_RETURN(v.pad, SpecialId(file, "tokenizer.ggml.padding_token_id", kNoToken, n));
  auto flag_or = [&](std::string_view key, bool absent) {
    return Optional<bool>(file, key, absent, [&](std::string_view k) { return file.GetBool(k); });
  };
  MG_ASSIGN_OR_RETURN(v.add_bos, flag_or("tokenizer.ggml.add_bos_token", spm || llama3));
  MG_ASSIGN_OR_RETURN(v.add_eos, flag_or("tokenizer.ggml.add_eos_token", false));
  if (v.add_bos && v.bos == kNoToken) {
    return KeyError(file, "tokenizer.ggml.add_bos_token", "BOS is added but there is no BOS token");
  }
  if (v.add_eos && v.eos == kNoToken) {
    return KeyError(file, "tokenizer.ggml.add_eos_token", "EOS is added but there is no EOS token");
  }

  MG_ASSIGN_OR_RETURN(v.add_space_prefix, flag_or("tokenizer.ggml.add_space_prefix", spm));
  // Of the pre-tokenizers moegraph runs, llama.cpp turns the clean-up off for
  // qwen2 (and deepseek-r1-qwen, its alias), qwen35 and gpt-4o (glm4 keeps it on;
  // llama_vocab::impl::load).
  v.clean_spaces = !spm && v.pre != "qwen2" && v.pre != "deepseek-r1-qwen" && v.pre != "qwen35" &&
                   v.pre != "gpt-4o";
  v.byte_token.fill(kNoToken);
  if (spm) {
    for (int32_t i = 0; i < n; ++i) {
      if (v.types[static_cast<size_t>(i)] == TokenType::kByte &&
          !IsByteTokenText(v.tokens[static_cast<size_t>(i)])) {
        return KeyError(file, "tokenizer.ggml.token_type",
                        absl::StrFormat("token %d ('%s') is a byte token not spelled <0xXX>", i,
                                        v.tokens[static_cast<size_t>(i)]));
      }
    }
    for (int b = 0; b < 256; ++b) {
      int32_t id = v.Find(absl::StrFormat("<0x%02X>", b));
      if (id == kNoToken) id = v.Find(std::string(1, static_cast<char>(b)));
      v.byte_token[static_cast<size_t>(b)] = id;
    }
  }

  // llama.cpp's end-of-generation texts (llama-vocab.cpp, load). Where the file
  // names no EOT, the first of llama.cpp's EOT texts found is EOT; where it names
  // no EOM, <|eom_id|> is EOM. EOS, EOT and EOM end generation whatever their text
  // (GLM-4.5's converter names <|user|> EOT and <|observation|> EOM).
  static constexpr std::string_view kEogTexts[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
      "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
      "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
      "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "[e~["};
  static constexpr std::string_view kEotTexts[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
      "<EOT>", "_<EOT>", "[EOT]",
      "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
      "<end_of_utterance>"};
  for (std::string_view text : kEogTexts) {
    const int32_t id = v.Find(text);
    if (id == kNoToken) continue;
    v.eog.insert(id);
    v.types[static_cast<size_t>(id)] = TokenType::kControl;
  }
  for (std::string_view text : kEotTexts) {
    if (v.eot != kNoToken) break;
    v.eot = v.Find(text);
  }
  if (v.eom == kNoToken) v.eom = v.Find("<|eom_id|>");
  for (int32_t id : {v.eos, v.eot, v.eom}) {
    if (id != kNoToken) v.eog.insert(id);
  }
  // llama.cpp's o200k_harmony (gpt-oss) and solar-open workaround: with <|return|>
  // and <|call|>, or <|call|>/<|calls|> and <|flush|>, <|end|> ends a message, not
  // the generation, and becomes user-defined.
  auto in_eog = [&](std::string_view text) {
    const int32_t id = v.Find(text);
    return id != kNoToken && v.eog.count(id) != 0;
  };
  const bool has_call = in_eog("<|call|>") || in_eog("<|calls|>");
  if (in_eog("<|end|>") && has_call && (in_eog("<|return|>") || in_eog("<|flush|>"))) {
    const int32_t end = v.Find("<|end|>");
    v.eog.erase(end);
    v.types[static_cast<size_t>(end)] = TokenType::kUserDefined;
  }

  for (int32_t i = 0; i < n; ++i) {
    const TokenType type = v.types[static_cast<size_t>(i)];
    if (type == TokenType::kControl || type == TokenType::kUserDefined ||
        type == TokenType::kUnknown) {
      v.special_tokens.push_back(i);
    }
  }
  std::stable_sort(v.special_tokens.begin(), v.special_tokens.end(), [&](int32_t a, int32_t b) {
    return v.tokens[static_cast<size_t>(a)].size() > v.tokens[static_cast<size_t>(b)].size();
  });

  if (const GgufTensor* embd = file.FindTensor("token_embd.weight");
      embd != nullptr && embd->ne[1] != n) {
    return file.TensorError(*embd, absl::StrFormat("%d embedding rows for %d tokens in "
                                                   "tokenizer.ggml.tokens (they must be equal)",
                                                   embd->ne[1], n));
  }
  return v;
}

}  // namespace moegraph
