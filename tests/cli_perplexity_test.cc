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
#include "loader/status_util.h"
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

// The text's tokens as the file's tokenizer makes them, BOS first.
absl::StatusOr<std::vector<int32_t>> Tokens(const testing_util::LoadedModel& m,
                                            const std::string& text) {
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*m.file));
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Create(std::move(vocab)));
  return tokenizer->Tokenize(text, true, false);
}

// The oracle (f64) over the chunks perplexity scores: the tokens in chunks of
// kCtx from an empty context, positions kCtx/2 .. kCtx-2.
absl::StatusOr<NllSums> OracleSums(const Model& model, const std::vector<int32_t>& ids) {
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Oracle> oracle, Oracle::Create(model, kCtx));
  NllSums sums;
  const int n_vocab = model.config.n_vocab;
  for (size_t c = 0; (c + 1) * kCtx <= ids.size(); ++c) {
    oracle->Reset();
    const std::vector<int32_t> chunk(ids.begin() + c * kCtx, ids.begin() + (c + 1) * kCtx);
    MG_ASSIGN_OR_RETURN(std::vector<float> logits, oracle->Forward(chunk));
    for (int j = kCtx / 2; j < kCtx - 1; ++j) {
      sums.Add(TokenNll(absl::MakeConstSpan(logits.data() + j * n_vocab, n_vocab), chunk[j + 1]));
    }
  }
  return sums;
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

  absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> m = testing_util::LoadFixture(
      Spec(GgmlType::kF32));
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<std::vector<int32_t>> ids = Tokens(**m, text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  absl::StatusOr<NllSums> oracle_sums = OracleSums((*m)->model, *ids);
  ASSERT_TRUE(oracle_sums.ok()) << oracle_sums.status();
  const NllSums& sums = *oracle_sums;
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

// --n-expert-used 1: each token runs its router's best expert alone, as the
// oracle runs the model with its top-k set to 1; the routing record holds one
// expert a layer, the first layer's the default run's first (its input does
// not depend on the experts); the file's own top-k changes nothing; more than
// it, or a negative count, is refused naming the flag and the file.
TEST_F(CliPerplexityTest, FewerExpertsATokenAreTheRoutersBestAsTheOracleRunsThem) {
  const std::string text = Text(200);
  const std::string text_path = WriteText("fewer.txt", text);
  const std::string one_path = TempPath("fewer-1.trace"), all_path = TempPath("fewer-2.trace");
  const std::vector<std::string> args = {"-m", fixture_path(), "-f", text_path, "-c",
                                         std::to_string(kCtx)};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = args;
    all.insert(all.end(), more.begin(), more.end());
    return Perplexity(all);
  };
  const ProcessResult one = with({"--n-expert-used", "1", "--record-routing", one_path});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  EXPECT_NE(one.err.find("experts a token: 1 of the model's 2"), std::string::npos) << one.err;
  const ProcessResult all = with({"--record-routing", all_path});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  const ProcessResult same = with({"--n-expert-used", "2"});
  ASSERT_EQ(same.exit_code, 0) << same.err;
  const double ppl_one = After(one.out, "Final estimate: PPL = ");
  const double ppl_all = After(all.out, "Final estimate: PPL = ");
  EXPECT_NE(ppl_one, ppl_all);
  EXPECT_EQ(After(same.out, "Final estimate: PPL = "), ppl_all);

  absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> m = testing_util::LoadFixture(
      Spec(GgmlType::kF32));
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<std::vector<int32_t>> ids = Tokens(**m, text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  (*m)->model.config.n_expert_used = 1;
  absl::StatusOr<NllSums> sums = OracleSums((*m)->model, *ids);
  ASSERT_TRUE(sums.ok()) << sums.status();
  EXPECT_NEAR(ppl_one, sums->Perplexity(), 1e-3 * sums->Perplexity());

  absl::StatusOr<RoutingTrace> first = ReadTrace(one_path), both = ReadTrace(all_path);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(first->k, 1);
  EXPECT_EQ(both->k, 2);
  ASSERT_EQ(first->n_steps, both->n_steps);
  ASSERT_GT(first->n_steps, 0);
  for (int64_t step = 0; step < first->n_steps; ++step) {
    EXPECT_EQ(first->row(step, 0)[0], both->row(step, 0)[0]) << step;
  }

  for (const auto& [count, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"3", "--n-expert-used 3 must be at most " + fixture_path() + "'s top-k, 2"},
           {"-1", "--n-expert-used -1 must be 1 or more"}}) {
    const ProcessResult refused = with({"--n-expert-used", count});
    EXPECT_NE(refused.exit_code, 0);
    EXPECT_NE(refused.err.find(message), std::string::npos) << refused.err;
  }
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
