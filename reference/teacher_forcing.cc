#include "reference/teacher_forcing.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace moegraph {

TeacherForcedExperts::TeacherForcedExperts(const Model& model, const std::vector<int32_t>& routing,
                                           double near_tie)
    : model_(model),
      own_(model),
      routing_(routing),
      near_tie_(near_tie),
      next_row_(static_cast<size_t>(model.config.n_layer), 0) {
  for (const LayerTensors& lt : model.layers) {
    score_b_.push_back(lt.score_b == nullptr ? std::vector<float>() : TensorToFloat(*lt.score_b));
  }
}

void TeacherForcedExperts::Provide(int layer, absl::Span<const int32_t> experts,
                                   absl::Span<ExpertWeights> weights) {
  own_.Provide(layer, experts, weights);
}

void TeacherForcedExperts::Route(int layer, absl::Span<const float> probs,
                                 absl::Span<int32_t> experts, absl::Span<double> weights) {
  const ModelConfig& cfg = model_.config;
  const size_t k = experts.size();
  const uint64_t row = next_row_[static_cast<size_t>(layer)]++;
  if (!error_.empty()) return;
  const size_t at = (row * static_cast<size_t>(cfg.n_layer) + static_cast<size_t>(layer)) * k;
  if (at + k > routing_.size()) {
    error_ = absl::StrFormat("the engine's routing record ends before row %d", row);
    return;
  }
  const absl::Span<const int32_t> forced(routing_.data() + at, k);
  // The scores the oracle chose on: the gate values plus the score bias.
  std::vector<float> score(probs.begin(), probs.end());
  const std::vector<float>& bias = score_b_[static_cast<size_t>(layer)];
  for (size_t e = 0; e < bias.size(); ++e) score[e] += bias[e];
  float kth = score[static_cast<size_t>(experts[0])];
  for (const int32_t e : experts) kth = std::min(kth, score[static_cast<size_t>(e)]);
  const auto [lo, hi] = std::minmax_element(score.begin(), score.end());
  const double range = std::max<double>(static_cast<double>(*hi) - *lo, 1e-30);
  bool differs = false;
  for (const int32_t e : forced) {
    if (e < 0 || e >= cfg.n_expert) {
      error_ = absl::StrFormat("row %d layer %d: the engine recorded expert %d of %d", row, layer,
                               e, cfg.n_expert);
      return;
    }
    if (std::find(experts.begin(), experts.end(), e) != experts.end()) continue;
    differs = true;
    const double gap = (static_cast<double>(kth) - score[static_cast<size_t>(e)]) / range;
    if (gap > near_tie_) {
      error_ = absl::StrFormat(
          "row %d layer %d: the engine chose expert %d, %.3g of the score range below the "
          "oracle's k-th (a near-tie is within %.2g)",
          row, layer, e, gap, near_tie_);
      return;
    }
    worst_gap_ = std::max(worst_gap_, gap);
  }
  ++rows_routed_;
  differing_rows_ += differs ? 1 : 0;
  std::copy(forced.begin(), forced.end(), experts.begin());
  ChosenWeights(probs, forced, cfg.norm_topk_prob, cfg.gating, cfg.expert_weights_scale, weights);
}

absl::Status TeacherForcedExperts::status() const {
  return error_.empty() ? absl::OkStatus() : absl::FailedPreconditionError(error_);
}

}  // namespace moegraph
