#include "text/hf_tokenizer.h"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "loader/status_util.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using Json = nlohmann::json;

absl::StatusOr<Json> ReadJson(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  Json json = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON"));
  return json;
}

// The pre-tokenizer llama.cpp would name for the tokenizer's own regexes.
absl::StatusOr<std::string> PreName(const Json& pre, const std::string& path) {
  static const std::map<std::string, std::string> kByRegex = {
      {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       "qwen2"},
      // Qwen3.5's (convert_hf_to_gguf.py names it qwen35).
      {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       "qwen35"},
      {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       "llama-bpe"},
      // o200k (gpt-oss, GPT-4o), as convert_hf_to_gguf.py names it.
      {R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       "gpt-4o"},
  };
  if (pre.is_object() && pre.value("type", "") == "ByteLevel" && pre.value("use_regex", false)) {
    return std::string("gpt-2");
  }
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers")) {
    for (const Json& step : pre["pretokenizers"]) {
      if (step.value("type", "") != "Split" || !step.contains("pattern")) continue;
      const std::string regex = step["pattern"].value("Regex", "");
      if (auto it = kByRegex.find(regex); it != kByRegex.end()) return it->second;
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: pre_tokenizer: the Split regex /%s/ is not one moegraph knows (those of qwen2, "
          "qwen35, llama-bpe, gpt-4o and gpt-2)",
          path, regex));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      path,
      ": pre_tokenizer: not a byte-level pre-tokenizer moegraph knows (qwen2, qwen35, llama-bpe, "
      "gpt-4o, gpt-2)"));
}

// A config file's special token: a string, an object with "content", or null.
std::optional<std::string> SpecialText(const Json& config, const std::string& key) {
  if (!config.contains(key)) return std::nullopt;
  const Json& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return std::nullopt;
}

// "<0xXX>": SentencePiece's byte tokens.
bool IsByteToken(const std::string& text) {
  return text.size() == 6 && text.starts_with("<0x") && text.back() == '>' &&
         std::isxdigit(static_cast<unsigned char>(text[3])) &&
         std::isxdigit(static_cast<unsigned char>(text[4]));
}

// Whether a SentencePiece-style tokenizer puts U+2581 before the text: a
// Prepend normalizer, or a Metaspace pre-tokenizer that prepends.
bool AddsSpacePrefix(const Json& tokenizer) {
  auto steps = [](const Json& part, const char* list) {
    if (!part.is_object()) return Json::array();
    if (part.contains(list) && part[list].is_array()) return part[list];
    return Json::array({part});
  };
  for (const Json& step : steps(tokenizer.value("normalizer", Json()), "normalizers")) {
    if (step.value("type", "") == "Prepend" && step.value("prepend", "") == "\xe2\x96\x81") {
      return true;
    }
  }
  for (const Json& step : steps(tokenizer.value("pre_tokenizer", Json()), "pretokenizers")) {
    if (step.value("type", "") != "Metaspace") continue;
    if (step.contains("prepend_scheme")) return step.value("prepend_scheme", "") != "never";
    return step.value("add_prefix_space", true);
  }
  return false;
}

bool LooksSpecial(const std::string& text) {
  auto wrapped = [&](std::string_view open, std::string_view close) {
    return text.size() >= open.size() + close.size() && text.starts_with(open) &&
           text.ends_with(close);
  };
  return text == "<pad>" || text == "<mask>" || text == "<2mass>" || text == "[@BOS@]" ||
         wrapped("<|", "|>") || wrapped("<\xef\xbd\x9c", "\xef\xbd\x9c>") ||
         wrapped("<unused", ">");
}

}  // namespace

absl::StatusOr<FixtureVocab> ReadHfTokenizer(const std::string& tokenizer_json,
                                             int32_t vocab_size) {
  MG_ASSIGN_OR_RETURN(const Json tokenizer, ReadJson(tokenizer_json));
  const std::filesystem::path dir = std::filesystem::path(tokenizer_json).parent_path();
  Json config = Json::object();
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    MG_ASSIGN_OR_RETURN(config, ReadJson((dir / "tokenizer_config.json").string()));
  }
  Json model_config = Json::object();
  if (std::filesystem::exists(dir / "config.json")) {
    MG_ASSIGN_OR_RETURN(model_config, ReadJson((dir / "config.json").string()));
  }

  const Json& model = tokenizer.contains("model") ? tokenizer["model"] : Json::object();
  if (model.value("type", "") != "BPE" || !model.contains("vocab") || !model["vocab"].is_object() ||
      !model.contains("merges") || !model["merges"].is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokenizer_json,
                     ": model: not a BPE model with vocab and merges (moegraph converts "
                     "byte-level BPE tokenizers)"));
  }
  FixtureVocab v;
  // Byte fallback marks a SentencePiece vocabulary converted to a BPE model
  // (Llama 2, Mistral): llama.cpp's converter takes it as `llama`.
  const bool spm = model.value("byte_fallback", false);
  if (spm) {
    v.model = "llama";
    v.add_space_prefix = AddsSpacePrefix(tokenizer);
  } else {
    v.model = "gpt2";
    MG_ASSIGN_OR_RETURN(v.pre, PreName(tokenizer.value("pre_tokenizer", Json()), tokenizer_json));
  }

  // id -> text, and which ids are added tokens (with their special flag).
  std::map<int64_t, std::string> by_id;
  std::map<int64_t, bool> added_special;
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: model.vocab['%s'] is not a token id", tokenizer_json, text));
    }
    by_id[id.get<int64_t>()] = text;
  }
  if (tokenizer.contains("added_tokens")) {
    for (const Json& added : tokenizer["added_tokens"]) {
      if (!added.contains("id") || !added["id"].is_number_integer() || !added.contains("content") ||
          !added["content"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(tokenizer_json, ": added_tokens: an entry without id or content"));
      }
      const int64_t id = added["id"].get<int64_t>();
      by_id[id] = added["content"].get<std::string>();
      added_special[id] = added.value("special", false);
    }
  }
  if (by_id.empty()) return absl::InvalidArgumentError(absl::StrCat(tokenizer_json, ": no tokens"));
  // GLM-4 and GLM-4.5 split with Llama 3's regex; convert_hf_to_gguf.py tells them
  // apart by a hash of their tokenization (get_vocab_base_pre: "glm4"), moegraph
  // by GLM's [gMASK] and <sop> added tokens.
  auto is_added = [&](const std::string& text) {
    for (const auto& [id, special] : added_special) {
      if (by_id.at(id) == text) return true;
    }
    return false;
  };
  const bool glm = v.pre == "llama-bpe" && is_added("[gMASK]") && is_added("<sop>");
  if (glm) v.pre = "glm4";
  const int64_t highest = by_id.rbegin()->first;
  int64_t n = vocab_size > 0 ? vocab_size : model_config.value("vocab_size", highest + 1);
  if (n <= highest) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: vocab size %d is smaller than the tokenizer's %d tokens",
                        tokenizer_json, n, highest + 1));
  }

  std::vector<std::pair<std::string, std::string>> merges;
  for (const Json& merge : model["merges"]) {
    if (merge.is_string()) {
      const std::string text = merge.get<std::string>();
      const size_t space = text.size() > 1 ? text.find(' ', 1) : std::string::npos;
      if (space == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: model.merges: '%s' is not two tokens split by a space", tokenizer_json, text));
      }
      merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(tokenizer_json, ": model.merges: an entry that is not a merge"));
    }
  }

  const std::optional<std::string> unk_text = SpecialText(config, "unk_token");
  // SentencePiece scores: transformers wrote the merges in the order of the
  // merged piece's score, so a piece scores minus the rank of the first merge
  // that makes it; a piece no merge makes (a single character) scores below
  // every merge; control, unknown and byte tokens score 0, as in the .model file.
  absl::flat_hash_map<std::string, int64_t> first_rank;
  if (spm) {
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      first_rank.try_emplace(merges[rank].first + merges[rank].second, rank);
    }
  }
  const auto n_merges = static_cast<int64_t>(merges.size());
  for (int64_t id = 0; id < n; ++id) {
    auto it = by_id.find(id);
    if (it == by_id.end()) {
      v.tokens.push_back(absl::StrCat("[PAD", id, "]"));
      v.types.push_back(static_cast<int32_t>(TokenType::kUnused));
      if (spm) v.scores.push_back(0.0f);
      continue;
    }
    std::string text = it->second;
    TokenType type = TokenType::kNormal;
    if (auto added = added_special.find(id); added != added_special.end()) {
      if (spm && text == unk_text) {
        type = TokenType::kUnknown;
      } else if (added->second || LooksSpecial(text)) {
        type = TokenType::kControl;
      } else {
        type = TokenType::kUserDefined;
        text = absl::StrReplaceAll(text, {{"\xe2\x96\x81", " "}});
      }
    } else if (spm && IsByteToken(text)) {
      type = TokenType::kByte;
    }
    if (spm) {
      float score = 0.0f;
      if (type == TokenType::kNormal) {
        auto rank = first_rank.find(text);
        score = static_cast<float>(rank != first_rank.end() ? -rank->second : -(n_merges + id));
      }
      v.scores.push_back(score);
    }
    v.tokens.push_back(std::move(text));
    v.types.push_back(static_cast<int32_t>(type));
  }
  if (!spm) {
    // transformers >= 4.45 writes pairs, where a space inside a part is U+0120.
    for (const auto& [left, right] : merges) {
      v.merges.push_back(absl::StrCat(absl::StrReplaceAll(left, {{" ", "\xc4\xa0"}}), " ",
                                      absl::StrReplaceAll(right, {{" ", "\xc4\xa0"}})));
    }
  }

  auto id_of = [&](const std::string& text) -> std::optional<uint32_t> {
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      if (v.tokens[i] == text) return static_cast<uint32_t>(i);
    }
    return std::nullopt;
  };
  const std::pair<const char*, const char*> kSpecials[] = {{"bos_token", "bos"},
                                                           {"eos_token", "eos"},
                                                           {"unk_token", "unknown"},
                                                           {"pad_token", "padding"},
                                                           {"sep_token", "seperator"}};
  for (const auto& [config_key, gguf_name] : kSpecials) {
    if (std::optional<std::string> text = SpecialText(config, config_key)) {
      const std::optional<uint32_t> id = id_of(*text);
      if (!id.has_value()) {
        return absl::InvalidArgumentError(absl::StrFormat("%s: %s '%s' is not a token",
                                                          (dir / "tokenizer_config.json").string(),
                                                          config_key, *text));
      }
      v.special_ids.emplace_back(gguf_name, *id);
      continue;
    }
    // config.json's ids stand in where tokenizer_config.json names none.
    const std::string id_key = absl::StrCat(std::string(config_key).substr(0, 3), "_token_id");
    if (model_config.contains(id_key) && model_config[id_key].is_number_integer()) {
      const int64_t id = model_config[id_key].get<int64_t>();
      if (id >= 0 && id < n) v.special_ids.emplace_back(gguf_name, static_cast<uint32_t>(id));
    }
  }
  if (glm) {
    // _set_vocab_glm (GLM-4.5): these where the config files name none.
    const std::pair<const char*, const char*> kGlmSpecials[] = {{"bos", "[gMASK]"},
                                                                {"eot", "<|user|>"},
                                                                {"unknown", "<|endoftext|>"},
                                                                {"eom", "<|observation|>"}};
    for (const auto& [gguf_name, text] : kGlmSpecials) {
      bool named = false;
      for (const auto& [name, id] : v.special_ids) named = named || name == gguf_name;
      const std::optional<uint32_t> id = id_of(text);
      if (!named && id.has_value()) v.special_ids.emplace_back(gguf_name, *id);
    }
  }
  for (const char* name : {"bos", "eos"}) {
    const std::string key = absl::StrCat("add_", name, "_token");
    if (config.contains(key) && config[key].is_boolean()) {
      v.add_special.emplace_back(name, config[key].get<bool>());
    }
  }
  if (config.contains("chat_template") && config["chat_template"].is_string()) {
    v.chat_template = config["chat_template"].get<std::string>();
  }
  return v;
}

}  // namespace moegraph
