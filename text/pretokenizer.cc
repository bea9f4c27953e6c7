#include "text/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "loader/status_util.h"
#include "text/unicode.h"

namespace moegraph {
namespace {

// Unicode's White_Space, the set llama.cpp's whitespace flag holds. `\s` and
// `\S` below stand for [WS] and [^WS]; `[^\s...]` for [^WS...].
constexpr std::string_view kWhiteSpace =
    R"(\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// The regexes of llama-vocab.cpp (llm_tokenizer_bpe), by pre-tokenizer type.
constexpr std::string_view kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
constexpr std::string_view kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// LLAMA_VOCAB_PRE_TYPE_GPT4O: tiktoken's o200k regex with its case classes as
// lookaheads ([^a-z] / [^A-Z] behind (?=\p{L})) and (?i:...) spelled out.
constexpr std::string_view kGpt4o =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// LLAMA_VOCAB_PRE_TYPE_QWEN35: qwen2's with combining marks (\p{M}) taken
// into words and out of the punctuation runs.
constexpr std::string_view kQwen35 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct NamedRegexes {
  std::vector<std::string_view> names;
  std::vector<std::string_view> regexes;
};

const std::vector<NamedRegexes>& Table() {
  static const std::vector<NamedRegexes> table = {
      {{"default"}, {R"([\p{P}\$\+<=>\^~\|]+)", kGpt2, R"(\p{N}+)", R"([0-9][0-9][0-9])"}},
      {{"gpt-2", "olmo"}, {kGpt2}},
      {{"llama-bpe", "llama3", "llama-v3"}, {kLlama3}},
      {{"qwen2", "deepseek-r1-qwen"}, {kQwen2}},
      {{"qwen35"}, {kQwen35}},
      {{"gpt-4o"}, {kGpt4o}},
      // LLAMA_VOCAB_PRE_TYPE_CHATGLM4 (GLM-4, GLM-4.5): llama.cpp's regex for it is
      // LLAMA3's, character for character.
      {{"glm4", "chatglm-bpe"}, {kLlama3}},
  };
  return table;
}

std::string SpellWhiteSpace(std::string_view regex) {
  const std::string ws(kWhiteSpace);
  return absl::StrReplaceAll(
      Av(regex), {{R"([^\s)", "[^" + ws}, {R"(\s)", "[" + ws + "]"}, {R"(\S)", "[^" + ws + "]"}});
}

}  // namespace

struct PreTokenizer::Regexes {
  std::vector<pcre2_code*> codes;
  ~Regexes() {
    for (pcre2_code* code : codes) pcre2_code_free(code);
  }
};

PreTokenizer::PreTokenizer(std::unique_ptr<Regexes> regexes) : regexes_(std::move(regexes)) {}
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

std::vector<std::string> PreTokenizer::Names() {
  std::vector<std::string> names;
  for (const NamedRegexes& entry : Table())
    names.insert(names.end(), entry.names.begin(), entry.names.end());
  return names;
}

absl::StatusOr<PreTokenizer> PreTokenizer::ForName(std::string_view pre) {
  for (const NamedRegexes& entry : Table()) {
    bool match = false;
    for (std::string_view name : entry.names) match = match || name == pre;
    if (!match) continue;
    auto regexes = std::make_unique<Regexes>();
    for (std::string_view regex : entry.regexes) {
      const std::string pattern = SpellWhiteSpace(regex);
      int error = 0;
      PCRE2_SIZE error_offset = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                       PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
      if (code == nullptr) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(error, message, sizeof(message));
        return absl::InternalError(absl::StrCat("pre-tokenizer '", Av(pre), "': PCRE2 refuses /",
                                                pattern, "/ at ", error_offset, ": ",
                                                reinterpret_cast<const char*>(message)));
      }
      // JIT is a speed-up only: without it pcre2_match interprets.
      pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
      regexes->codes.push_back(code);
    }
    return PreTokenizer(std::move(regexes));
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.pre '", Av(pre),
                                                 "' is not a pre-tokenizer moegraph knows (",
                                                 absl::StrJoin(Names(), ", "), ")"));
}

std::vector<std::string> PreTokenizer::Split(std::string_view text) const {
  std::vector<std::string_view> pieces = {text};
  std::vector<std::string_view> next;
  for (pcre2_code* code : regexes_->codes) {
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(code, nullptr);
    next.clear();
    for (std::string_view piece : pieces) {
      // Each piece is its own subject: a lookahead does not see past it.
      size_t gap_start = 0;
      size_t from = 0;
      while (from < piece.size()) {
        const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(piece.data()), piece.size(),
                                   from, PCRE2_NO_UTF_CHECK, match, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          std::fprintf(stderr, "moegraph: PCRE2 match error %d in the pre-tokenizer\n", rc);
          std::abort();
        }
        const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
        const size_t begin = ovector[0];
        const size_t end = ovector[1];
        if (end == begin) {
          // No regex here matches empty; step past one character regardless.
          from =
              begin + static_cast<size_t>(Utf8SequenceLength(static_cast<uint8_t>(piece[begin])));
          continue;
        }
        if (begin > gap_start) next.push_back(piece.substr(gap_start, begin - gap_start));
        next.push_back(piece.substr(begin, end - begin));
        gap_start = from = end;
      }
      if (gap_start < piece.size()) next.push_back(piece.substr(gap_start));
    }
    pcre2_match_data_free(match);
    std::swap(pieces, next);
  }
  std::vector<std::string> words;
  words.reserve(pieces.size());
  for (std::string_view piece : pieces) words.push_back(ByteEncode(piece));
  return words;
}

}  // namespace moegraph
