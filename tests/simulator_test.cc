// The trace simulator: hit counts worked out by hand for LRU, SLRU and OPT on
// small traces, OPT's bound on random and real traces, the real trace's
// published OPT numbers, and the cost model's arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "residency/cache.h"
#include "residency/simulator.h"
#include "residency/trace.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::SharedPath;

// ids: [n_steps][n_layer][k] flattened; kMissingExpert marks a missing row.
RoutingTrace MakeTrace(int32_t n_layer, int32_t n_expert, int32_t k, std::vector<uint16_t> ids) {
  RoutingTrace trace;
  trace.n_layer = n_layer;
  trace.n_expert = n_expert;
  trace.k = k;
  trace.n_steps = static_cast<int64_t>(ids.size()) / (n_layer * k);
  trace.ids = std::move(ids);
  return trace;
}

SimResult SimulateOnce(const RoutingTrace& trace, const std::string& policy, int32_t n_slots,
                       PoolMode pool = PoolMode::kGlobal,
                       double protected_frac = kDefaultProtectedFrac) {
  absl::StatusOr<SimTrace> sim = SimTrace::Create(trace);
  EXPECT_TRUE(sim.ok()) << sim.status();
  if (!sim.ok()) return {};
  SimConfig config;
  config.policy = policy;
  config.n_slots = n_slots;
  config.pool_mode = pool;
  config.protected_frac = protected_frac;
  absl::StatusOr<SimResult> result = Simulate(*sim, config);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : SimResult{};
}

// Three keys cycling through two slots: LRU (and SLRU, which never promotes
// anything here since no key is hit) always evicts the key needed next, so every
// access misses. OPT, accesses 0:a 1:b 2:c 3:a 4:b 5:c: c evicts b (next use 4,
// farther than a's 3); a hits; b evicts a (never used again) over c (5); c hits.
TEST(SimulatorTest, CyclicKeysDefeatLruButNotOpt) {
  const RoutingTrace trace = MakeTrace(1, 4, 1, {0, 1, 2, 0, 1, 2});
  const SimResult lru = SimulateOnce(trace, "lru", 2);
  EXPECT_EQ(lru.hits, 0);
  EXPECT_EQ(lru.misses, 6);
  EXPECT_EQ(lru.evictions, 4);
  EXPECT_EQ(SimulateOnce(trace, "slru", 2).hits, 0);
  const SimResult opt = SimulateOnce(trace, "opt", 2);
  EXPECT_EQ(opt.hits, 2);
  EXPECT_EQ(opt.misses, 4);
  EXPECT_EQ(opt.evictions, 2);
  EXPECT_EQ(opt.n_steps, 6);
}

// A A B B C D E F G A B with 4 slots. LRU: the scan C..G pushes out A and B, so
// only the second A and second B hit (2). SLRU with P = 2: A and B are promoted to
// the protected segment by their second access, the scan only cycles the two
// probation slots, and the final A and B hit too (4). OPT reaches the same 4,
// the most possible: 11 accesses of 7 distinct keys.
TEST(SimulatorTest, SlruResistsAScanThatFlushesLru) {
  enum : uint16_t { A, B, C, D, E, F, G };
  const RoutingTrace trace = MakeTrace(1, 8, 1, {A, A, B, B, C, D, E, F, G, A, B});
  EXPECT_EQ(SimulateOnce(trace, "lru", 4).hits, 2);
  EXPECT_EQ(SimulateOnce(trace, "slru", 4, PoolMode::kGlobal, 0.5).hits, 4);
  EXPECT_EQ(SimulateOnce(trace, "opt", 4).hits, 4);
}

// k = 2, 3 slots, steps {0,1} {2,3} {0,1}. Admitting 3 at step 1 must evict 0 or
// 1 (key 2 is in the selection, even though it is never used again and so is the
// farthest). OPT evicts 1 (next use at access 5, after 0's at 4): step 2 then hits
// 0 only. An OPT that ignored the selection would evict 2 and hit both.
TEST(SimulatorTest, OptNeverEvictsTheCurrentSelection) {
  const RoutingTrace trace = MakeTrace(1, 4, 2, {0, 1, 2, 3, 0, 1});
  const SimResult opt = SimulateOnce(trace, "opt", 3);
  EXPECT_EQ(opt.hits, 1);
  EXPECT_EQ(opt.misses, 5);
  EXPECT_EQ(SimulateOnce(trace, "lru", 3).hits, 1);
}

// Layer 0 always selects expert 0; layer 1 alternates 0, 1. Three keys in all.
// A global pool of 3 holds them all: 8 accesses - 3 first misses = 5 hits. Split
// per layer, layer 0 gets 2 slots and layer 1 one, so layer 1 misses every time
// and only layer 0's last 3 accesses hit.
TEST(SimulatorTest, PerLayerPoolsSplitSlotsFirstLayersFirst) {
  const RoutingTrace trace = MakeTrace(2, 4, 1, {0, 0, 0, 1, 0, 0, 0, 1});
  for (const std::string policy : {"lru", "slru", "opt"}) {
    SCOPED_TRACE(policy);
    EXPECT_EQ(SimulateOnce(trace, policy, 3, PoolMode::kGlobal).hits, 5);
    EXPECT_EQ(SimulateOnce(trace, policy, 3, PoolMode::kPerLayer).hits, 3);
  }
}

// Layer 0 of step 1 is missing: 5 accesses. Two slots hold both keys, so every
// policy misses each key once and hits the other 3 accesses.
TEST(SimulatorTest, MissingRowsAreSkipped) {
  const RoutingTrace trace = MakeTrace(2, 4, 1, {0, 1, kMissingExpert, 1, 0, 1});
  for (const std::string policy : {"lru", "slru", "opt", "default"}) {
    SCOPED_TRACE(policy);
    const SimResult result = SimulateOnce(trace, policy, 2);
    EXPECT_EQ(result.hits, 3);
    EXPECT_EQ(result.misses, 2);
    EXPECT_EQ(result.n_steps, 3);
  }
}

// Accesses (index = row offset + rank) of a 2-layer, k = 2 trace with a missing
// row: the next use of each key, worked out by hand.
TEST(SimulatorTest, NextUseFollowsGlobalAccessOrder) {
  const RoutingTrace trace = MakeTrace(2, 4, 2,
                                       {0, 1, /*L1*/ 0, 2,
                                        /*step 1, L0 missing*/ kMissingExpert, kMissingExpert,
                                        /*L1*/ 2, 3,
                                        /*step 2*/ 1, 0, /*L1*/ 3, 0});
  absl::StatusOr<SimTrace> sim = SimTrace::Create(trace);
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ(sim->n_accesses(), 10);
  constexpr int64_t kNever = SimTrace::kNeverAgain;
  // Layer 0 expert 0 at 0 and 9; L0E1 at 1 and 8; L1E0 at 2 and 11; L1E2 at 3 and 6;
  // L1E3 at 7 and 10. Missing-row entries (4, 5) are never read.
  const std::vector<int64_t> expected = {9,      8,  11,     6,      kNever, kNever,
                                         kNever, 10, kNever, kNever, kNever, kNever};
  EXPECT_EQ(sim->next_use(), expected);
}

TEST(SimulatorTest, BadRowsAndConfigurationsAreErrors) {
  absl::StatusOr<SimTrace> out_of_range = SimTrace::Create(MakeTrace(1, 4, 2, {0, 1, 3, 4}));
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("step 1 layer 0"), std::string::npos)
      << out_of_range.status();
  absl::StatusOr<SimTrace> repeated = SimTrace::Create(MakeTrace(1, 4, 2, {0, 1, 2, 2}));
  ASSERT_FALSE(repeated.ok());
  EXPECT_NE(repeated.status().message().find("twice"), std::string::npos) << repeated.status();

  const RoutingTrace trace = MakeTrace(2, 4, 2, {0, 1, 2, 3});
  absl::StatusOr<SimTrace> sim = SimTrace::Create(trace);
  ASSERT_TRUE(sim.ok()) << sim.status();
  SimConfig config;
  config.n_slots = 1;
  for (const std::string policy : {"lru", "slru", "opt"}) {
    config.policy = policy;
    absl::StatusOr<SimResult> result = Simulate(*sim, config);
    ASSERT_FALSE(result.ok()) << policy;
    EXPECT_NE(result.status().message().find("--slots 1"), std::string::npos) << result.status();
  }
  // 3 slots over 2 layers leave layer 1 one slot, fewer than k = 2.
  config.n_slots = 3;
  config.pool_mode = PoolMode::kPerLayer;
  config.policy = "opt";
  absl::StatusOr<SimResult> per_layer = Simulate(*sim, config);
  ASSERT_FALSE(per_layer.ok());
  EXPECT_NE(per_layer.status().message().find("--slots 3"), std::string::npos)
      << per_layer.status();
  config.policy = "fifo";
  absl::StatusOr<SimResult> unknown = Simulate(*sim, config);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("--policy 'fifo'"), std::string::npos)
      << unknown.status();
}

TEST(SimulatorTest, DefaultRunsTheNamedPolicy) {
  const std::string_view runs = ResolvePolicyName("default");
  const std::vector<std::string_view> names = SimPolicyNames();
  ASSERT_NE(runs, "default");
  ASSERT_NE(std::find(names.begin(), names.end(), runs), names.end());
  std::mt19937 rng(7);
  std::vector<uint16_t> ids;
  for (int i = 0; i < 400; ++i) ids.push_back(static_cast<uint16_t>(rng() % 16));
  const RoutingTrace trace = MakeTrace(4, 16, 1, ids);
  const SimResult by_alias = SimulateOnce(trace, "default", 12);
  const SimResult by_name = SimulateOnce(trace, std::string(runs), 12);
  EXPECT_EQ(by_alias.policy, "default");
  EXPECT_EQ(by_alias.hits, by_name.hits);
  EXPECT_EQ(by_alias.evictions, by_name.evictions);
}

// Skewed rows of k distinct ids: expert e is drawn with weight ~ 1 / (e + 1).
RoutingTrace RandomTrace(uint32_t seed, int32_t n_layer, int32_t n_expert, int32_t k,
                         int64_t n_steps) {
  std::mt19937 rng(seed);
  std::vector<double> weights;
  for (int32_t e = 0; e < n_expert; ++e) weights.push_back(1.0 / (e + 1));
  std::vector<uint16_t> ids;
  for (int64_t i = 0; i < n_steps * n_layer; ++i) {
    std::vector<double> w = weights;
    for (int32_t r = 0; r < k; ++r) {
      std::discrete_distribution<int> pick(w.begin(), w.end());
      const int e = pick(rng);
      w[e] = 0;
      ids.push_back(static_cast<uint16_t>(e));
    }
  }
  return MakeTrace(n_layer, n_expert, k, std::move(ids));
}

// Per pool, every distinct key's first access misses into an empty slot until the
// pool is full; every later miss evicts. So evictions = misses - sum over pools of
// min(pool slots, distinct keys of the pool).
int64_t ExpectedFills(const RoutingTrace& trace, int32_t n_slots, PoolMode pool_mode) {
  CacheConfig config{trace.n_layer, trace.n_expert, trace.k, n_slots, 0.0, pool_mode};
  absl::StatusOr<ResidencyCache> cache = ResidencyCache::Create(config);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return -1;
  std::vector<std::set<int32_t>> keys_of_pool(cache->pools().size());
  for (int64_t step = 0; step < trace.n_steps; ++step) {
    for (int32_t layer = 0; layer < trace.n_layer; ++layer) {
      for (int32_t r = 0; r < trace.k; ++r) {
        keys_of_pool[cache->pool_of_layer(layer)].insert(layer * trace.n_expert +
                                                         trace.row(step, layer)[r]);
      }
    }
  }
  int64_t fills = 0;
  for (size_t p = 0; p < keys_of_pool.size(); ++p) {
    fills += std::min<int64_t>(cache->pools()[p].n_slots, keys_of_pool[p].size());
  }
  return fills;
}

TEST(SimulatorTest, OptBoundsEveryPolicyOnRandomTraces) {
  for (const uint32_t seed : {1u, 2u, 3u}) {
    const RoutingTrace trace = RandomTrace(seed, 4, 16, 3, 150);
    for (const PoolMode pool : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
      for (const int32_t n_slots : {12, 20, 32, 48}) {
        SCOPED_TRACE(testing::Message()
                     << "seed " << seed << " pool " << PoolModeName(pool) << " slots " << n_slots);
        const SimResult opt = SimulateOnce(trace, "opt", n_slots, pool);
        EXPECT_EQ(opt.accesses(), 4 * 3 * 150);
        EXPECT_EQ(opt.evictions, opt.misses - ExpectedFills(trace, n_slots, pool));
        for (const std::string policy : {"lru", "slru", "default"}) {
          const SimResult online = SimulateOnce(trace, policy, n_slots, pool);
          EXPECT_GE(opt.hits, online.hits) << policy;
          EXPECT_EQ(online.accesses(), opt.accesses()) << policy;
          EXPECT_EQ(online.evictions, online.misses - ExpectedFills(trace, n_slots, pool))
              << policy;
        }
      }
    }
  }
}

class RealTraceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TraceReadOptions options;
    options.n_expert_hint = 8;
    trace_ = new absl::StatusOr<RoutingTrace>(
        ReadTraceJsonl(SharedPath("traces/mixtral-8x7b-humaneval.jsonl"), options));
  }
  static void TearDownTestSuite() { delete trace_; }
  void SetUp() override { ASSERT_TRUE(trace_->ok()) << trace_->status(); }

  static absl::StatusOr<RoutingTrace>* trace_;
};
absl::StatusOr<RoutingTrace>* RealTraceTest::trace_ = nullptr;

// The trace README's numbers, measured with a reference simulator on a global
// pool of the 256 (layer, expert) keys, to the precision printed there.
TEST_F(RealTraceTest, MatchesThePublishedHitRates) {
  const RoutingTrace& trace = **trace_;
  ASSERT_EQ(trace.n_layer * trace.n_expert, 256);
  const struct {
    int32_t slots;
    double opt_percent;
  } kPublished[] = {{32, 39.1}, {64, 59.2}, {128, 80.1}, {192, 90.7}};
  for (const auto& row : kPublished) {
    const SimResult opt = SimulateOnce(trace, "opt", row.slots);
    EXPECT_NEAR(100.0 * opt.hit_rate(), row.opt_percent, 0.05) << row.slots << " slots";
  }
  EXPECT_NEAR(100.0 * SimulateOnce(trace, "lru", 32).hit_rate(), 0.1, 0.05);
}

TEST_F(RealTraceTest, OptBoundsEveryPolicy) {
  const RoutingTrace& trace = **trace_;
  for (const PoolMode pool : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
    for (const int32_t n_slots : {64, 96, 128, 192, 256}) {
      const SimResult opt = SimulateOnce(trace, "opt", n_slots, pool);
      for (const std::string policy : {"lru", "slru", "default"}) {
        EXPECT_GE(opt.hits, SimulateOnce(trace, policy, n_slots, pool).hits)
            << policy << " " << PoolModeName(pool) << " " << n_slots;
      }
    }
  }
}

// 1 MiB at 1.048576 GB/s (2^20 B / 1.048576e9 B/s) takes exactly 1 ms, so the
// arithmetic below is exact in milliseconds.
TEST(CostModelTest, PredictsFromMissesAndBandwidth) {
  CostModel model;
  model.block_mib = 0.5;
  model.pcie_gbps = 1.048576;
  model.hbm_gbps = 1.048576;
  SimResult result;
  result.n_steps = 10;
  result.misses = 200;  // 200 * 0.5 MiB / 10 steps = 10 MiB per token: 10 ms
  // Derived t_resident: k 2 x 4 layers x 0.5 MiB = 4 MiB from HBM: 4 ms.
  CostPrediction p = PredictCost(model, result, 2, 4);
  EXPECT_DOUBLE_EQ(p.mib_per_token, 10.0);
  EXPECT_NEAR(p.miss_ms, 10.0, 1e-9);
  EXPECT_NEAR(p.resident_ms, 4.0, 1e-9);
  EXPECT_NEAR(p.tok_s, 1000.0 / 14.0, 1e-9);
  model.resident_ms = 10.0;  // given: used as is
  p = PredictCost(model, result, 2, 4);
  EXPECT_DOUBLE_EQ(p.resident_ms, 10.0);
  EXPECT_NEAR(p.tok_s, 50.0, 1e-9);
}

TEST(CostModelTest, BreakEvenIsClampedToAProbability) {
  CostModel model;
  model.pcie_gbps = 50;
  model.ram_gbps = 80;
  EXPECT_DOUBLE_EQ(BreakEvenHitRate(model), 0.375);
  model.pcie_gbps = 100;  // PCIe faster than RAM: caching always pays
  EXPECT_DOUBLE_EQ(BreakEvenHitRate(model), 0.0);
}

TEST(CostModelTest, RejectsNonPositiveBandwidths) {
  CostModel good;
  EXPECT_TRUE(ValidateCostModel(good).ok());
  CostModel bad = good;
  bad.pcie_gbps = 0;
  EXPECT_NE(ValidateCostModel(bad).message().find("--pcie-gbps"), std::string::npos);
  bad = good;
  bad.ram_gbps = std::nan("");
  EXPECT_NE(ValidateCostModel(bad).message().find("--ram-gbps"), std::string::npos);
  bad = good;
  bad.block_mib = -1;
  EXPECT_NE(ValidateCostModel(bad).message().find("--block-mib"), std::string::npos);
  bad = good;
  bad.resident_ms = -0.5;
  EXPECT_NE(ValidateCostModel(bad).message().find("--resident-ms"), std::string::npos);
}

}  // namespace
}  // namespace moegraph
