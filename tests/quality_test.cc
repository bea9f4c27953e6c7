// quality/perplexity.h: llama-perplexity's arithmetic and base-file format.
#include "quality/perplexity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::MessageHas;

std::vector<float> RandomLogits(int n, uint32_t seed, float spread = 4) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, spread);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

double ReferenceNll(const std::vector<float>& logits, int tok) {
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l));
  return std::log(sum) - logits[tok];
}

TEST(PerplexityTest, TokenNllIsTheNegativeLogSoftmax) {
  const std::vector<float> logits = RandomLogits(1000, 1);
  for (int tok : {0, 17, 999}) {
    EXPECT_NEAR(TokenNll(logits, tok), ReferenceNll(logits, tok), 1e-5) << tok;
  }
  NllSums sums;
  sums.Add(1.0);
  sums.Add(3.0);
  EXPECT_DOUBLE_EQ(sums.Perplexity(), std::exp(2.0));
  // The error: exp(mean) x the standard error of the mean, sqrt(var / (n - 1)) = 1.
  EXPECT_DOUBLE_EQ(sums.PerplexityError(), std::exp(2.0) * 1.0);
}

TEST(PerplexityTest, ChunksNeedTwoOfThemAndAScoredHalf) {
  EXPECT_EQ(*PerplexityChunks(2048, 512, -1, "t.txt"), 4);
  EXPECT_EQ(*PerplexityChunks(2100, 512, 2, "t.txt"), 2);
  EXPECT_EQ(*PerplexityChunks(2100, 512, 9, "t.txt"), 4);
  EXPECT_TRUE(MessageHas(PerplexityChunks(1000, 512, -1, "t.txt").status(), "t.txt: 1000 tokens; perplexity at -c 512 needs at least 1024"));
  EXPECT_TRUE(MessageHas(PerplexityChunks(100, 2, -1, "t.txt").status(), "-c 2"));
  EXPECT_TRUE(MessageHas(PerplexityChunks(2048, 512, 0, "t.txt").status(), "--chunks 0"));
}

TEST(PerplexityTest, ACompressedRowKeepsTheTopSixteenNats) {
  const int n = 301;
  const std::vector<float> logits = RandomLogits(n, 2);
  std::vector<uint16_t> row(CompressedRowWidth(n));
  EXPECT_EQ(row.size(), 2u * 151 + 4);
  const double nll = CompressLogProbs(logits, 5, row.data());
  EXPECT_NEAR(nll, ReferenceNll(logits, 5), 1e-5);
  float scale, min_log_prob;
  std::memcpy(&scale, row.data(), 4);
  std::memcpy(&min_log_prob, row.data() + 2, 4);
  for (int i = 0; i < n; ++i) {
    const double log_p = -ReferenceNll(logits, i);
    if (log_p < min_log_prob) continue;
    EXPECT_NEAR(scale * row[4 + i] + min_log_prob, log_p, scale) << i;
  }
}

TEST(PerplexityTest, KlDivergenceIsNearZeroAgainstItselfAndGrowsWithAPerturbation) {
  const int n = 500, positions = 120;
  KlStats same, perturbed;
  std::vector<uint16_t> row(CompressedRowWidth(n));
  for (int p = 0; p < positions; ++p) {
    // Logits within 16 nats of their best: the base row keeps every token's.
    const std::vector<float> logits = RandomLogits(n, 100 + p, 2);
    CompressLogProbs(logits, p % n, row.data());
    AccumulateKl(logits, row.data(), p % n, &same);
    std::vector<float> noisy = logits;
    const std::vector<float> noise = RandomLogits(n, 900 + p, 0.5f);
    for (int i = 0; i < n; ++i) noisy[i] += noise[i];
    AccumulateKl(noisy, row.data(), p % n, &perturbed);
  }
  EXPECT_EQ(same.count, positions);
  EXPECT_EQ(same.n_same_top, positions);
  EXPECT_LT(same.sum_kld / positions, 1e-6);
  EXPECT_NEAR(same.sum_nll, same.sum_nll_base, 1e-3 * positions);
  EXPECT_GT(perturbed.sum_kld / positions, 0.05);
  EXPECT_LT(perturbed.n_same_top, positions);
  const std::string summary = KlSummary(perturbed);
  EXPECT_NE(summary.find("Mean    KLD:"), std::string::npos) << summary;
  EXPECT_NE(summary.find("Same top p:"), std::string::npos) << summary;
  EXPECT_NE(KlChunkLine(1, perturbed).find("±"), std::string::npos);
  KlStats few;
  AccumulateKl(RandomLogits(n, 3), row.data(), 0, &few);
  EXPECT_EQ(KlSummary(few), "");  // llama.cpp prints no statistics under 100 positions
}

TEST(PerplexityTest, ABaseFileReadsBackAndAWrongOneIsNamed) {
  const std::string dir = testing::TempDir();
  const std::string path = dir + "/base.kld";
  const int n_ctx = 8, n_vocab = 5, n_chunk = 2;
  std::vector<int32_t> tokens(n_ctx * n_chunk);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % n_vocab);
  const size_t chunk_rows = ScoredPositions(n_ctx) * CompressedRowWidth(n_vocab);
  std::vector<uint16_t> rows(chunk_rows);
  {
    absl::StatusOr<BaseLogitsWriter> w =
        BaseLogitsWriter::Create(path, n_ctx, n_vocab, tokens, n_chunk);
    ASSERT_TRUE(w.ok()) << w.status();
    for (int c = 0; c < n_chunk; ++c) {
      for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint16_t>(c * 1000 + i);
      ASSERT_TRUE(w->Write(rows).ok());
    }
    ASSERT_TRUE(w->Close().ok());
  }
  absl::StatusOr<BaseLogits> b = BaseLogits::Read(path, n_vocab);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->n_ctx, n_ctx);
  EXPECT_EQ(b->n_chunk, n_chunk);
  EXPECT_EQ(b->tokens, tokens);
  EXPECT_EQ(b->Row(1, 0)[0], 1000);
  EXPECT_EQ(b->Row(1, 1)[0], 1000 + CompressedRowWidth(n_vocab));

  EXPECT_TRUE(MessageHas(BaseLogits::Read(path, 6).status(), "its vocabulary has 5 tokens, the model's 6"));
  EXPECT_TRUE(MessageHas(BaseLogits::Read(dir + "/none.kld", 5).status(), "none.kld"));
  // Truncated: the last chunk's rows cut.
  std::FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  std::fclose(f);
  ASSERT_EQ(truncate(path.c_str(), size - 2), 0);
  EXPECT_TRUE(MessageHas(BaseLogits::Read(path, 5).status(), "truncated"));
  // Not a base file.
  f = std::fopen(path.c_str(), "wb");
  std::fputs("GGUF and more bytes than a header", f);
  std::fclose(f);
  EXPECT_TRUE(MessageHas(BaseLogits::Read(path, 5).status(), "_logits_"));
}

}  // namespace
}  // namespace moegraph
