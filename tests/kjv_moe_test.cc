// The trained model (models/kjv-moe-f16.gguf, tools/train-moe) against what
// llama.cpp makes of it (tests/data/kjv-moe/llama.json, written by
// tools/llama-crosscheck/kjv-moe.sh; no node here): its prompts tokenize to
// llama.cpp's ids, greedy decoding gives llama.cpp's 32 tokens on 20 prompts
// at f16 (oracle and CPU backend) and on 16 of them at q8_0 (the file
// `moegraph quantize` writes, CPU backend), `moegraph perplexity` of the held-out chapters is
// llama.cpp's within 0.1% (CPU backend over every chunk of 512, the oracle over
// four of 128), and the KL divergence of a q4_K copy from f16 is llama.cpp's
// within 5%. A trained model's margins make equal tokens meaningful, as random
// fixtures' near-ties do not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/forward.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/requantize.h"
#include "quality/logprobs.h"
#include "quality/perplexity.h"
#include "reference/oracle.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using testing_util::ProcessResult;
using testing_util::TempPath;

const std::string kModel = MOEGRAPH_SOURCE_DIR "/models/kjv-moe-f16.gguf";
const std::string kText = MOEGRAPH_SOURCE_DIR "/models/kjv-held-out.txt";

nlohmann::json Expected() {
  std::ifstream in(MOEGRAPH_SOURCE_DIR "/tests/data/kjv-moe/llama.json");
  return nlohmann::json::parse(in);
}

struct Loaded {
  std::unique_ptr<GgufFile> file;
  Model model;
};

std::unique_ptr<Loaded> Load(const std::string& path) {
  auto l = std::make_unique<Loaded>();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  l->file = std::move(*file);
  absl::StatusOr<Model> model = LoadModel(*l->file);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  l->model = std::move(*model);
  return l;
}

std::unique_ptr<Oracle> CpuForward(const Model& model, int max_ctx) {
  CpuForwardOptions options;
  options.threads = 1;
  absl::StatusOr<std::unique_ptr<Oracle>> f = CreateCpuForward(model, max_ctx, nullptr, options);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

// Each case's 32 greedy tokens after llama.cpp's prompt ids, from make(max_ctx):
// at least `at_least` of the 20 equal, and where one parts from llama.cpp's,
// the two tokens at the first difference within near_tie of each other in the
// engine's own distribution there (teacher-forced along llama.cpp's tokens):
// a near-tie, never a confident token of its own.
template <typename Make>
void ExpectGreedy(const nlohmann::json& cases, const char* what, int at_least, double near_tie,
                  Make make) {
  int equal = 0;
  for (const nlohmann::json& c : cases) {
    const std::vector<int32_t> prompt = c["prompt_ids"];
    const std::vector<int32_t> want = c["generated"];
    std::unique_ptr<Oracle> engine = make(static_cast<int>(prompt.size() + want.size()));
    ASSERT_NE(engine, nullptr);
    absl::StatusOr<std::vector<int32_t>> got =
        engine->Generate(prompt, static_cast<int>(want.size()));
    ASSERT_TRUE(got.ok()) << got.status();
    if (at_least == 20) {
      EXPECT_EQ(*got, want) << what << ": " << c["prompt"];
    }
    equal += *got == want;
    if (*got == want || got->size() != want.size()) continue;
    const size_t first =
        std::mismatch(got->begin(), got->end(), want.begin()).first - got->begin();
    std::vector<int32_t> forced = prompt;
    forced.insert(forced.end(), want.begin(), want.begin() + static_cast<std::ptrdiff_t>(first));
    std::unique_ptr<Oracle> fresh = make(static_cast<int>(forced.size()));
    ASSERT_NE(fresh, nullptr);
    absl::StatusOr<std::vector<float>> logits = fresh->ForwardLast(forced);
    ASSERT_TRUE(logits.ok()) << logits.status();
    const double ours = std::exp(TokenLogprob(*logits, (*got)[first]));
    const double theirs = std::exp(TokenLogprob(*logits, want[first]));
    std::printf("%s: %s parts at token %zu: %.4f (ours) against %.4f (llama.cpp's)\n", what,
                c["prompt"].get<std::string>().c_str(), first, ours, theirs);
    EXPECT_LT(std::fabs(ours - theirs), near_tie) << what << ": " << c["prompt"] << " token "
                                                  << first;
  }
  std::printf("%s: %d of 20 prompts' 32 greedy tokens are llama.cpp's\n", what, equal);
  EXPECT_GE(equal, at_least) << what;
}

TEST(KjvMoeTest, PromptsTokenizeToLlamaCppsIds) {
  const nlohmann::json expected = Expected();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(kModel);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(**file);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(*vocab);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  for (const nlohmann::json& c : expected["greedy"]["f16"]) {
    absl::StatusOr<std::vector<int32_t>> ids =
        (*tokenizer)->Tokenize(c["prompt"].get<std::string>(), true, true);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, c["prompt_ids"].get<std::vector<int32_t>>()) << c["prompt"];
  }
}

TEST(KjvMoeTest, GreedyTokensAreLlamaCppsAtF16AndQ8_0) {
  const nlohmann::json expected = Expected();
  std::unique_ptr<Loaded> f16 = Load(kModel);
  ASSERT_NE(f16, nullptr);
  ExpectGreedy(expected["greedy"]["f16"], "oracle f16", 20, 0.0, [&](int ctx) {
    absl::StatusOr<std::unique_ptr<Oracle>> o = Oracle::Create(f16->model, ctx);
    return o.ok() ? std::move(*o) : nullptr;
  });
  ExpectGreedy(expected["greedy"]["f16"], "cpu f16", 20, 0.0,
               [&](int ctx) { return CpuForward(f16->model, ctx); });
  const std::string q8 = TempPath("kjv-moe-q8_0.gguf");
  ASSERT_TRUE(RequantizeFile(*f16->file, GgmlType::kQ8_0, q8, nullptr).ok());
  std::unique_ptr<Loaded> q8_0 = Load(q8);
  ASSERT_NE(q8_0, nullptr);
  // At q8_0, 16 of 20 (2026-12-07, the reproducible retrain; the model before
  // it gave 20), each of the four parting at a near-tie of our own q8_0
  // distribution (within 0.015; 0.02 asserted). q8_0 moves whole experts:
  // against f16 it changes the top-4 set at 3.4% of (position, layer) rows, so
  // two q8_0 implementations whose activations round differently disagree by
  // about q8_0's own noise (issue 42's note: mean |dp| 0.0030 between the
  // engines' q8_0, 0.0045 and 0.0038 between each one's q8_0 and f16).
  ExpectGreedy(expected["greedy"]["q8_0"], "cpu q8_0", 16, 0.02,
               [&](int ctx) { return CpuForward(q8_0->model, ctx); });
}

// The oracle's perplexity over llama.json's second case (-c 128, 4 chunks).
TEST(KjvMoeTest, TheOraclesPerplexityIsLlamaCpps) {
  const nlohmann::json want = Expected()["perplexity"][1];
  const int n_ctx = want["n_ctx"], n_chunk = want["chunks"];
  std::unique_ptr<Loaded> f16 = Load(kModel);
  ASSERT_NE(f16, nullptr);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*f16->file);
  ASSERT_TRUE(vocab.ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(*vocab);
  ASSERT_TRUE(tokenizer.ok());
  std::ifstream in(kText);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Tokenize(text, true, false);
  ASSERT_TRUE(ids.ok());
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(f16->model, n_ctx);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  NllSums sums;
  const int n_vocab = f16->model.config.n_vocab;
  for (int c = 0; c < n_chunk; ++c) {
    (*oracle)->Reset();
    const std::vector<int32_t> chunk(ids->begin() + c * n_ctx, ids->begin() + (c + 1) * n_ctx);
    absl::StatusOr<std::vector<float>> logits = (*oracle)->Forward(chunk);
    ASSERT_TRUE(logits.ok()) << logits.status();
    for (int j = n_ctx / 2; j < n_ctx - 1; ++j) {
      sums.Add(TokenNll(absl::MakeConstSpan(logits->data() + int64_t{j} * n_vocab, n_vocab),
                        chunk[j + 1]));
    }
  }
  EXPECT_EQ(sums.count, want["scored"].get<int64_t>());
  EXPECT_NEAR(sums.Perplexity(), want["ppl"].get<double>(), 1e-3 * want["ppl"].get<double>());
}

double After(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  return at == std::string::npos ? NAN : std::stod(out.substr(at + label.size()));
}

// The perplexity of the held-out text under a unigram model fitted to that
// text itself: exp of its tokens' entropy, the least any unigram model scores.
double SelfUnigramPerplexity() {
  std::unique_ptr<Loaded> l = Load(kModel);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*l->file);
  EXPECT_TRUE(vocab.ok()) << vocab.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(std::move(*vocab));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::ifstream in(kText, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Tokenize(text, false, false);
  EXPECT_TRUE(ids.ok()) << ids.status();
  std::vector<double> counts(static_cast<size_t>(l->model.config.n_vocab), 0.0);
  for (const int32_t id : *ids) counts[static_cast<size_t>(id)] += 1;
  const double n = static_cast<double>(ids->size());
  double entropy = 0;
  for (const double c : counts) {
    if (c > 0) entropy -= c / n * std::log(c / n);
  }
  return std::exp(entropy);
}

TEST(KjvMoeTest, PerplexityOfTheHeldOutChaptersIsLlamaCpps) {
  const nlohmann::json want = Expected()["perplexity"][0];
  const ProcessResult r = testing_util::RunProcess(
      {MOEGRAPH_BIN, "perplexity", "-m", kModel, "-f", kText, "-c",
       std::to_string(want["n_ctx"].get<int>()), "--backend", "cpu"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double ppl = After(r.out, "Final estimate: PPL = ");
  EXPECT_NEAR(ppl, want["ppl"].get<double>(), 1e-3 * want["ppl"].get<double>()) << r.out;
  EXPECT_NE(r.err.find(absl::StrCat("[", want["chunks"].get<int>(), "]")), std::string::npos);
  // The model has learned: far below the best unigram model of the same text.
  const double unigram = SelfUnigramPerplexity();
  RecordProperty("perplexity", absl::StrCat(ppl));
  RecordProperty("self_unigram_perplexity", absl::StrCat(unigram));
  std::printf("held-out perplexity %.4f; the text's own unigram perplexity %.2f\n", ppl, unigram);
  EXPECT_LT(ppl, unigram / 4) << "unigram " << unigram;
}

// The instrument can fail: a copy with one tensor's signs flipped diverges from
// the base far more than a q8_0 copy does.
TEST(KjvMoeTest, ATensorPerturbedDivergesFarMoreThanQ8_0) {
  const std::string base = TempPath("kjv-moe-perturb.base");
  const std::string q8 = TempPath("kjv-moe-perturb-q8_0.gguf");
  const std::string bent = TempPath("kjv-moe-perturbed.gguf");
  ProcessResult r = testing_util::RunProcess(
      {MOEGRAPH_BIN, "perplexity", "-m", kModel, "-f", kText, "-c", "512", "--chunks", "2",
       "--backend", "cpu", "--kl-divergence-base", base});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing_util::RunProcess({MOEGRAPH_BIN, "quantize", kModel, q8, "q8_0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  {
    std::unique_ptr<Loaded> l = Load(kModel);
    const GgufTensor* t = l->file->FindTensor("blk.3.attn_output.weight");
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->ggml_type(), GgmlType::kF16);
    std::ifstream in(kModel, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const uint64_t at = l->file->data_offset() + t->offset;
    for (uint64_t i = 1; i < t->nbytes; i += 2) bytes[at + i] ^= static_cast<char>(0x80);
    std::ofstream out(bent, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  double kld[2];
  const std::string copies[2] = {q8, bent};
  for (int i = 0; i < 2; ++i) {
    r = testing_util::RunProcess({MOEGRAPH_BIN, "perplexity", "-m", copies[i], "--backend", "cpu",
                                  "--kl-divergence-base", base, "--kl-divergence"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    kld[i] = After(r.out, "Mean    KLD: ");
  }
  std::printf("mean KLD from f16: q8_0 %.6f, blk.3.attn_output.weight's signs flipped %.6f\n",
              kld[0], kld[1]);
  EXPECT_GT(kld[1], 20 * kld[0]) << "q8_0 " << kld[0] << ", perturbed " << kld[1];
  EXPECT_GT(kld[1], 0.05);
  for (const std::string& p : {base, q8, bent}) std::remove(p.c_str());
}

TEST(KjvMoeTest, TheKlDivergenceOfAQ4KCopyIsLlamaCpps) {
  const nlohmann::json want = Expected()["kld_q4_K"];
  const std::string base = TempPath("kjv-moe.base"), q4 = TempPath("kjv-moe-q4_K.gguf");
  const std::string n_ctx = std::to_string(want["n_ctx"].get<int>());
  const std::string chunks = std::to_string(want["chunks"].get<int>());
  ProcessResult r = testing_util::RunProcess(
      {MOEGRAPH_BIN, "perplexity", "-m", kModel, "-f", kText, "-c", n_ctx, "--chunks", chunks,
       "--backend", "cpu", "--kl-divergence-base", base});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing_util::RunProcess({MOEGRAPH_BIN, "quantize", kModel, q4, "q4_K"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing_util::RunProcess({MOEGRAPH_BIN, "perplexity", "-m", q4, "--backend", "cpu",
                                "--kl-divergence-base", base, "--kl-divergence"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double kld = After(r.out, "Mean    KLD: ");
  EXPECT_NEAR(kld, want["mean_kld"].get<double>(), 0.05 * want["mean_kld"].get<double>())
      << r.out;
  EXPECT_NEAR(After(r.out, "Same top p: "), 100 * want["same_top"].get<double>(), 1.0) << r.out;
}

}  // namespace
}  // namespace moegraph
