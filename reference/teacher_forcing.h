// Teacher-forced routing for the oracle: an engine's recorded expert choices
// replayed in the oracle's MoE layers, so that a comparison of their logits is
// about arithmetic, not about which side of a near-tie each router fell.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "loader/model_config.h"
#include "reference/ops.h"

namespace moegraph {

// The widest gap, as a share of the row's score range (max - min), by which an
// expert forced on the oracle may trail the oracle's own k-th score: an
// engine's router reads q8 activations, which move scores by about 1e-3 of
// their range (measured at most 5.9e-4 on glm4moe and qwen3moe fixtures of the
// gates, docs/GATES.md); a choice past this is a routing bug, not rounding.
inline constexpr double kNearTie = 0.01;

// An ExpertProvider for Oracle::Create: each (row, layer) takes the recorded
// ids, in their rank order, weighted from the oracle's own gate values as
// SelectExperts weights them (ChosenWeights); the weights themselves come from
// the model's tensors. routing holds k ids per layer per row, rows in the
// order the oracle runs them (an engine's routing record: step-major, a dense
// layer's ids unused), and must outlive this.
//
// Every recorded id the oracle would not have chosen is checked to be a
// near-tie: its score (gate value plus glm4moe's score bias) at most
// near_tie x the row's score range below the oracle's k-th. The first that is
// not, or a record that runs out, is kept in status(); the oracle's routing of
// that row is then left as it was.
class TeacherForcedExperts final : public ExpertProvider {
 public:
  TeacherForcedExperts(const Model& model, const std::vector<int32_t>& routing,
                       double near_tie = kNearTie);

  void Provide(int layer, absl::Span<const int32_t> experts,
               absl::Span<ExpertWeights> weights) override;
  void Route(int layer, absl::Span<const float> probs, absl::Span<int32_t> experts,
             absl::Span<double> weights) override;

  // The first forced choice that was not a near-tie (naming its row, layer and
  // expert), or the row the record lacked; OK otherwise.
  absl::Status status() const;
  // Rows x layers routed, those whose recorded experts differed from the
  // oracle's choice (as sets), and the widest gap among them.
  int rows() const { return rows_routed_; }
  int differing_rows() const { return differing_rows_; }
  double worst_gap() const { return worst_gap_; }

 private:
  const Model& model_;
  ModelExpertProvider own_;
  const std::vector<int32_t>& routing_;
  const double near_tie_;
  std::vector<std::vector<float>> score_b_;  // per layer; empty without a score bias
  std::vector<uint64_t> next_row_;           // per layer: the row its next Route is
  std::string error_;
  int rows_routed_ = 0;
  int differing_rows_ = 0;
  double worst_gap_ = 0;
};

}  // namespace moegraph
