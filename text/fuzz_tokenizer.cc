// libFuzzer target: any bytes, tokenized with a fixture's byte-level vocabulary
// (special parsing on and off, BOS added or not): text that is not UTF-8 is an
// error, never a crash; every other text gives ids inside the vocabulary whose
// pieces spell the text back exactly. ASan/UBSan catch the rest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/vocab.h"

namespace {

// A fixture's vocabulary of 512: all 256 byte symbols, two-letter merges,
// <|endoftext|> and <|im_end|> (control), the qwen2 pre-tokenizer.
const moegraph::Tokenizer& FixtureTokenizer() {
  static const moegraph::Tokenizer* tokenizer = [] {
    moegraph::FixtureSpec spec;
    spec.n_vocab = 512;
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
    return t->release();
  }();
  return *tokenizer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const moegraph::Tokenizer& tokenizer = FixtureTokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool valid = moegraph::FindInvalidUtf8(text) == std::string_view::npos;
  for (const bool parse_special : {false, true}) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Tokenize(text, false, parse_special);
    if (ids.ok() != valid) std::abort();
    if (!ids.ok()) continue;
    for (int32_t id : *ids) {
      if (id < 0 || id >= tokenizer.vocab().size()) std::abort();
    }
    if (tokenizer.Detokenize(*ids, /*special=*/true) != text) std::abort();
  }
  return 0;
}
