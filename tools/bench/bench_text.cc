// Tokenizing 1 MiB of text with a real vocabulary (tools/fetch-vocab.sh): the
// corpus of tests/data/tokenizer/ repeated, special parsing on, as a prompt is
// tokenized. tools/llama-crosscheck/tokenizer-speed.sh runs it beside
// llama.cpp's tokenizer on the same text. Skipped without the vocabulary.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

constexpr size_t kTextBytes = size_t{1} << 20;

// The corpus joined by newlines, repeated, cut to 1 MiB at a line end.
std::string MiBOfCorpus() {
  std::ifstream in(MOEGRAPH_SOURCE_DIR "/tests/data/tokenizer/corpus.json");
  const nlohmann::json corpus = nlohmann::json::parse(in, nullptr, false);
  if (!corpus.is_array()) return "";
  const std::string joined = absl::StrJoin(corpus.get<std::vector<std::string>>(), "\n") + "\n";
  std::string text;
  while (text.size() + joined.size() <= kTextBytes) text += joined;
  return text;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadVocab(const std::string& name) {
  const char* dir = std::getenv("MOEGRAPH_VOCAB");
  const std::string json = absl::StrCat(dir != nullptr ? dir : MOEGRAPH_SOURCE_DIR "/vocab", "/",
                                        name, "/tokenizer.json");
  if (!std::filesystem::exists(json)) {
    return absl::NotFoundError(json + " is missing: tools/fetch-vocab.sh fetches it");
  }
  absl::StatusOr<FixtureVocab> hf = ReadHfTokenizer(json);
  if (!hf.ok()) return hf.status();
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_expert = 2;
  spec.n_expert_used = 1;
  spec.vocab = &*hf;
  spec.n_vocab = static_cast<int>(hf->tokens.size());
  absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(spec);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(name + ".gguf", *bytes);
  if (!file.ok()) return file.status();
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(**file);
  if (!vocab.ok()) return vocab.status();
  return Tokenizer::Create(std::move(*vocab));
}

void BM_Tokenize1MiB(benchmark::State& state, const char* name) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadVocab(name);
  const std::string text = MiBOfCorpus();
  if (!tokenizer.ok() || text.empty()) {
    state.SkipWithError(tokenizer.ok() ? "corpus.json is unreadable"
                                       : std::string(tokenizer.status().message()).c_str());
    return;
  }
  size_t ids = 0;
  for (auto _ : state) {
    absl::StatusOr<std::vector<int32_t>> out = (*tokenizer)->Tokenize(text, false, true);
    if (!out.ok()) {
      state.SkipWithError(std::string(out.status().message()).c_str());
      return;
    }
    ids = out->size();
    benchmark::DoNotOptimize(out->data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["ids"] = static_cast<double>(ids);
  state.counters["text_bytes"] = static_cast<double>(text.size());
}

BENCHMARK_CAPTURE(BM_Tokenize1MiB, qwen3, "qwen3")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Tokenize1MiB, mistral, "mistral")->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph
