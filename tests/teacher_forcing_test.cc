// TeacherForcedExperts: the oracle routed by a recorded choice.
#include "reference/teacher_forcing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "loader/fixture.h"
#include "reference/ops.h"
#include "reference/oracle.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BitEqual;
using testing_util::LoadedModel;
using testing_util::LoadFixture;
using testing_util::MessageHas;

// The oracle's own routing in the record's layout (k ids per layer per row,
// rows in order, a dense layer's -1), with each (row, layer)'s scores.
class RecordingExperts final : public ExpertProvider {
 public:
  RecordingExperts(const Model& model, int n_rows)
      : model_(model),
        own_(model),
        next_row_(static_cast<size_t>(model.config.n_layer), 0),
        routing(static_cast<size_t>(n_rows * model.config.n_layer * model.config.n_expert_used),
                -1),
        probs(static_cast<size_t>(n_rows * model.config.n_layer)) {}

  void Provide(int layer, absl::Span<const int32_t> experts,
               absl::Span<ExpertWeights> weights) override {
    own_.Provide(layer, experts, weights);
  }
  void Route(int layer, absl::Span<const float> row_probs, absl::Span<int32_t> experts,
             absl::Span<double> /*weights*/) override {
    const size_t row = next_row_[static_cast<size_t>(layer)]++;
    const size_t at = row * static_cast<size_t>(model_.config.n_layer) + static_cast<size_t>(layer);
    std::copy(experts.begin(), experts.end(), routing.begin() + at * experts.size());
    probs[at].assign(row_probs.begin(), row_probs.end());
  }

 private:
  const Model& model_;
  ModelExpertProvider own_;
  std::vector<size_t> next_row_;

 public:
  std::vector<int32_t> routing;
  std::vector<std::vector<float>> probs;  // [row * n_layer + layer]; empty for a dense layer
};

struct ForcingCase {
  const char* name;
  Arch arch;  // one of each gating: softmax, gpt-oss's softmax of the k, glm's sigmoid + bias
};

void PrintTo(const ForcingCase& c, std::ostream* os) { *os << c.name; }

class TeacherForcingTest : public ::testing::TestWithParam<ForcingCase> {
 protected:
  void SetUp() override {
    FixtureSpec spec;
    spec.arch = GetParam().arch;
    spec.n_layer = 3;
    spec.n_vocab = 128;
    spec.router_skew = 1.0f;
    spec.seed = 3;
    absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = std::move(*loaded);
    const Model& model = loaded_->model;
    RecordingExperts recorder(model, static_cast<int>(kPrompt.size()));
    absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(model, 16, &recorder);
    ASSERT_TRUE(oracle.ok()) << oracle.status();
    absl::StatusOr<std::vector<float>> logits = (*oracle)->Forward(kPrompt);
    ASSERT_TRUE(logits.ok()) << logits.status();
    own_logits_ = *logits;
    own_routing_ = recorder.routing;
    probs_ = recorder.probs;
  }

  // The oracle's logits over kPrompt routed by routing, and forced's status.
  std::vector<float> Forced(const std::vector<int32_t>& routing, double near_tie,
                            TeacherForcedExperts** out_forced = nullptr) {
    forced_ = std::make_unique<TeacherForcedExperts>(loaded_->model, routing, near_tie);
    if (out_forced != nullptr) *out_forced = forced_.get();
    absl::StatusOr<std::unique_ptr<Oracle>> oracle =
        Oracle::Create(loaded_->model, 16, forced_.get());
    EXPECT_TRUE(oracle.ok()) << oracle.status();
    if (!oracle.ok()) return {};
    absl::StatusOr<std::vector<float>> logits = (*oracle)->Forward(kPrompt);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *logits : std::vector<float>();
  }

  // The MoE layer and row whose k-th choice is replaced; the expert that
  // replaces it, the one of lowest score (gate value plus score bias).
  struct Swap {
    int row = 0, layer = 0, expert = -1;
  };
  Swap LowestScoreSwap() const {
    const Model& model = loaded_->model;
    Swap s;
    s.row = 5;
    s.layer = model.config.n_layer - 1;
    const std::vector<float>& p = probs_[s.row * model.config.n_layer + s.layer];
    const GgufTensor* bias = model.layers[s.layer].score_b;
    std::vector<float> score = p;
    if (bias != nullptr) {
      const std::vector<float> b = TensorToFloat(*bias);
      for (size_t e = 0; e < score.size(); ++e) score[e] += b[e];
    }
    s.expert = static_cast<int>(std::min_element(score.begin(), score.end()) - score.begin());
    return s;
  }
  size_t RecordAt(const Swap& s) const {
    const ModelConfig& cfg = loaded_->model.config;
    return static_cast<size_t>((s.row * cfg.n_layer + s.layer) * cfg.n_expert_used +
                               cfg.n_expert_used - 1);
  }

  const std::vector<int32_t> kPrompt = {3, 17, 101, 42, 42, 0, 127, 64};
  std::unique_ptr<LoadedModel> loaded_;
  std::unique_ptr<TeacherForcedExperts> forced_;
  std::vector<float> own_logits_;
  std::vector<int32_t> own_routing_;
  std::vector<std::vector<float>> probs_;
};

TEST_P(TeacherForcingTest, ItsOwnRoutingGivesTheSameBits) {
  TeacherForcedExperts* forced = nullptr;
  const std::vector<float> logits = Forced(own_routing_, kNearTie, &forced);
  ASSERT_TRUE(forced->status().ok()) << forced->status();
  EXPECT_TRUE(BitEqual(logits, own_logits_));
  const ModelConfig& cfg = loaded_->model.config;
  EXPECT_EQ(forced->rows(), static_cast<int>(kPrompt.size()) * cfg.n_moe_layer());
  EXPECT_EQ(forced->differing_rows(), 0);
  EXPECT_EQ(forced->worst_gap(), 0.0);
}

TEST_P(TeacherForcingTest, AFarChoiceIsRefusedNamingItsRowLayerAndExpert) {
  const Swap s = LowestScoreSwap();
  std::vector<int32_t> routing = own_routing_;
  routing[RecordAt(s)] = s.expert;
  TeacherForcedExperts* forced = nullptr;
  Forced(routing, kNearTie, &forced);
  EXPECT_TRUE(MessageHas(forced->status(), absl::StrFormat("row %d layer %d: the engine chose "
                                                           "expert %d",
                                                           s.row, s.layer, s.expert)))
      << forced->status();
}

TEST_P(TeacherForcingTest, AnAcceptedChoiceIsTakenWithTheOraclesWeights) {
  const Swap s = LowestScoreSwap();
  std::vector<int32_t> routing = own_routing_;
  routing[RecordAt(s)] = s.expert;
  TeacherForcedExperts* forced = nullptr;
  const std::vector<float> logits = Forced(routing, 1.0, &forced);
  ASSERT_TRUE(forced->status().ok()) << forced->status();
  EXPECT_EQ(forced->differing_rows(), 1);
  EXPECT_GT(forced->worst_gap(), kNearTie);
  EXPECT_LE(forced->worst_gap(), 1.0);
  // Rows before the swapped one keep their bits; the swapped row's change.
  const size_t n_vocab = loaded_->model.config.n_vocab;
  const size_t before = static_cast<size_t>(s.row) * n_vocab;
  EXPECT_TRUE(std::equal(logits.begin(), logits.begin() + before, own_logits_.begin()));
  EXPECT_FALSE(std::equal(logits.begin() + before, logits.begin() + before + n_vocab,
                          own_logits_.begin() + before));
  // The swapped row's weights are ChosenWeights of the oracle's own gate
  // values for the forced ids, as a provider around the forcing one sees them.
  struct Spy final : ExpertProvider {
    TeacherForcedExperts* inner;
    Swap swap;
    int row = 0;
    std::vector<double> seen;
    void Provide(int layer, absl::Span<const int32_t> experts,
                 absl::Span<ExpertWeights> weights) override {
      inner->Provide(layer, experts, weights);
    }
    void Route(int layer, absl::Span<const float> probs, absl::Span<int32_t> experts,
               absl::Span<double> weights) override {
      inner->Route(layer, probs, experts, weights);
      if (layer == swap.layer && row++ == swap.row) seen.assign(weights.begin(), weights.end());
    }
  };
  TeacherForcedExperts inner(loaded_->model, routing, 1.0);
  Spy spy;
  spy.inner = &inner;
  spy.swap = s;
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(loaded_->model, 16, &spy);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  ASSERT_TRUE((*oracle)->Forward(kPrompt).ok());
  const ModelConfig& cfg = loaded_->model.config;
  const std::vector<float>& p = probs_[s.row * cfg.n_layer + s.layer];
  const std::vector<int32_t> ids(routing.begin() + RecordAt(s) + 1 - cfg.n_expert_used,
                                 routing.begin() + RecordAt(s) + 1);
  std::vector<double> want(ids.size());
  ChosenWeights(p, ids, cfg.norm_topk_prob, cfg.gating, cfg.expert_weights_scale,
                absl::MakeSpan(want));
  EXPECT_EQ(spy.seen, want);
}

TEST_P(TeacherForcingTest, ARecordThatEndsEarlyIsAnError) {
  const ModelConfig& cfg = loaded_->model.config;
  std::vector<int32_t> routing(own_routing_.begin(),
                               own_routing_.begin() + 3 * cfg.n_layer * cfg.n_expert_used);
  TeacherForcedExperts* forced = nullptr;
  Forced(routing, kNearTie, &forced);
  EXPECT_TRUE(MessageHas(forced->status(), "the engine's routing record ends before row 3"))
      << forced->status();
}

INSTANTIATE_TEST_SUITE_P(Gatings, TeacherForcingTest,
                         ::testing::Values(ForcingCase{"qwen3moe", Arch::kQwen3Moe},
                                           ForcingCase{"gpt_oss", Arch::kGptOss},
                                           ForcingCase{"glm4moe", Arch::kGlm4Moe}),
                         [](const ::testing::TestParamInfo<ForcingCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace moegraph
