// The array form of the residency policy (residency/policy.h through
// ResidencyCache) against the list-based reference of the same spec
// (tests/residency_reference.h), step for step, over seeded random traces and
// the real Mixtral routing trace; and protected_frac = 0 against a tiny LRU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <list>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "residency/cache.h"
#include "residency/trace.h"
#include "tests/residency_reference.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::SharedPath;

struct Selection {
  int32_t layer;
  std::vector<int32_t> experts;  // rank order
};

struct Trace {
  int32_t n_layer = 0;
  int32_t n_expert = 0;
  int32_t k = 0;
  int64_t n_steps = 0;                // tokens
  std::vector<Selection> selections;  // in decode order; missing (step, layer) pairs skipped
};

constexpr double kFracs[] = {0.0, 0.2, 0.5, 0.8, 1.0};

std::string Describe(const CacheConfig& c) {
  return absl::StrFormat("L=%d E=%d k=%d N=%d frac=%g pool=%s", c.n_layer, c.n_expert, c.k,
                         c.n_slots, c.protected_frac,
                         c.pool_mode == PoolMode::kGlobal ? "global" : "per-layer");
}

// Keys of one segment of an array pool, least recent first (by stamp).
std::list<int32_t> ArraySegment(const ResidencyCache& cache, const ResidencyPool& pool,
                                uint8_t segment) {
  std::vector<std::pair<uint64_t, int32_t>> by_stamp;
  for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
    if (cache.owner()[slot] != kNoKey && cache.seg()[slot] == segment) {
      by_stamp.emplace_back(cache.stamp()[slot], cache.owner()[slot]);
    }
  }
  std::sort(by_stamp.begin(), by_stamp.end());
  std::list<int32_t> keys;
  for (const auto& [stamp, key] : by_stamp) keys.push_back(key);
  return keys;
}

// Steps the array cache and the reference through the trace; stops at the first
// step where they disagree or an invariant breaks.
void RunBoth(const CacheConfig& config, const std::vector<Selection>& selections) {
  SCOPED_TRACE(Describe(config));
  absl::StatusOr<ResidencyCache> created = ResidencyCache::Create(config);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return;
  ResidencyCache& cache = *created;
  ReferenceCache reference(config);
  EXPECT_EQ(reference.n_pools(), static_cast<int32_t>(cache.pools().size()));
  for (size_t t = 0; t < selections.size(); ++t) {
    SCOPED_TRACE(absl::StrFormat("step %d (layer %d)", t, selections[t].layer));
    const Selection& sel = selections[t];
    const LayerStep& got = cache.Step(sel.layer, sel.experts.data());
    const ReferenceStep want = reference.Step(sel.layer, sel.experts);
    EXPECT_EQ(got.outcome.n_hits, want.n_hits);
    EXPECT_EQ(got.outcome.n_misses, config.k - got.outcome.n_hits);
    EXPECT_EQ(got.outcome.n_evictions, static_cast<int32_t>(got.evicted_keys.size()));
    EXPECT_EQ(got.slot_of_rank, want.slot_of_rank);
    EXPECT_EQ(got.missed, want.missed);
    EXPECT_EQ(got.evicted_keys, want.evicted_keys);
    EXPECT_EQ(cache.table(), reference.Table());
    for (size_t p = 0; p < cache.pools().size(); ++p) {
      const ResidencyPool& pool = cache.pools()[p];
      EXPECT_EQ(ArraySegment(cache, pool, kProbation), reference.pool(p).probation);
      EXPECT_EQ(ArraySegment(cache, pool, kProtected), reference.pool(p).protected_keys);
      EXPECT_LE(*pool.n_protected, pool.protected_cap);
    }
    // No expert of the selection was evicted: after the step its slot holds it.
    for (int32_t r = 0; r < config.k; ++r) {
      const int32_t key = residency_key(sel.layer, sel.experts[r], config.n_expert);
      EXPECT_EQ(cache.owner()[got.slot_of_rank[r]], key);
      EXPECT_EQ(std::count(got.evicted_keys.begin(), got.evicted_keys.end(), key), 0);
    }
    const absl::Status invariants = cache.CheckInvariants();
    EXPECT_TRUE(invariants.ok()) << invariants;
    if (::testing::Test::HasFailure()) break;
  }
}

// Plain LRU, written from scratch: per pool a list of keys, least recent first.
// Hits are refreshed in rank order, then misses are admitted in rank order, each
// evicting the least recent key outside the selection once the pool is full.
class TinyLru {
 public:
  explicit TinyLru(const CacheConfig& c) : per_layer_(c.pool_mode == PoolMode::kPerLayer) {
    const int32_t n = std::min(c.n_slots, c.n_layer * c.n_expert);
    const int32_t n_pools = per_layer_ ? c.n_layer : 1;
    for (int32_t p = 0; p < n_pools; ++p) {
      capacity_.push_back(n / n_pools + (p < n % n_pools ? 1 : 0));
    }
    lists_.resize(n_pools);
    n_expert_ = c.n_expert;
  }

  // Returns the hits; evicted receives the evicted keys in order.
  int32_t Step(int32_t layer, const std::vector<int32_t>& experts,
               std::vector<int32_t>* evicted) {
    std::list<int32_t>& lru = lists_[per_layer_ ? layer : 0];
    const size_t capacity = capacity_[per_layer_ ? layer : 0];
    std::vector<int32_t> keys, misses;
    for (int32_t e : experts) keys.push_back(layer * n_expert_ + e);
    int32_t hits = 0;
    for (int32_t key : keys) {
      if (std::find(lru.begin(), lru.end(), key) == lru.end()) {
        misses.push_back(key);
        continue;
      }
      ++hits;
      lru.remove(key);
      lru.push_back(key);
    }
    evicted->clear();
    for (int32_t key : misses) {
      if (lru.size() == capacity) {
        const auto victim = std::find_if(lru.begin(), lru.end(), [&](int32_t held) {
          return std::find(keys.begin(), keys.end(), held) == keys.end();
        });
        evicted->push_back(*victim);
        lru.erase(victim);
      }
      lru.push_back(key);
    }
    return hits;
  }

 private:
  bool per_layer_;
  int32_t n_expert_ = 0;
  std::vector<size_t> capacity_;
  std::vector<std::list<int32_t>> lists_;
};

int64_t CompareWithLru(const CacheConfig& config, const std::vector<Selection>& selections) {
  SCOPED_TRACE(Describe(config));
  absl::StatusOr<ResidencyCache> cache = ResidencyCache::Create(config);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return 0;
  TinyLru lru(config);
  std::vector<int32_t> lru_evicted;
  int64_t hits = 0;
  for (size_t t = 0; t < selections.size(); ++t) {
    SCOPED_TRACE(absl::StrFormat("step %d", t));
    const LayerStep& got = cache->Step(selections[t].layer, selections[t].experts.data());
    const int32_t lru_hits = lru.Step(selections[t].layer, selections[t].experts, &lru_evicted);
    hits += lru_hits;
    EXPECT_EQ(got.outcome.n_hits, lru_hits);
    EXPECT_EQ(got.evicted_keys, lru_evicted);
    if (::testing::Test::HasFailure()) break;
  }
  return hits;
}

// k distinct experts. Skewed routing draws by Zipf-like weights over a per-layer
// order of the experts, so a few experts per layer dominate; uniform draws evenly.
std::vector<int32_t> DrawExperts(std::mt19937_64& rng, int32_t k,
                                 const std::vector<double>& weights) {
  std::vector<double> remaining = weights;
  std::vector<int32_t> picked;
  while (static_cast<int32_t>(picked.size()) < k) {
    std::discrete_distribution<int32_t> draw(remaining.begin(), remaining.end());
    const int32_t e = draw(rng);
    picked.push_back(e);
    remaining[e] = 0.0;
  }
  return picked;
}

Trace RandomTrace(uint64_t seed, int32_t n_layer, int32_t n_expert, int32_t k, bool skewed,
                  int32_t n_tokens) {
  std::mt19937_64 rng(seed);
  Trace trace{n_layer, n_expert, k, n_tokens, {}};
  std::vector<std::vector<double>> weights(n_layer, std::vector<double>(n_expert, 1.0));
  if (skewed) {
    for (auto& layer_weights : weights) {
      std::vector<int32_t> order(n_expert);
      for (int32_t e = 0; e < n_expert; ++e) order[e] = e;
      std::shuffle(order.begin(), order.end(), rng);
      for (int32_t rank = 0; rank < n_expert; ++rank) {
        layer_weights[order[rank]] = 1.0 / std::pow(rank + 1.0, 1.3);
      }
    }
  }
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int32_t> any_layer(0, n_layer - 1);
  for (int32_t token = 0; token < n_tokens; ++token) {
    std::vector<int32_t> previous;
    for (int32_t l = 0; l < n_layer; ++l) {
      if (coin(rng) < 0.1) continue;  // a (step, layer) pair the trace lacks
      // Now and then a layer out of order, as a stress of the pool bookkeeping.
      const int32_t layer = coin(rng) < 0.1 ? any_layer(rng) : l;
      // Often the same expert ids as the layer before: equal ids, distinct keys.
      std::vector<int32_t> experts = !previous.empty() && coin(rng) < 0.4
                                         ? previous
                                         : DrawExperts(rng, k, weights[layer]);
      if (coin(rng) < 0.3) std::shuffle(experts.begin(), experts.end(), rng);
      trace.selections.push_back({layer, experts});
      previous = experts;
    }
  }
  return trace;
}

int32_t MinimumSlots(int32_t n_layer, int32_t k, PoolMode mode) {
  return mode == PoolMode::kGlobal ? k : k * n_layer;
}

TEST(ResidencyReference, AgreesOnSeededRandomTraces) {
  for (uint64_t seed = 1; seed <= 400; ++seed) {
    std::mt19937_64 rng(seed * 7919);
    const auto pick = [&](int32_t lo, int32_t hi) {
      return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
    };
    const int32_t n_layer = pick(1, 6);
    const int32_t n_expert = pick(2, 16);
    const int32_t k = pick(1, std::min(n_expert, 4));
    const PoolMode mode = seed % 2 ? PoolMode::kGlobal : PoolMode::kPerLayer;
    const double frac = kFracs[(seed / 2) % 5];
    const int32_t minimum = MinimumSlots(n_layer, k, mode);
    const int32_t all = n_layer * n_expert;
    int32_t n_slots = minimum;  // exactly k per pool
    switch ((seed / 10) % 4) {
      case 1: n_slots = std::min(all, minimum + pick(1, 3)); break;
      case 2: n_slots = pick(minimum, all); break;
      case 3: n_slots = all + pick(0, 10); break;  // clamped: everything fits
      default: break;
    }
    const bool skewed = (seed / 40) % 2 == 0;
    const Trace trace = RandomTrace(seed, n_layer, n_expert, k, skewed, 120);
    const CacheConfig config{n_layer, n_expert, k, n_slots, frac, mode};
    SCOPED_TRACE(absl::StrFormat("seed %d", seed));
    RunBoth(config, trace.selections);
    if (HasFailure()) return;
  }
}

// Every fraction and pool mode at the tightest pool (exactly k slots per pool),
// where the "never evict the selection" rule decides most victims.
TEST(ResidencyReference, AgreesAtExactlyKSlotsForEveryFraction) {
  for (const PoolMode mode : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
    for (const double frac : kFracs) {
      for (const int32_t k : {1, 2, 3}) {
        const Trace trace = RandomTrace(100 + k, 3, 6, k, k != 2, 80);
        RunBoth({3, 6, k, MinimumSlots(3, k, mode), frac, mode}, trace.selections);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(ResidencyReference, FractionZeroIsPlainLruOnRandomTraces) {
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const PoolMode mode = seed % 2 ? PoolMode::kGlobal : PoolMode::kPerLayer;
    const int32_t k = 1 + seed % 3;
    const Trace trace = RandomTrace(seed, 4, 8, k, seed % 3 == 0, 60);
    const int32_t n_slots = MinimumSlots(4, k, mode) + static_cast<int32_t>(seed % 9);
    CompareWithLru({4, 8, k, n_slots, 0.0, mode}, trace.selections);
    if (HasFailure()) return;
  }
}

// The shared trace through ReadTraceJsonl, present rows only, in decode order.
Trace ReadSharedTrace(const std::string& path) {
  Trace trace;
  const absl::StatusOr<RoutingTrace> routing = ReadTraceJsonl(path, {.n_expert_hint = 8});
  EXPECT_TRUE(routing.ok()) << routing.status();
  if (!routing.ok()) return trace;
  trace.n_layer = routing->n_layer;
  trace.n_expert = routing->n_expert;
  trace.k = routing->k;
  trace.n_steps = routing->n_steps;
  for (int64_t step = 0; step < routing->n_steps; ++step) {
    for (int32_t layer = 0; layer < routing->n_layer; ++layer) {
      if (!routing->present(step, layer)) continue;
      const uint16_t* row = routing->row(step, layer);
      trace.selections.push_back({layer, std::vector<int32_t>(row, row + routing->k)});
    }
  }
  return trace;
}

std::string SharedTracePath() { return SharedPath("traces/mixtral-8x7b-humaneval.jsonl"); }

TEST(ResidencyReference, AgreesOnTheRealMixtralTrace) {
  const Trace trace = ReadSharedTrace(SharedTracePath());
  ASSERT_FALSE(HasFailure());
  // The README: 32 MoE layers, top-2 of 8, 83 token positions; the file has 2579
  // of the 32 x 83 rows, the rest are missing and skipped.
  ASSERT_EQ(trace.n_layer, 32);
  ASSERT_EQ(trace.n_expert, 8);
  ASSERT_EQ(trace.k, 2);
  ASSERT_EQ(trace.n_steps, 83);
  ASSERT_EQ(trace.selections.size(), 2579u);
  for (const PoolMode mode : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
    for (const int32_t n_slots : {2, 32, 64, 100, 128, 192, 256, 300}) {
      if (n_slots < MinimumSlots(32, 2, mode)) continue;
      for (const double frac : kFracs) {
        RunBoth({32, 8, 2, n_slots, frac, mode}, trace.selections);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(ResidencyReference, FractionZeroIsPlainLruOnTheRealTrace) {
  const Trace trace = ReadSharedTrace(SharedTracePath());
  ASSERT_FALSE(HasFailure());
  const int64_t lookups = static_cast<int64_t>(trace.selections.size()) * trace.k;
  for (const PoolMode mode : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
    for (const int32_t n_slots : {2, 32, 64, 128, 192}) {
      if (n_slots < MinimumSlots(32, 2, mode)) continue;
      const int64_t hits = CompareWithLru({32, 8, 2, n_slots, 0.0, mode}, trace.selections);
      if (HasFailure()) return;
      // The README's measured fact: global LRU at 32 slots gets 0.1% hits, since
      // one token touches 64 keys and LRU cycles.
      if (mode == PoolMode::kGlobal && n_slots == 32) {
        EXPECT_NEAR(100.0 * hits / lookups, 0.1, 0.05);
      }
    }
  }
}

}  // namespace
}  // namespace moegraph
