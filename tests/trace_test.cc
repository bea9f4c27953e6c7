// Routing traces: the JSONL reader on the real Mixtral trace and on malformed
// input, the binary form, the statistics and the synthetic generator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loader/quant.h"
#include "residency/trace.h"
#include "residency/trace_stats.h"
#include "residency/trace_synth.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::ReadFileToString;
using testing_util::SharedPath;
using testing_util::TempPath;

std::string RealTracePath() { return SharedPath("traces/mixtral-8x7b-humaneval.jsonl"); }

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void ExpectSameTrace(const RoutingTrace& a, const RoutingTrace& b) {
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_expert, b.n_expert);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.n_steps, b.n_steps);
  EXPECT_TRUE(a.ids == b.ids);
  EXPECT_TRUE(a.weights == b.weights);
}

std::vector<uint16_t> Row(const RoutingTrace& t, int64_t step, int32_t layer) {
  return std::vector<uint16_t>(t.row(step, layer), t.row(step, layer) + t.k);
}

// A trace from rows of ids; an empty row is missing.
RoutingTrace MakeTrace(int32_t n_expert, int32_t k, int32_t n_layer,
                       const std::vector<std::vector<int>>& rows) {
  RoutingTrace t;
  t.n_layer = n_layer;
  t.n_expert = n_expert;
  t.k = k;
  t.n_steps = static_cast<int64_t>(rows.size()) / n_layer;
  for (const std::vector<int>& row : rows) {
    for (int i = 0; i < k; ++i) t.ids.push_back(row.empty() ? kMissingExpert : row[i]);
  }
  return t;
}

// ---- JSONL reader ----

TEST(TraceJsonl, RealTraceGeometryAndRows) {
  absl::StatusOr<RoutingTrace> t = ReadTraceJsonl(RealTracePath(), {.n_expert_hint = 8});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->n_layer, 32);
  EXPECT_EQ(t->n_expert, 8);
  EXPECT_EQ(t->k, 2);
  EXPECT_EQ(t->n_steps, 83);
  ASSERT_EQ(t->weights.size(), t->ids.size());
  // Rows read with Python's json module from the file.
  EXPECT_EQ(Row(*t, 0, 0), (std::vector<uint16_t>{6, 5}));
  EXPECT_EQ(Row(*t, 0, 31), (std::vector<uint16_t>{3, 6}));
  EXPECT_EQ(Row(*t, 40, 17), (std::vector<uint16_t>{3, 2}));
  EXPECT_EQ(Row(*t, 76, 31), (std::vector<uint16_t>{0, 1}));
  EXPECT_EQ(Row(*t, 82, 0), (std::vector<uint16_t>{1, 4}));
  EXPECT_EQ(t->weights[t->row_offset(0, 0)], f32_to_f16(0.6959583759307861f));
  EXPECT_EQ(t->weights[t->row_offset(40, 17) + 1], f32_to_f16(0.07835981249809265f));
  // 77 of the 83 x 32 rows are absent, all in the last six tokens; of token 82
  // only layers 0 and 30 are present.
  int64_t missing = 0;
  for (int64_t s = 0; s < t->n_steps; ++s) {
    for (int32_t l = 0; l < t->n_layer; ++l) missing += t->present(s, l) ? 0 : 1;
  }
  EXPECT_EQ(missing, 77);
  for (int32_t l = 0; l < 32; ++l) EXPECT_EQ(t->present(82, l), l == 0 || l == 30) << l;
  EXPECT_TRUE(t->present(76, 5));
  EXPECT_EQ(t->row(82, 1)[1], kMissingExpert);

  // Without the hint the count is inferred: max id + 1 is also 8 here.
  absl::StatusOr<RoutingTrace> inferred = ReadTraceJsonl(RealTracePath());
  ASSERT_TRUE(inferred.ok()) << inferred.status();
  ExpectSameTrace(*t, *inferred);
  absl::StatusOr<RoutingTrace> wider = ReadTrace(RealTracePath(), {.n_expert_hint = 16});
  ASSERT_TRUE(wider.ok()) << wider.status();
  EXPECT_EQ(wider->n_expert, 16);
  absl::StatusOr<RoutingTrace> narrow = ReadTraceJsonl(RealTracePath(), {.n_expert_hint = 7});
  ASSERT_FALSE(narrow.ok());
  EXPECT_NE(narrow.status().message().find("expert id 7"), std::string::npos) << narrow.status();
  EXPECT_NE(narrow.status().message().find(RealTracePath() + ":"), std::string::npos);
}

TEST(TraceJsonl, LineOrderDoesNotMatter) {
  absl::StatusOr<RoutingTrace> original = ReadTraceJsonl(RealTracePath());
  ASSERT_TRUE(original.ok()) << original.status();
  std::vector<std::string> lines = Lines(ReadFileToString(RealTracePath()));
  // A fixed permutation: stride through the lines with a step coprime to their count.
  std::vector<std::string> shuffled;
  const size_t n = lines.size();
  size_t stride = 997;
  while (std::gcd(stride, n) != 1) ++stride;
  for (size_t i = 0; i < n; ++i) shuffled.push_back(lines[(i * stride) % n]);
  ASSERT_NE(shuffled, lines);
  std::string text;
  for (const std::string& line : shuffled) text += line + "\r\n";
  const std::string path = TempPath("shuffled.jsonl");
  WriteText(path, text + "\n  \n");
  absl::StatusOr<RoutingTrace> reread = ReadTraceJsonl(path);
  ASSERT_TRUE(reread.ok()) << reread.status();
  ExpectSameTrace(*original, *reread);

  // token_pos instead of token_idx reads the same.
  std::string renamed = ReadFileToString(RealTracePath());
  for (size_t at = renamed.find("token_idx"); at != std::string::npos;
       at = renamed.find("token_idx", at)) {
    renamed.replace(at, 9, "token_pos");
  }
  WriteText(path, renamed);
  absl::StatusOr<RoutingTrace> pos = ReadTraceJsonl(path);
  ASSERT_TRUE(pos.ok()) << pos.status();
  ExpectSameTrace(*original, *pos);
  std::remove(path.c_str());
}

TEST(TraceJsonl, StepsOrderByDatasetProblemAndToken) {
  const std::string path = TempPath("order.jsonl");
  WriteText(path,
            R"({"dataset": "b", "problem_id": 0, "layer": 1, "token_idx": 0, "experts": [1]}
{"dataset": "a", "problem_id": 2, "layer": 0, "token_idx": 0, "experts": [2]}
{"dataset": "a", "problem_id": 10, "layer": 0, "token_idx": 5, "experts": [3]}
{"dataset": "a", "problem_id": 10, "layer": 0, "token_idx": -1, "experts": [4], "x": {"y": [null]}}
{"dataset": "a\"\u00e9", "problem_id": 0, "layer": 0, "token_pos": 0, "experts": [5]}
)");
  absl::StatusOr<RoutingTrace> t = ReadTraceJsonl(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->n_layer, 2);
  EXPECT_EQ(t->n_expert, 6);
  EXPECT_EQ(t->k, 1);
  ASSERT_EQ(t->n_steps, 5);
  EXPECT_TRUE(t->weights.empty());
  // "a" < "a\"\xc3\xa9" < "b"; problem 2 < 10; token -1 < 5.
  const std::vector<uint16_t> expected = {2, kMissingExpert, 4, kMissingExpert, 3, kMissingExpert,
                                          5, kMissingExpert, kMissingExpert, 1};
  EXPECT_EQ(t->ids, expected);
  std::remove(path.c_str());
}

struct BadInput {
  std::string text;
  int line;
  std::string message;
};

TEST(TraceJsonl, MalformedInputNamesTheLine) {
  const std::string good =
      R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], )"
      R"("gating_probs": [0.6, 0.4]})"
      "\n";
  const std::vector<BadInput> cases = {
      {"not json", 2, "not JSON"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1, 2])", 2,
       "not JSON"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1, 2], )"
       R"("gating_probs": [0.5, 0.5]} x)",
       2, "unexpected text"},
      {R"([1, 2])", 2, "not a JSON object"},
      {R"({"problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1, 2], "gating_probs": [1,0]})",
       2, "missing field \"dataset\""},
      {R"({"dataset": "d", "layer": 0, "token_idx": 1, "experts": [1, 2], "gating_probs": [1, 0]})",
       2, "missing field \"problem_id\""},
      {R"({"dataset": "d", "problem_id": 0, "token_idx": 1, "experts": [1, 2], )"
       R"("gating_probs": [1, 0]})",
       2, "missing field \"layer\""},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [1,0]})",
       2, "missing field \"token_idx\""},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "gating_probs": [1, 0]})",
       2, "missing field \"experts\""},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [-1, 2], )"
       R"("gating_probs": [1, 0]})",
       2, "expert id -1"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1, 1.5], )"
       R"("gating_probs": [1, 0]})",
       2, "experts[1] must be an integer"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [1, 2, 3], )"
       R"("gating_probs": [1, 0, 0]})",
       2, "has 3 ids, line 1 has 2"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 0, "experts": [3, 4], )"
       R"("gating_probs": [1, 0]})",
       2, "repeats the (step, layer) row of line 1"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1]})",
       2, "\"gating_probs\" has 1 values but \"experts\" has 2"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 3], )"
       R"("gating_probs": [1, 0]})",
       2, "expert id 3 appears twice"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 4]})", 2,
       "lacks \"gating_probs\", unlike line 1"},
      {R"({"dataset": "d", "problem_id": 0, "layer": -2, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1, 0]})",
       2, "layer -2"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "token_pos": 1, )"
       R"("experts": [3, 4], "gating_probs": [1, 0]})",
       2, "both \"token_idx\" and \"token_pos\""},
      {R"({"dataset": 5, "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1, 0]})",
       2, "\"dataset\" must be a string"},
      {R"({"dataset": "d", "dataset": "e", "problem_id": 0, "layer": 0, "token_idx": 1, )"
       R"("experts": [3, 4], "gating_probs": [1, 0]})",
       2, "duplicate key"},
      {R"({"dataset": "d\q", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1, 0]})",
       2, "bad escape"},
      {R"({"dataset": "d", "problem_id": 01, "layer": 0, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1, 0]})",
       2, "leading zero"},
      {R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 1, "experts": [3, 4], )"
       R"("gating_probs": [1e999, 0]})",
       2, "number out of range"},
  };
  const std::string path = TempPath("bad.jsonl");
  for (const BadInput& bad : cases) {
    WriteText(path, good + bad.text + "\n");
    absl::StatusOr<RoutingTrace> t = ReadTraceJsonl(path);
    ASSERT_FALSE(t.ok()) << bad.text;
    const std::string message(t.status().message());
    EXPECT_NE(message.find(path + ":" + std::to_string(bad.line) + ":"), std::string::npos)
        << message;
    EXPECT_NE(message.find(bad.message), std::string::npos) << message;
  }

  // An id at or above the hint is refused on its own line.
  WriteText(path, good + good.substr(0, good.find("\"token_idx\": 0")) + "\"token_idx\": 1, " +
                      good.substr(good.find("\"experts\"")));
  EXPECT_TRUE(ReadTraceJsonl(path, {.n_expert_hint = 3}).ok());
  absl::StatusOr<RoutingTrace> over = ReadTraceJsonl(path, {.n_expert_hint = 2});
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find(path + ":1: expert id 2"), std::string::npos)
      << over.status();

  WriteText(path, "\n");
  EXPECT_FALSE(ReadTraceJsonl(path).ok());
  std::remove(path.c_str());
  absl::StatusOr<RoutingTrace> absent = ReadTrace(path);
  ASSERT_FALSE(absent.ok());
  EXPECT_NE(absent.status().message().find(path), std::string::npos);
}

// ---- round trips and the binary form ----

TEST(TraceFormats, RoundTripsAreIdentical) {
  absl::StatusOr<RoutingTrace> real = ReadTraceJsonl(RealTracePath());
  ASSERT_TRUE(real.ok()) << real.status();
  RoutingTrace without_weights = *real;
  without_weights.weights.clear();
  SynthSpec spec;
  spec.n_layer = 3;
  spec.n_expert = 300;
  spec.k = 5;
  spec.n_steps = 40;
  spec.weights = true;
  absl::StatusOr<RoutingTrace> synth = SynthesizeTrace(spec);
  ASSERT_TRUE(synth.ok()) << synth.status();
  // An expert count above max id + 1 and trailing missing layers must survive JSONL too.
  RoutingTrace sparse = MakeTrace(50, 2, 3, {{1, 2}, {}, {}, {3, 4}, {5, 6}, {}});

  const std::string bin = TempPath("rt.mgtr");
  const std::string jsonl = TempPath("rt.jsonl");
  for (const RoutingTrace* t : {&*real, &without_weights, &*synth, &sparse}) {
    ASSERT_TRUE(WriteTrace(*t, bin).ok());
    absl::StatusOr<RoutingTrace> from_bin = ReadTrace(bin);
    ASSERT_TRUE(from_bin.ok()) << from_bin.status();
    ExpectSameTrace(*t, *from_bin);
    ASSERT_TRUE(WriteTrace(*t, jsonl).ok());
    absl::StatusOr<RoutingTrace> from_jsonl = ReadTrace(jsonl);
    ASSERT_TRUE(from_jsonl.ok()) << from_jsonl.status();
    ExpectSameTrace(*t, *from_jsonl);
  }
  // The binary file is exactly header + ids + weights.
  ASSERT_TRUE(WriteTraceBinary(*real, bin).ok());
  EXPECT_EQ(ReadFileToString(bin).size(), 32u + 4u * real->ids.size());
  EXPECT_EQ(ReadFileToString(bin).substr(0, 4), "MGTR");
  std::remove(bin.c_str());
  std::remove(jsonl.c_str());
}

TEST(TraceBinary, TruncationAndCorruptionAreRefused) {
  RoutingTrace t = MakeTrace(6, 2, 2, {{0, 1}, {2, 3}, {}, {5, 4}});
  t.weights.assign(t.ids.size(), f32_to_f16(0.5f));
  t.weights[4] = t.weights[5] = 0;  // the missing row
  const std::string path = TempPath("trunc.mgtr");
  ASSERT_TRUE(WriteTraceBinary(t, path).ok());
  const std::string bytes = ReadFileToString(path);
  ASSERT_EQ(bytes.size(), 32u + 2 * 2 * 8);
  for (size_t length = 0; length < bytes.size(); ++length) {
    WriteText(path, bytes.substr(0, length));
    absl::StatusOr<RoutingTrace> r = ReadTraceBinary(path);
    ASSERT_FALSE(r.ok()) << length;
    EXPECT_NE(r.status().message().find(path + ": byte "), std::string::npos) << r.status();
  }
  WriteText(path, bytes + "x");
  EXPECT_FALSE(ReadTraceBinary(path).ok());

  struct Corruption {
    size_t offset;
    char value;
    std::string message;
  };
  // Ids start at byte 32, two bytes each, little-endian: the missing row (step 1,
  // layer 0) is ids 4..5, at bytes 40..43.
  const std::vector<Corruption> corruptions = {
      {0, 'X', "byte 0: not a routing trace"},  {4, 2, "byte 4: unsupported version 2"},
      {12, 0, "byte 12: n_expert 0"},           {16, 0, "byte 16: k 0"},
      {28, 2, "byte 28: unknown flags"},        {32 + 2, 6, "byte 34: expert id 6"},
      {32 + 2, 0, "byte 34: expert id 0 appears twice"},
      {32 + 10, 3, "byte 42: a missing row holds an id"},
      {32 + 16 + 10, 1, "byte 58: a missing row has a weight"},
  };
  for (const Corruption& c : corruptions) {
    std::string corrupt = bytes;
    corrupt[c.offset] = c.value;
    if (c.offset == 32 + 10) corrupt[c.offset + 1] = 0;
    WriteText(path, corrupt);
    absl::StatusOr<RoutingTrace> r = ReadTraceBinary(path);
    ASSERT_FALSE(r.ok()) << c.message;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
  }
  WriteText(path, bytes);
  EXPECT_TRUE(ReadTrace(path, {.n_expert_hint = 6}).ok());
  absl::StatusOr<RoutingTrace> hinted = ReadTrace(path, {.n_expert_hint = 8});
  ASSERT_FALSE(hinted.ok());
  EXPECT_NE(hinted.status().message().find("--experts 8"), std::string::npos);

  // A missing row's weights carry nothing: the writer stores them as 0.
  RoutingTrace noisy = t;
  noisy.weights[4] = f32_to_f16(0.25f);
  ASSERT_TRUE(WriteTraceBinary(noisy, path).ok());
  absl::StatusOr<RoutingTrace> cleaned = ReadTraceBinary(path);
  ASSERT_TRUE(cleaned.ok()) << cleaned.status();
  ExpectSameTrace(t, *cleaned);
  std::remove(path.c_str());
}

// ---- statistics ----

TEST(TraceStats, UniformRouting) {
  // Four experts, top-2, alternating halves: every expert equally often, no reuse.
  std::vector<std::vector<int>> rows;
  for (int s = 0; s < 16; ++s) {
    rows.push_back(s % 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{3, 2});
  }
  const TraceStats stats = ComputeTraceStats(MakeTrace(4, 2, 1, rows));
  const RoutingStats& l = stats.layers[0];
  EXPECT_EQ(l.rows, 16);
  EXPECT_NEAR(l.entropy_bits, 2.0, 1e-12);
  EXPECT_NEAR(l.entropy_fraction, 1.0, 1e-12);
  EXPECT_NEAR(l.gini, 0.0, 1e-12);
  EXPECT_NEAR(l.top10_share, 0.25, 1e-12);  // ceil(4 / 10) = 1 expert
  EXPECT_EQ(l.reuse_pairs, 15);
  EXPECT_NEAR(l.reuse, 0.0, 1e-12);
  ASSERT_TRUE(l.working_set[0].has_value() && l.working_set[1].has_value());
  EXPECT_NEAR(*l.working_set[0], 2.0, 1e-12);
  EXPECT_NEAR(*l.working_set[1], 4.0, 1e-12);
  EXPECT_FALSE(l.working_set[2].has_value());  // 16 steps < 64
  EXPECT_NEAR(stats.overall.entropy_fraction, 1.0, 1e-12);
}

TEST(TraceStats, OneExpertAlways) {
  const TraceStats stats = ComputeTraceStats(
      MakeTrace(5, 1, 2, std::vector<std::vector<int>>(20, std::vector<int>{3})));
  for (const RoutingStats* s : {&stats.layers[0], &stats.layers[1], &stats.overall}) {
    EXPECT_NEAR(s->entropy_bits, 0.0, 1e-12);
    EXPECT_NEAR(s->entropy_fraction, 0.0, 1e-12);
    EXPECT_NEAR(s->gini, 4.0 / 5.0, 1e-12);
    EXPECT_NEAR(s->top10_share, 1.0, 1e-12);
    EXPECT_NEAR(s->reuse, 1.0, 1e-12);
  }
  EXPECT_NEAR(*stats.layers[0].working_set[1], 1.0, 1e-12);
  EXPECT_NEAR(*stats.overall.working_set[1], 2.0, 1e-12);  // one key per layer
}

TEST(TraceStats, SkewedCountsAndMissingRows) {
  // Layer 0 picks: expert 0 x3, 1 x1 (and experts 2..9 never) over 4 present rows;
  // the missing row at step 2 breaks the (1, 2) and (2, 3) pairs.
  const RoutingTrace t = MakeTrace(10, 1, 1, {{0}, {0}, {}, {1}, {0}});
  const TraceStats stats = ComputeTraceStats(t);
  const RoutingStats& l = stats.layers[0];
  EXPECT_EQ(l.rows, 4);
  EXPECT_EQ(stats.missing_rows, 1);
  const double h = -(0.75 * std::log2(0.75) + 0.25 * std::log2(0.25));
  EXPECT_NEAR(l.entropy_bits, h, 1e-12);
  EXPECT_NEAR(l.entropy_fraction, h / std::log2(10.0), 1e-12);
  // Gini from its pairwise definition: counts {3, 1, 0 x8}, mean 0.4.
  const std::vector<double> c = {3, 1, 0, 0, 0, 0, 0, 0, 0, 0};
  double pair_sum = 0.0;
  for (double a : c) {
    for (double b : c) pair_sum += std::fabs(a - b);
  }
  EXPECT_NEAR(l.gini, pair_sum / (2.0 * 100 * 0.4), 1e-12);
  EXPECT_NEAR(l.top10_share, 0.75, 1e-12);  // one expert of 10
  EXPECT_EQ(l.reuse_pairs, 2);              // (0, 1) and (3, 4)
  EXPECT_NEAR(l.reuse, 0.5, 1e-12);
  // Windows of 1: present rows 4 of 5; windows of 8 do not fit 5 steps.
  EXPECT_NEAR(*l.working_set[0], 0.8, 1e-12);
  EXPECT_FALSE(l.working_set[1].has_value());
}

// Reference values for the Mixtral trace, computed once by a separate plain-Python
// script from the definitions in trace_stats.h (json module, collections.Counter,
// Gini by the pairwise double sum, sets for the reuse intersections and windows).
TEST(TraceStats, RealTraceMatchesIndependentReference) {
  absl::StatusOr<RoutingTrace> t = ReadTraceJsonl(RealTracePath(), {.n_expert_hint = 8});
  ASSERT_TRUE(t.ok()) << t.status();
  const TraceStats stats = ComputeTraceStats(*t);
  EXPECT_EQ(stats.missing_rows, 77);
  const RoutingStats& all = stats.overall;
  EXPECT_EQ(all.rows, 2579);
  EXPECT_EQ(all.reuse_pairs, 2547);
  EXPECT_NEAR(all.entropy_bits, 2.913514, 1e-6);
  EXPECT_NEAR(all.entropy_fraction, 0.971171, 1e-6);
  EXPECT_NEAR(all.gini, 0.180398, 1e-6);
  EXPECT_NEAR(all.top10_share, 0.196233, 1e-6);
  EXPECT_NEAR(all.reuse, 1829.0 / (2547 * 2), 1e-12);  // 0.359050
  EXPECT_NEAR(*all.working_set[0], 62.144578, 1e-6);
  EXPECT_NEAR(*all.working_set[1], 207.947368, 1e-6);
  EXPECT_NEAR(*all.working_set[2], 256.0, 1e-9);
  EXPECT_FALSE(all.working_set[3].has_value());
  const RoutingStats& l5 = stats.layers[5];
  EXPECT_EQ(l5.rows, 77);
  EXPECT_NEAR(l5.entropy_bits, 2.833152, 1e-6);
  EXPECT_NEAR(l5.gini, 0.266234, 1e-6);
  EXPECT_NEAR(l5.top10_share, 0.246753, 1e-6);
  EXPECT_NEAR(l5.reuse, 0.348684, 1e-6);
  EXPECT_NEAR(*l5.working_set[0], 1.855422, 1e-6);
  EXPECT_NEAR(*l5.working_set[1], 6.105263, 1e-6);
  EXPECT_NEAR(stats.layers[0].reuse, 0.262195, 1e-6);

  const std::string md = FormatTraceStatsMarkdown(stats);
  EXPECT_EQ(std::count(md.begin(), md.end(), '\n'), 2 + 2 + 32 + 1);
  EXPECT_NE(md.find("| all | 2579 | 2.914 | 0.971 | 0.180 | 0.196 | 0.359 | 62.14 | 207.95 | "
                    "256.00 | - |"),
            std::string::npos)
      << md;
  const std::string json = FormatTraceStatsJson(stats);
  EXPECT_NE(json.find("\"reuse\": 0.359050"), std::string::npos);
  EXPECT_NE(json.find("\"512\": null"), std::string::npos);
  EXPECT_EQ(FormatTraceStatsJson(ComputeTraceStats(*t)), json);
}

// ---- synthetic traces ----

double MeasuredReuse(const SynthSpec& spec) {
  absl::StatusOr<RoutingTrace> t = SynthesizeTrace(spec);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? ComputeTraceStats(*t).overall.reuse : -1.0;
}

TEST(TraceSynth, DefaultsGeometryAndReuse) {
  SynthSpec spec;
  spec.n_steps = 120;
  absl::StatusOr<RoutingTrace> t = SynthesizeTrace(spec);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->n_layer, 48);
  EXPECT_EQ(t->n_expert, 128);
  EXPECT_EQ(t->k, 8);
  EXPECT_EQ(t->n_steps, 120);
  ASSERT_EQ(t->ids.size(), 120u * 48 * 8);
  EXPECT_TRUE(t->weights.empty());
  for (int64_t s = 0; s < t->n_steps; ++s) {
    for (int32_t l = 0; l < t->n_layer; ++l) {
      const std::set<uint16_t> distinct(t->row(s, l), t->row(s, l) + t->k);
      ASSERT_EQ(distinct.size(), 8u);
      ASSERT_LT(*distinct.rbegin(), 128);
    }
  }
  const TraceStats stats = ComputeTraceStats(*t);
  EXPECT_NEAR(stats.overall.reuse, 0.45, 0.05);
  for (double target : {0.0, 0.2, 0.8}) {
    spec.reuse = target;
    EXPECT_NEAR(MeasuredReuse(spec), target, 0.05) << target;
  }
}

TEST(TraceSynth, Deterministic) {
  SynthSpec spec;
  spec.n_layer = 4;
  spec.n_expert = 32;
  spec.k = 4;
  spec.n_steps = 200;
  spec.drift_period = 3;
  spec.weights = true;
  absl::StatusOr<RoutingTrace> a = SynthesizeTrace(spec);
  absl::StatusOr<RoutingTrace> b = SynthesizeTrace(spec);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSameTrace(*a, *b);
  spec.seed = 2;
  absl::StatusOr<RoutingTrace> c = SynthesizeTrace(spec);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->ids, c->ids);
}

TEST(TraceSynth, ZipfSkewIsVisible) {
  SynthSpec spec;
  spec.n_layer = 8;
  spec.n_steps = 400;
  spec.reuse = 0.0;
  spec.zipf_s = 0.0;
  absl::StatusOr<RoutingTrace> flat = SynthesizeTrace(spec);
  spec.zipf_s = 1.2;
  absl::StatusOr<RoutingTrace> skewed = SynthesizeTrace(spec);
  ASSERT_TRUE(flat.ok() && skewed.ok());
  const RoutingStats f = ComputeTraceStats(*flat).overall;
  const RoutingStats s = ComputeTraceStats(*skewed).overall;
  EXPECT_GT(f.entropy_fraction, 0.97);
  EXPECT_LT(f.gini, 0.2);
  EXPECT_LT(s.entropy_fraction, f.entropy_fraction - 0.05);
  EXPECT_GT(s.gini, f.gini + 0.2);
  EXPECT_GT(s.top10_share, 0.3);
  EXPECT_LT(s.working_set[1].value(), f.working_set[1].value());
}

TEST(TraceSynth, DriftMovesTheHotExpert) {
  // Top-1 of 8 with a strong skew: the most picked expert of the first and last
  // 300 steps stays put without drift and moves in most layers with it.
  auto moved_layers = [](int64_t drift) {
    SynthSpec spec;
    spec.n_layer = 16;
    spec.n_expert = 8;
    spec.k = 1;
    spec.n_steps = 3000;
    spec.zipf_s = 2.0;
    spec.reuse = 0.0;
    spec.drift_period = drift;
    absl::StatusOr<RoutingTrace> t = SynthesizeTrace(spec);
    EXPECT_TRUE(t.ok());
    int moved = 0;
    for (int32_t l = 0; l < spec.n_layer; ++l) {
      std::vector<int> head(8, 0), tail(8, 0);
      for (int64_t s = 0; s < 300; ++s) {
        ++head[t->row(s, l)[0]];
        ++tail[t->row(spec.n_steps - 1 - s, l)[0]];
      }
      moved += std::max_element(head.begin(), head.end()) - head.begin() !=
               std::max_element(tail.begin(), tail.end()) - tail.begin();
    }
    return moved;
  };
  EXPECT_EQ(moved_layers(0), 0);
  EXPECT_GE(moved_layers(1), 8);
}

TEST(TraceSynth, WeightsAndEdgeCases) {
  SynthSpec spec;
  spec.n_layer = 2;
  spec.n_expert = 4;
  spec.k = 4;  // every expert every step: the draw must fall back to dropped ones
  spec.n_steps = 50;
  spec.reuse = 0.0;
  spec.weights = true;
  absl::StatusOr<RoutingTrace> t = SynthesizeTrace(spec);
  ASSERT_TRUE(t.ok()) << t.status();
  for (size_t row = 0; row < t->ids.size() / 4; ++row) {
    const std::set<uint16_t> distinct(&t->ids[row * 4], &t->ids[row * 4] + 4);
    EXPECT_EQ(distinct.size(), 4u);
    float sum = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const float w = f16_to_f32(t->weights[row * 4 + i]);
      EXPECT_GT(w, 0.0f);
      if (i > 0) {
        EXPECT_LE(w, f16_to_f32(t->weights[row * 4 + i - 1]));
      }
      sum += w;
    }
    EXPECT_NEAR(sum, 1.0f, 2e-3f);
  }
  spec.reuse = 1.0;
  spec.k = 2;
  t = SynthesizeTrace(spec);
  ASSERT_TRUE(t.ok());
  EXPECT_NEAR(ComputeTraceStats(*t).overall.reuse, 1.0, 1e-12);

  const std::vector<std::pair<SynthSpec, std::string>> bad = {
      {{.n_layer = 0}, "--layers 0"},
      {{.n_expert = 70000}, "--experts 70000"},
      {{.n_expert = 8, .k = 9}, "--top-k 9"},
      {{.n_steps = 0}, "--steps 0"},
      {{.n_steps = int64_t{1} << 40}, "--steps"},
      {{.zipf_s = -1.0}, "--zipf"},
      {{.reuse = 1.5}, "--reuse 1.5"},
      {{.drift_period = -1}, "--drift -1"},
  };
  for (const auto& [bad_spec, flag] : bad) {
    absl::StatusOr<RoutingTrace> r = SynthesizeTrace(bad_spec);
    ASSERT_FALSE(r.ok()) << flag;
    EXPECT_NE(r.status().message().find(flag), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace moegraph
