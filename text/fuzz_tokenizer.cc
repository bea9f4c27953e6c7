// libFuzzer target: any bytes, tokenized with two fixture vocabularies, a
// byte-level BPE one and a SentencePiece one (special parsing on and off):
// text that is not UTF-8 is an error, never a crash; every other text gives ids
// inside the vocabulary, and the ids detokenize to the text again (for
// SentencePiece with special parsing off, and with U+2581 read as the space it
// stands for). ASan/UBSan catch the rest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/vocab.h"

namespace {

std::unique_ptr<moegraph::Tokenizer> Load(const moegraph::FixtureSpec& spec) {
  absl::StatusOr<std::vector<uint8_t>> bytes = moegraph::FixtureBytes(spec);
  if (!bytes.ok()) std::abort();
  absl::StatusOr<std::unique_ptr<moegraph::GgufFile>> file =
      moegraph::GgufFile::FromBytes("fixture.gguf", *bytes);
  if (!file.ok()) std::abort();
  absl::StatusOr<moegraph::Vocab> vocab = moegraph::Vocab::FromGguf(**file);
  if (!vocab.ok()) std::abort();
  absl::StatusOr<std::unique_ptr<moegraph::Tokenizer>> t =
      moegraph::Tokenizer::Create(std::move(*vocab));
  if (!t.ok()) std::abort();
  return std::move(*t);
}

// A fixture's vocabulary of 512: all 256 byte symbols, two-letter merges,
// <|endoftext|> and <|im_end|> (control), the qwen2 pre-tokenizer.
const moegraph::Tokenizer& BpeTokenizer() {
  static const moegraph::Tokenizer* tokenizer = [] {
    moegraph::FixtureSpec spec;
    spec.n_vocab = 512;
    return Load(spec).release();
  }();
  return *tokenizer;
}

// SentencePiece: <unk>, <s>, </s>, the 256 byte tokens, U+2581, U+2581 before
// each letter, and the pairs of the letters a..e, scored by id.
const moegraph::Tokenizer& SpmTokenizer() {
  static const moegraph::Tokenizer* tokenizer = [] {
    static moegraph::FixtureVocab v;
    v.model = "llama";
    auto add = [](std::string text, moegraph::TokenType type) {
      v.scores.push_back(type == moegraph::TokenType::kNormal ? -static_cast<float>(v.tokens.size())
                                                              : 0.0f);
      v.tokens.push_back(std::move(text));
      v.types.push_back(static_cast<int32_t>(type));
    };
    add("<unk>", moegraph::TokenType::kUnknown);
    add("<s>", moegraph::TokenType::kControl);
    add("</s>", moegraph::TokenType::kControl);
    for (int b = 0; b < 256; ++b) add(absl::StrFormat("<0x%02X>", b), moegraph::TokenType::kByte);
    const std::string space = "\xe2\x96\x81";
    add(space, moegraph::TokenType::kNormal);
    for (char a = 'a'; a <= 'z'; ++a) add(space + a, moegraph::TokenType::kNormal);
    for (char a = 'a'; a <= 'e'; ++a) {
      for (char b = 'a'; b <= 'e'; ++b) add(std::string{a, b}, moegraph::TokenType::kNormal);
    }
    moegraph::FixtureSpec spec;
    spec.arch = moegraph::Arch::kMixtral;
    spec.vocab = &v;
    spec.n_vocab = static_cast<int>(v.tokens.size());
    return Load(spec).release();
  }();
  return *tokenizer;
}

void Check(const moegraph::Tokenizer& tokenizer, std::string_view text, bool valid) {
  const bool spm = tokenizer.vocab().model == moegraph::TokenizerModel::kLlama;
  for (const bool parse_special : {false, true}) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Tokenize(text, false, parse_special);
    if (ids.ok() != valid) std::abort();
    if (!ids.ok()) continue;
    for (int32_t id : *ids) {
      if (id < 0 || id >= tokenizer.vocab().size()) std::abort();
    }
    const std::string back = tokenizer.Detokenize(*ids, /*special=*/true);
    if (!spm && back != text) std::abort();
    if (spm && !parse_special &&
        back != absl::StrReplaceAll(absl::string_view(text.data(), text.size()),
                                    {{"\xe2\x96\x81", " "}})) {
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool valid = moegraph::FindInvalidUtf8(text) == std::string_view::npos;
  Check(BpeTokenizer(), text, valid);
  Check(SpmTokenizer(), text, valid);
  return 0;
}
