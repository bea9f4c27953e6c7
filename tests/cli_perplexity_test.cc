// `moegraph perplexity` as a user runs it, on fixtures with the synthetic
// byte-level vocabulary: the perplexity equals the oracle's sum over the same
// chunks (and its routing record holds every position), a saved base reads
// back as KL divergence zero against itself and grows with a coarser copy of
// the model, and bad input is refused naming the file before any weight is read.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "loader/fixture.h"
#include "loader/ggml_type.h"
#include "quality/perplexity.h"
#include "reference/oracle.h"
#include "residency/trace.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using testing_util::ProcessResult;
using testing_util::TempPath;

constexpr int kCtx = 32;

ProcessResult Perplexity(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOEGRAPH_BIN, "perplexity", "--backend", "cpu", "-t", "1"};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing_util::RunProcess(argv);
}

// Text of about n bytes over the fixture's byte vocabulary, not periodic.
std::string Text(int n) {
  std::string s;
  uint32_t x = 12345;
  while (static_cast<int>(s.size()) < n) {
    x = x * 1103515245u + 12345u;
    s += "abcdefgh ijklmnop,qrstuvwxyz.\n"[(x >> 16) % 30];
  }
  return s;
}

std::string WriteText(const std::string& name, const std::string& text) {
  const std::string path = TempPath(name);
  std::ofstream(path) << text;
  return path;
}

// The number after `label` in out (the first match), NaN when absent.
double After(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return NAN;
  return std::stod(out.substr(at + label.size()));
}

FixtureSpec Spec(GgmlType type) {
  FixtureSpec spec;
  spec.dense_type = type;
  spec.expert_type = type;
  spec.router_skew = 1;
  return spec;
}

class CliPerplexityTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() { WriteSuiteFixture(Spec(GgmlType::kF32), "cli_ppl.gguf"); }
};

TEST_F(CliPerplexityTest, ThePerplexityIsTheOraclesOverTheSameChunks) {
  const std::string text = Text(200);
  const std::string text_path = WriteText("ppl.txt", text);
  const ProcessResult r =
      Perplexity({"-m", fixture_path(), "-f", text_path, "-c", std::to_string(kCtx)});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("[1]"), std::string::npos) << r.err;  // progress on stderr
  const double printed = After(r.out, "Final estimate: PPL = ");
  ASSERT_FALSE(std::isnan(printed)) << r.out;

  // The oracle (f64) over the chunks perplexity scores: the text's tokens in
  // chunks of kCtx from an empty context, positions kCtx/2 .. kCtx-2.
  absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> m = testing_util::LoadFixture(
      Spec(GgmlType::kF32));
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*(*m)->file);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(*vocab);
  ASSERT_TRUE(tokenizer.ok());
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Tokenize(text, true, false);
  ASSERT_TRUE(ids.ok());
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create((*m)->model, kCtx);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  NllSums sums;
  const int n_vocab = (*m)->model.config.n_vocab;
  for (size_t c = 0; (c + 1) * kCtx <= ids->size(); ++c) {
    (*oracle)->Reset();
    const std::vector<int32_t> chunk(ids->begin() + c * kCtx, ids->begin() + (c + 1) * kCtx);
    absl::StatusOr<std::vector<float>> logits = (*oracle)->Forward(chunk);
    ASSERT_TRUE(logits.ok()) << logits.status();
    for (int j = kCtx / 2; j < kCtx - 1; ++j) {
      sums.Add(TokenNll(absl::MakeConstSpan(logits->data() + j * n_vocab, n_vocab), chunk[j + 1]));
    }
  }
  EXPECT_NEAR(printed, sums.Perplexity(), 1e-3 * sums.Perplexity());
  EXPECT_NEAR(After(r.out, "+/- "), sums.PerplexityError(), 2e-3 * sums.PerplexityError());

  // --record-routing: every position of every chunk, k experts a layer.
  const std::string trace_path = TempPath("ppl-routing.jsonl");
  const ProcessResult traced =
      Perplexity({"-m", fixture_path(), "-f", text_path, "-c", std::to_string(kCtx),
                  "--record-routing", trace_path});
  ASSERT_EQ(traced.exit_code, 0) << traced.err;
  absl::StatusOr<RoutingTrace> trace = ReadTrace(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->n_steps, static_cast<int64_t>(ids->size() / kCtx * kCtx));
  EXPECT_EQ(trace->n_layer, 2);
  EXPECT_EQ(trace->k, 2);
  for (int64_t step = 0; step < trace->n_steps; ++step) {
    ASSERT_TRUE(trace->present(step, 0) && trace->present(step, 1)) << step;
  }

  // --chunks 2 scores two chunks' positions: another value than all of them.
  const ProcessResult two =
      Perplexity({"-m", fixture_path(), "-f", text_path, "-c", std::to_string(kCtx), "--chunks",
                  "2"});
  ASSERT_EQ(two.exit_code, 0) << two.err;
  EXPECT_NE(two.err.find("[2]"), std::string::npos);
  EXPECT_EQ(two.err.find("[3]"), std::string::npos) << two.err;
}

TEST_F(CliPerplexityTest, AModelAgainstItsOwnBaseHasNoDivergenceAndACoarserCopyHasSome) {
  const std::string text_path = WriteText("kl.txt", Text(400));
  const std::string base = TempPath("kl.base");
  const ProcessResult saved = Perplexity({"-m", fixture_path(), "-f", text_path, "-c",
                                          std::to_string(kCtx), "--kl-divergence-base", base});
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  absl::StatusOr<BaseLogits> read = BaseLogits::Read(base, 256);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->n_ctx, kCtx);

  const ProcessResult same = Perplexity(
      {"-m", fixture_path(), "--kl-divergence-base", base, "--kl-divergence"});
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_LT(std::fabs(After(same.out, "Mean    KLD: ")), 1e-5) << same.out;
  EXPECT_DOUBLE_EQ(After(same.out, "Same top p: "), 100.0) << same.out;

  double previous = 0;
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    const std::string copy = TempPath("kl-copy.gguf");
    ASSERT_TRUE(WriteFixture(Spec(type), copy).ok());
    const ProcessResult r =
        Perplexity({"-m", copy, "--kl-divergence-base", base, "--kl-divergence"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const double kld = After(r.out, "Mean    KLD: ");
    EXPECT_GT(kld, 10 * previous + 1e-6) << ggml_type_name(static_cast<uint32_t>(type)) << "\n" << r.out;
    previous = kld;
  }
}

TEST_F(CliPerplexityTest, BadInputIsNamedBeforeTheWeightsAreRead) {
  const std::string short_text = WriteText("short.txt", Text(40));
  ProcessResult r = Perplexity({"-m", fixture_path(), "-f", short_text, "-c", "32"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("short.txt"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("needs at least 64"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("backend cpu"), std::string::npos) << r.err;  // nothing loaded

  r = Perplexity({"-m", fixture_path(), "--kl-divergence-base", TempPath("absent.base"),
                  "--kl-divergence"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("absent.base"), std::string::npos) << r.err;

  r = Perplexity({"-m", fixture_path(), "--kl-divergence"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--kl-divergence needs --kl-divergence-base"), std::string::npos) << r.err;

  // A base written by a model of another vocabulary size.
  FixtureSpec other = Spec(GgmlType::kF32);
  other.n_vocab = 300;
  const std::string other_path = TempPath("other-vocab.gguf");
  ASSERT_TRUE(WriteFixture(other, other_path).ok());
  const std::string base = TempPath("other.base");
  r = Perplexity({"-m", other_path, "-f", WriteText("o.txt", Text(200)), "-c", "32",
                  "--kl-divergence-base", base});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Perplexity({"-m", fixture_path(), "--kl-divergence-base", base, "--kl-divergence"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("other.base: its vocabulary has 300 tokens, the model's 256"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("backend cpu"), std::string::npos) << r.err;

  r = Perplexity({"-m", fixture_path(), "-f", short_text, "-b", "48", "-c", "32"});
  EXPECT_EQ(r.exit_code, 1);
}

}  // namespace
}  // namespace moegraph
