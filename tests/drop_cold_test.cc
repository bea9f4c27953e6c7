// --drop-cold-experts (residency/drop_cold.h, CpuBackendOptions::drop_cold),
// the flash streamer's gates G8a-c on the CPU backend reading its misses from
// disk: at a strength below any weight the output is the bits of no dropping
// and nothing drops; at full strength against a cache of one token's experts
// (which evicts all the time) only top experts are ever read; at top-k 1
// nothing drops.
#include "residency/drop_cold.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "loader/expert_file.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/placement.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

TEST(DropColdTest, TheRuleKeepsTheTopTheResidentAndTheHeavy) {
  EXPECT_TRUE(drop_routing(1, 4, 0.1, 1.0, false));    // 0.1 < 1/4, a miss
  EXPECT_FALSE(drop_routing(1, 4, 0.1, 1.0, true));    // resident: no read to save
  EXPECT_FALSE(drop_routing(0, 4, 0.01, 4.0, false));  // the top expert is always kept
  EXPECT_FALSE(drop_routing(1, 4, 0.3, 1.0, false));   // 0.3 >= 1/4
  EXPECT_TRUE(drop_routing(3, 4, 0.3, 2.0, false));    // 0.3 < 2/4
  EXPECT_FALSE(drop_routing(1, 1, 0.0, 4.0, false));   // top-k 1: nothing to drop
  EXPECT_FALSE(drop_routing(2, 4, 0.0, 0.0, false));   // strength 0: off
}

struct Loaded {
  std::string path;
  std::unique_ptr<GgufFile> file;
  Model model;
  std::unique_ptr<ExpertStore> layouts;
  ~Loaded() { std::remove(path.c_str()); }
};

std::unique_ptr<Loaded> Load(int k, const std::string& name) {
  FixtureSpec spec;
  spec.n_layer = 3;
  spec.n_expert = 16;
  spec.n_expert_used = k;
  spec.n_embd = 64;
  spec.n_ff_exp = 32;
  spec.n_vocab = 128;
  spec.router_skew = 0.5f;
  spec.seed = 11;
  auto l = std::make_unique<Loaded>();
  l->path = testing_util::TempPath(name);
  EXPECT_TRUE(WriteFixture(spec, l->path).ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(l->path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  l->file = *std::move(file);
  absl::StatusOr<Model> model = LoadModel(*l->file);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  l->model = *std::move(model);
  absl::StatusOr<ExpertStore> layouts = ExpertStore::Layouts(l->model);
  EXPECT_TRUE(layouts.ok()) << layouts.status();
  if (!layouts.ok()) return nullptr;
  l->layouts = std::make_unique<ExpertStore>(*std::move(layouts));
  return l;
}

struct Decoded {
  std::vector<float> logits;
  EngineCounters counters;
  int steps = 0;
};

// Tokens fed one at a time (decode steps: dropping applies) from the disk
// tier at one token's working set of slots.
Decoded Decode(const Loaded& l, double strength) {
  Decoded out;
  absl::StatusOr<std::unique_ptr<ExpertFileReader>> reader = ExpertFileReader::Open(l.model);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return out;
  CpuBackendOptions options;
  options.max_ctx = 40;
  options.n_slots = l.model.config.n_moe_layer() * l.model.config.n_expert_used;
  options.disk = reader->get();
  options.drop_cold = strength;
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
      CpuBackend::Create(l.model, l.layouts.get(), options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return out;
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<std::vector<float>> step = (*backend)->Forward({(i * 37 + 5) % 128});
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    out.logits.insert(out.logits.end(), step->begin(), step->end());
    ++out.steps;
  }
  out.counters = (*backend)->counters();
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(DropColdTest, BelowAnyWeightNothingDropsAndTheBitsAreTheSame) {
  std::unique_ptr<Loaded> l = Load(4, "drop-cold-k4.gguf");
  ASSERT_NE(l, nullptr);
  const Decoded plain = Decode(*l, 0.0);
  const Decoded faint = Decode(*l, 1e-12);
  ASSERT_FALSE(plain.logits.empty());
  EXPECT_TRUE(BitEqual(faint.logits, plain.logits));
  EXPECT_EQ(faint.counters.dropped, 0u);
  EXPECT_EQ(faint.counters.misses, plain.counters.misses);
}

TEST(DropColdTest, AtFullStrengthOnlyTopExpertsAreEverRead) {
  std::unique_ptr<Loaded> l = Load(4, "drop-cold-full.gguf");
  ASSERT_NE(l, nullptr);
  const Decoded plain = Decode(*l, 0.0);
  const Decoded full = Decode(*l, 4.0);  // F = k: every non-top miss is dropped
  const uint64_t layer_steps =
      static_cast<uint64_t>(full.steps) * static_cast<uint64_t>(l->model.config.n_moe_layer());
  // Without dropping, a cache of one token's experts misses more than once a layer.
  EXPECT_GT(plain.counters.misses, layer_steps);
  EXPECT_GT(full.counters.dropped, 0u);
  EXPECT_GT(full.counters.dropped_weight, 0.0);
  // Only rank 0 can miss, so at most one read a layer a step, each a miss.
  EXPECT_LE(full.counters.misses, layer_steps);
  EXPECT_EQ(full.counters.disk_reads, full.counters.misses);
  EXPECT_FALSE(BitEqual(full.logits, plain.logits));  // the instrument moves
}

TEST(DropColdTest, AtTopKOneNothingDrops) {
  std::unique_ptr<Loaded> l = Load(1, "drop-cold-k1.gguf");
  ASSERT_NE(l, nullptr);
  const Decoded plain = Decode(*l, 0.0);
  const Decoded full = Decode(*l, 8.0);
  ASSERT_FALSE(plain.logits.empty());
  EXPECT_TRUE(BitEqual(full.logits, plain.logits));
  EXPECT_EQ(full.counters.dropped, 0u);
}

}  // namespace
}  // namespace moegraph
