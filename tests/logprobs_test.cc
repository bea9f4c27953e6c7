// quality/logprobs.h: a position's log-probabilities (the token's own and the
// likeliest), and ScoreTokens's walk over a text in pieces on a model whose
// logits are a known function of the position and its token.
#include "quality/logprobs.h"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "quality/perplexity.h"
#include "reference/oracle.h"

namespace moegraph {
namespace {

TEST(LogprobsTest, TheTokensOwnAndTheLikeliestWithTiesToTheLowerId) {
  const std::vector<float> logits = {1, 3, 3, 0, -2};
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l));
  const TokenLogprobs t = LogprobsAt(logits, 3, 3);
  EXPECT_EQ(t.token, 3);
  EXPECT_NEAR(t.logprob, -std::log(sum), 1e-6);  // expf in float
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 1);  // 1 and 2 tie: the lower id first
  EXPECT_EQ(t.top[1].first, 2);
  EXPECT_EQ(t.top[2].first, 0);
  EXPECT_NEAR(t.top[0].second, 3 - std::log(sum), 1e-6);
  // Each value is the token's own, bit for bit (lm-evaluation-harness's
  // is_greedy compares the two), and perplexity's TokenNll negated.
  EXPECT_EQ(LogprobsAt(logits, 1, 1).logprob, LogprobsAt(logits, 1, 1).top[0].second);
  EXPECT_EQ(LogprobsAt(logits, 2, 0).logprob, -TokenNll(logits, 2));
  EXPECT_TRUE(LogprobsAt(logits, 2, 0).top.empty());
  EXPECT_EQ(LogprobsAt(logits, 2, 9).top.size(), logits.size());  // at most the vocabulary
}

constexpr int kVocab = 11;

// Logits at position p a function of p and the token there; it logs what it
// is asked to feed.
class PositionModel final : public Oracle {
 public:
  static float Logit(int position, int32_t token, int v) {
    return std::sin(0.7f * position + 1.3f * token + 0.37f * v * v) * 4;
  }
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) override {
    fed.emplace_back(n_past_, static_cast<int>(tokens.size()));
    std::vector<float> logits;
    for (const int32_t t : tokens) {
      for (int v = 0; v < kVocab; ++v) logits.push_back(Logit(n_past_, t, v));
      ++n_past_;
    }
    return logits;
  }
  int n_past() const override { return n_past_; }
  void Truncate(int n_keep) override { n_past_ = std::min(n_keep, n_past_); }

  std::vector<std::pair<int, int>> fed;  // (first position, count) per Forward
  int n_past_ = 0;
};

TEST(LogprobsTest, ScoreTokensFeedsFromStartInPiecesAndScoresFromFrom) {
  const std::vector<int32_t> tokens = {3, 9, 0, 4, 4, 10, 7, 1, 2, 5};
  for (const int piece : {1, 3, 100}) {
    PositionModel model;
    model.n_past_ = 8;  // a cache of 8 positions, kept below start
    const absl::StatusOr<std::vector<TokenLogprobs>> scored =
        ScoreTokens(model, tokens, /*start=*/2, /*from=*/4, /*top_n=*/2, piece);
    ASSERT_TRUE(scored.ok()) << scored.status();
    ASSERT_EQ(scored->size(), tokens.size() - 4) << piece;
    for (size_t i = 4; i < tokens.size(); ++i) {
      // Position i - 1's logits predict token i.
      std::vector<float> row(kVocab);
      for (int v = 0; v < kVocab; ++v) row[v] = PositionModel::Logit(i - 1, tokens[i - 1], v);
      const TokenLogprobs want = LogprobsAt(row, tokens[i], 2);
      const TokenLogprobs& got = (*scored)[i - 4];
      EXPECT_EQ(got.token, tokens[i]);
      EXPECT_EQ(got.logprob, want.logprob) << "piece " << piece << ", token " << i;
      EXPECT_EQ(got.top, want.top) << "piece " << piece << ", token " << i;
    }
    // Fed from position 2 to the last token but one, at most piece at a time.
    EXPECT_EQ(model.fed.front().first, 2);
    int next = 2;
    for (const auto& [first, count] : model.fed) {
      EXPECT_EQ(first, next);
      EXPECT_LE(count, piece);
      next += count;
    }
    EXPECT_EQ(next, static_cast<int>(tokens.size()) - 1);
    EXPECT_EQ(model.n_past(), static_cast<int>(tokens.size()) - 1);
  }
  PositionModel model;
  EXPECT_FALSE(ScoreTokens(model, tokens, 0, 0, 1, 8).ok());   // from 0: nothing before it
  EXPECT_FALSE(ScoreTokens(model, tokens, 4, 4, 1, 8).ok());   // start must be below from
  EXPECT_FALSE(ScoreTokens(model, tokens, 0, 11, 1, 8).ok());  // past the tokens
}

}  // namespace
}  // namespace moegraph
