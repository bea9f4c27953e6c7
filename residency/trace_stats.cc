#include "residency/trace_stats.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moegraph {
namespace {

// Skew of one layer's pick counts: entropy, Gini and top-10% share.
void SetSkew(std::vector<int64_t> counts, RoutingStats* out) {
  const int64_t n = static_cast<int64_t>(counts.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total == 0) return;
  double entropy = 0.0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(total);
    entropy -= p * std::log2(p);
  }
  out->entropy_bits = entropy;
  out->entropy_fraction = n > 1 ? entropy / std::log2(static_cast<double>(n)) : 1.0;

  // Gini over counts sorted ascending: sum_i (2i - n - 1) x_i / (n sum x), i from 1.
  std::sort(counts.begin(), counts.end());
  int64_t weighted = 0;
  for (int64_t i = 0; i < n; ++i) weighted += (2 * (i + 1) - n - 1) * counts[i];
  out->gini = static_cast<double>(weighted) / (static_cast<double>(n) * static_cast<double>(total));

  const int64_t top = (n + 9) / 10;
  int64_t top_picks = 0;
  for (int64_t i = n - top; i < n; ++i) top_picks += counts[i];
  out->top10_share = static_cast<double>(top_picks) / static_cast<double>(total);
}

// Mean number of distinct experts of one layer per sliding window of `window` steps.
double MeanDistinct(const RoutingTrace& trace, int32_t layer, int64_t window) {
  std::vector<int32_t> in_window(trace.n_expert, 0);
  int64_t distinct = 0;
  int64_t sum = 0;
  auto update = [&](int64_t step, int32_t delta) {
    if (!trace.present(step, layer)) return;
    const uint16_t* ids = trace.row(step, layer);
    for (int32_t i = 0; i < trace.k; ++i) {
      int32_t& count = in_window[ids[i]];
      if (delta > 0 && count == 0) ++distinct;
      count += delta;
      if (delta < 0 && count == 0) --distinct;
    }
  };
  for (int64_t t = 0; t < trace.n_steps; ++t) {
    update(t, +1);
    if (t >= window) update(t - window, -1);
    if (t >= window - 1) sum += distinct;
  }
  return static_cast<double>(sum) / static_cast<double>(trace.n_steps - window + 1);
}

RoutingStats LayerStats(const RoutingTrace& trace, int32_t layer, int64_t* intersections) {
  RoutingStats out;
  std::vector<int64_t> counts(trace.n_expert, 0);
  *intersections = 0;
  for (int64_t t = 0; t < trace.n_steps; ++t) {
    if (!trace.present(t, layer)) continue;
    ++out.rows;
    const uint16_t* ids = trace.row(t, layer);
    for (int32_t i = 0; i < trace.k; ++i) ++counts[ids[i]];
    if (t == 0 || !trace.present(t - 1, layer)) continue;
    ++out.reuse_pairs;
    const uint16_t* previous = trace.row(t - 1, layer);
    for (int32_t i = 0; i < trace.k; ++i) {
      *intersections += std::count(previous, previous + trace.k, ids[i]);
    }
  }
  SetSkew(std::move(counts), &out);
  if (out.reuse_pairs > 0) {
    out.reuse = static_cast<double>(*intersections) /
                (static_cast<double>(out.reuse_pairs) * trace.k);
  }
  for (size_t w = 0; w < kWorkingSetWindows.size(); ++w) {
    if (trace.n_steps >= kWorkingSetWindows[w]) {
      out.working_set[w] = MeanDistinct(trace, layer, kWorkingSetWindows[w]);
    }
  }
  return out;
}

std::string Fixed(double value, int digits) { return absl::StrFormat("%.*f", digits, value); }

std::string WorkingSetCell(const std::optional<double>& value) {
  return value.has_value() ? Fixed(*value, 2) : "-";
}

std::string MarkdownRow(const std::string& name, const RoutingStats& s) {
  std::string row = absl::StrCat("| ", name, " | ", s.rows, " | ", Fixed(s.entropy_bits, 3), " | ",
                                 Fixed(s.entropy_fraction, 3), " | ", Fixed(s.gini, 3), " | ",
                                 Fixed(s.top10_share, 3), " | ", Fixed(s.reuse, 3));
  for (const std::optional<double>& ws : s.working_set) {
    absl::StrAppend(&row, " | ", WorkingSetCell(ws));
  }
  return row + " |\n";
}

std::string JsonObject(const RoutingStats& s, const std::string& prefix) {
  std::string out = absl::StrCat("{", prefix, "\"rows\": ", s.rows,
                                 ", \"entropy_bits\": ", Fixed(s.entropy_bits, 6),
                                 ", \"entropy_fraction\": ", Fixed(s.entropy_fraction, 6),
                                 ", \"gini\": ", Fixed(s.gini, 6),
                                 ", \"top10_share\": ", Fixed(s.top10_share, 6),
                                 ", \"reuse\": ", Fixed(s.reuse, 6),
                                 ", \"reuse_pairs\": ", s.reuse_pairs, ", \"working_set\": {");
  for (size_t w = 0; w < kWorkingSetWindows.size(); ++w) {
    absl::StrAppend(&out, w > 0 ? ", " : "", "\"", kWorkingSetWindows[w], "\": ",
                    s.working_set[w].has_value() ? Fixed(*s.working_set[w], 6) : "null");
  }
  return out + "}}";
}

}  // namespace

TraceStats ComputeTraceStats(const RoutingTrace& trace) {
  TraceStats stats;
  stats.n_layer = trace.n_layer;
  stats.n_expert = trace.n_expert;
  stats.k = trace.k;
  stats.n_steps = trace.n_steps;
  RoutingStats& all = stats.overall;
  int64_t intersections = 0;
  int64_t layers_with_rows = 0;
  for (int32_t layer = 0; layer < trace.n_layer; ++layer) {
    int64_t layer_intersections = 0;
    stats.layers.push_back(LayerStats(trace, layer, &layer_intersections));
    const RoutingStats& s = stats.layers.back();
    intersections += layer_intersections;
    all.rows += s.rows;
    all.reuse_pairs += s.reuse_pairs;
    for (size_t w = 0; w < kWorkingSetWindows.size(); ++w) {
      if (s.working_set[w].has_value()) {
        all.working_set[w] = all.working_set[w].value_or(0.0) + *s.working_set[w];
      }
    }
    if (s.rows == 0) continue;
    ++layers_with_rows;
    all.entropy_bits += s.entropy_bits;
    all.entropy_fraction += s.entropy_fraction;
    all.gini += s.gini;
    all.top10_share += s.top10_share;
  }
  stats.missing_rows = trace.n_steps * trace.n_layer - all.rows;
  if (layers_with_rows > 0) {
    const double n = static_cast<double>(layers_with_rows);
    all.entropy_bits /= n;
    all.entropy_fraction /= n;
    all.gini /= n;
    all.top10_share /= n;
  }
  if (all.reuse_pairs > 0) {
    all.reuse = static_cast<double>(intersections) /
                (static_cast<double>(all.reuse_pairs) * trace.k);
  }
  return stats;
}

std::string FormatTraceStatsMarkdown(const TraceStats& stats) {
  std::string out = absl::StrCat(stats.n_layer, " layers, ", stats.n_expert, " experts, top-",
                                 stats.k, ", ", stats.n_steps, " steps, ", stats.overall.rows,
                                 " rows present, ", stats.missing_rows, " missing\n\n");
  out += "| layer | rows | entropy bits | entropy / log2 E | gini | top-10% share | reuse";
  for (int32_t w : kWorkingSetWindows) absl::StrAppend(&out, " | ws ", w);
  out += " |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---:";
  for (size_t w = 0; w < kWorkingSetWindows.size(); ++w) out += " | ---:";
  out += " |\n";
  for (size_t layer = 0; layer < stats.layers.size(); ++layer) {
    out += MarkdownRow(absl::StrCat(layer), stats.layers[layer]);
  }
  out += MarkdownRow("all", stats.overall);
  return out;
}

std::string FormatTraceStatsJson(const TraceStats& stats) {
  std::string out = absl::StrCat("{\"n_layer\": ", stats.n_layer, ", \"n_expert\": ",
                                 stats.n_expert, ", \"k\": ", stats.k, ", \"n_steps\": ",
                                 stats.n_steps, ", \"missing_rows\": ", stats.missing_rows,
                                 ",\n \"overall\": ", JsonObject(stats.overall, ""),
                                 ",\n \"layers\": [");
  for (size_t layer = 0; layer < stats.layers.size(); ++layer) {
    absl::StrAppend(&out, layer > 0 ? ",\n  " : "\n  ",
                    JsonObject(stats.layers[layer], absl::StrCat("\"layer\": ", layer, ", ")));
  }
  return out + "]}\n";
}

std::string FormatTraceStatsSummary(const TraceStats& stats) {
  const RoutingStats& s = stats.overall;
  std::string out = absl::StrCat(
      stats.n_steps, " steps x ", stats.n_layer, " layers, ", stats.n_expert, " experts, top-",
      stats.k, ": entropy ", Fixed(s.entropy_fraction, 3), " of log2 E (",
      Fixed(s.entropy_bits, 3), " bits), gini ", Fixed(s.gini, 3), ", top-10% share ",
      Fixed(s.top10_share, 3), ", next-token reuse ", Fixed(s.reuse, 3), ", working set");
  for (size_t w = 0; w < kWorkingSetWindows.size(); ++w) {
    absl::StrAppend(&out, w > 0 ? "," : "", " ", kWorkingSetWindows[w], ": ",
                    WorkingSetCell(s.working_set[w]));
  }
  return out;
}

}  // namespace moegraph
