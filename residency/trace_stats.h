// Statistics of a routing trace that predict how well an expert cache will do:
// how skewed the routing is, how much it repeats from token to token, and how
// many distinct experts a window of tokens touches.
//
// Per layer l, over the present rows of l only (missing rows are skipped):
// - picks c_e: the number of rows of l that selected expert e; P = sum of c_e.
// - entropy_bits: H = -sum_e (c_e / P) log2(c_e / P) over experts with c_e > 0.
//   entropy_fraction = H / log2(n_expert): 1 when every expert is picked equally
//   often (and, by convention, when n_expert == 1); 0 when one expert gets all.
// - gini: the Gini coefficient of the n_expert counts (never-picked experts
//   count as 0): sum_i sum_j |c_i - c_j| / (2 n^2 mean c). 0 when uniform,
//   (n - 1) / n when one expert gets all.
// - top10_share: the share of P that goes to the ceil(n_expert / 10) most
//   picked experts.
// - reuse (next-token reuse): over the pairs of consecutive steps (t - 1, t)
//   whose rows of l are both present, |S_t intersect S_(t-1)| / k, averaged
//   (0 when there is no such pair; reuse_pairs says how many there were).
// - working_set[w]: for each window of W = kWorkingSetWindows[w] consecutive
//   steps (sliding: steps [t, t + W) for t = 0 .. n_steps - W), the number of
//   distinct experts of l in the window's present rows, averaged over the
//   windows; absent when n_steps < W.
// Overall: entropy_bits, entropy_fraction, gini and top10_share are the means
// of the per-layer values over layers with at least one present row; reuse is
// pooled (total intersections / (total pairs * k)); working_set counts distinct
// (layer, expert) keys, which is the sum of the per-layer working sets.
// Every value is a deterministic function of the trace.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "residency/trace.h"

namespace moegraph {

inline constexpr std::array<int32_t, 4> kWorkingSetWindows = {1, 8, 64, 512};

struct RoutingStats {
  int64_t rows = 0;  // present rows
  double entropy_bits = 0.0;
  double entropy_fraction = 0.0;
  double gini = 0.0;
  double top10_share = 0.0;
  double reuse = 0.0;
  int64_t reuse_pairs = 0;
  std::array<std::optional<double>, kWorkingSetWindows.size()> working_set;
};

struct TraceStats {
  int32_t n_layer = 0;
  int32_t n_expert = 0;
  int32_t k = 0;
  int64_t n_steps = 0;
  int64_t missing_rows = 0;
  std::vector<RoutingStats> layers;  // [n_layer]
  RoutingStats overall;
};

TraceStats ComputeTraceStats(const RoutingTrace& trace);

// A markdown table, one row per layer and a last row "all" for the overall values.
std::string FormatTraceStatsMarkdown(const TraceStats& stats);
// One JSON object: geometry, "overall" and "layers" (an array, layer order);
// working-set windows that do not fit the trace are null.
std::string FormatTraceStatsJson(const TraceStats& stats);
// The overall values on one line, for tools that print a summary.
std::string FormatTraceStatsSummary(const TraceStats& stats);

}  // namespace moegraph
