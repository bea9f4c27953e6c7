// The host residency cache: configuration checks, pool layout, and small
// sequences worked out by hand from the spec in DESIGN.md.
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "residency/cache.h"

namespace moegraph {
namespace {

std::string CreateError(const CacheConfig& config) {
  const absl::StatusOr<ResidencyCache> cache = ResidencyCache::Create(config);
  EXPECT_FALSE(cache.ok());
  return cache.ok() ? "" : std::string(cache.status().message());
}

CacheConfig Config(int32_t n_layer, int32_t n_expert, int32_t k, int32_t n_slots,
                   double protected_frac, PoolMode mode = PoolMode::kGlobal) {
  return CacheConfig{n_layer, n_expert, k, n_slots, protected_frac, mode};
}

ResidencyCache MustCreate(const CacheConfig& config) {
  absl::StatusOr<ResidencyCache> cache = ResidencyCache::Create(config);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return std::move(cache).value();
}

// Steps a one-layer cache, checks the invariants, and returns a copy of the result.
LayerStep StepLayer0(ResidencyCache& cache, std::vector<int32_t> experts) {
  LayerStep step = cache.Step(0, experts.data());
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
  return step;
}

TEST(ResidencyCacheCreate, RefusesAGlobalPoolSmallerThanTopK) {
  const std::string message = CreateError(Config(4, 8, 2, 1, 0.5));
  EXPECT_NE(message.find("--slots 1 is below the 2 experts a token selects"), std::string::npos) << message;
}

TEST(ResidencyCacheCreate, RefusesAPerLayerPartitionLeavingALayerShort) {
  // 16 slots over 32 layers: layers 0..15 get one slot, layers 16..31 none.
  const std::string message = CreateError(Config(32, 8, 2, 16, 0.0, PoolMode::kPerLayer));
  EXPECT_NE(message.find("--slots 16 with --pool per-layer gives layer 31 0 slots, fewer than "
                         "the 2 experts a token selects"),
            std::string::npos)
      << message;
  // 63 slots: the last layer gets 1 while k = 2; 64 gives every layer 2.
  EXPECT_NE(CreateError(Config(32, 8, 2, 63, 0.0, PoolMode::kPerLayer)).find("layer 31 1 slots"),
            std::string::npos);
  EXPECT_TRUE(ResidencyCache::Create(Config(32, 8, 2, 64, 0.0, PoolMode::kPerLayer)).ok());
}

TEST(ResidencyCacheCreate, RefusesBadShapesNamingTheField) {
  EXPECT_NE(CreateError(Config(0, 8, 2, 4, 0.0)).find("n_layer 0"), std::string::npos);
  EXPECT_NE(CreateError(Config(2, 0, 2, 4, 0.0)).find("n_expert 0"), std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 0, 4, 0.0)).find("--top-k 0"), std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 9, 20, 0.0)).find("--top-k 9 exceeds the 8 experts"),
            std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 2, 0, 0.0)).find("--slots 0"), std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 2, 4, -0.1)).find("--protected-frac -0.1"),
            std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 2, 4, 1.5)).find("--protected-frac 1.5"), std::string::npos);
  EXPECT_NE(CreateError(Config(2, 8, 2, 4, std::nan(""))).find("--protected-frac"),
            std::string::npos);
  EXPECT_NE(CreateError(Config(1 << 16, 1 << 16, 2, 4, 0.0)).find("overflow"),
            std::string::npos);
}

TEST(ResidencyCacheCreate, PerLayerGivesTheRemainderToTheFirstLayers) {
  // 7 slots over 3 layers: 3, 2, 2, laid out layer after layer; P = floor(n * 0.5).
  const ResidencyCache cache = MustCreate(Config(3, 4, 2, 7, 0.5, PoolMode::kPerLayer));
  ASSERT_EQ(cache.pools().size(), 3u);
  const int32_t expected_begin[] = {0, 3, 5};
  const int32_t expected_slots[] = {3, 2, 2};
  const int32_t expected_cap[] = {1, 1, 1};
  for (int32_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(cache.pool_of_layer(layer), layer);
    EXPECT_EQ(cache.pools()[layer].slot_begin, expected_begin[layer]);
    EXPECT_EQ(cache.pools()[layer].n_slots, expected_slots[layer]);
    EXPECT_EQ(cache.pools()[layer].protected_cap, expected_cap[layer]);
  }
  EXPECT_EQ(cache.owner().size(), 7u);
  EXPECT_EQ(cache.table().size(), 12u);
}

TEST(ResidencyCacheCreate, ClampsSlotsBeyondEveryExpert) {
  // 2 layers x 4 experts = 8 keys: 100 slots become 8, per layer 4 each.
  const ResidencyCache global = MustCreate(Config(2, 4, 2, 100, 0.8));
  EXPECT_EQ(global.config().n_slots, 8);
  ASSERT_EQ(global.pools().size(), 1u);
  EXPECT_EQ(global.pools()[0].n_slots, 8);
  EXPECT_EQ(global.pools()[0].protected_cap, 6);  // floor(8 * 0.8)
  const ResidencyCache per_layer = MustCreate(Config(2, 4, 2, 100, 0.8, PoolMode::kPerLayer));
  EXPECT_EQ(per_layer.config().n_slots, 8);
  EXPECT_EQ(per_layer.pools()[0].n_slots, 4);
  EXPECT_EQ(per_layer.pools()[1].slot_begin, 4);
  EXPECT_EQ(per_layer.pools()[1].n_slots, 4);
}

// N = 3 slots, k = 2, P = floor(3 * 0.4) = 1, one layer of 5 experts (key = expert).
// Stamps come from one clock; "prob"/"PROT" is the segment.
TEST(ResidencyCacheStep, HandWorkedSlruWithOneProtectedSlot) {
  ResidencyCache cache = MustCreate(Config(1, 5, 2, 3, 0.4));
  ASSERT_EQ(cache.pools()[0].protected_cap, 1);

  // Step 1, {0, 1}: two misses fill the lowest empty slots.
  //   slot0 = 0 prob @0, slot1 = 1 prob @1.
  LayerStep s = StepLayer0(cache, {0, 1});
  EXPECT_EQ(s.outcome.n_hits, 0);
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(s.missed, (std::vector<uint8_t>{1, 1}));
  EXPECT_TRUE(s.evicted_keys.empty());

  // Step 2, {2, 0}: hits first, so 0 is promoted (PROT @2) before 2 misses into
  // the last empty slot (prob @3).
  s = StepLayer0(cache, {2, 0});
  EXPECT_EQ(s.outcome.n_hits, 1);
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(s.missed, (std::vector<uint8_t>{1, 0}));
  EXPECT_TRUE(s.evicted_keys.empty());
  EXPECT_EQ(cache.owner(), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProtected, kProbation, kProbation}));

  // Step 3, {3, 1}: 1 is promoted (PROT @4); two protected exceed P = 1, so the
  // older one, 0 (@2), goes back to probation as its newest (@5). The miss 3
  // evicts the oldest probation key outside {3, 1}: 2 (@3) in slot 2.
  s = StepLayer0(cache, {3, 1});
  EXPECT_EQ(s.outcome.n_hits, 1);
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(s.missed, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(s.evicted_keys, (std::vector<int32_t>{2}));
  EXPECT_EQ(cache.owner(), (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProbation, kProtected, kProbation}));
  EXPECT_EQ(cache.table(), (std::vector<int32_t>{0, 1, kNoSlot, 2, kNoSlot}));

  // Step 4, {4, 0}: 0 is promoted (@7) and demotes 1 (@8). Probation is then
  // 3 (@6), 1 (@8): the miss 4 evicts 3 from slot 2.
  s = StepLayer0(cache, {4, 0});
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(s.evicted_keys, (std::vector<int32_t>{3}));
  EXPECT_EQ(cache.owner(), (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProtected, kProbation, kProbation}));

  // Step 5, {2, 3}: a scan of two new experts. Probation 1 (@8), 4 (@9) absorbs
  // it: 2 evicts 1 (slot 1), then 3 evicts 4 (slot 2; slot 1 now holds 2, of the
  // selection). The protected 0 survives although its stamp (@7) is the oldest:
  // plain LRU would have evicted it first.
  s = StepLayer0(cache, {2, 3});
  EXPECT_EQ(s.outcome.n_hits, 0);
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(s.evicted_keys, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(cache.table(), (std::vector<int32_t>{0, kNoSlot, 1, 2, kNoSlot}));
}

// protected_frac = 1: P = N, nothing is ever demoted, and a miss takes a
// protected victim only when every probation slot holds the selection.
TEST(ResidencyCacheStep, HandWorkedProtectedVictimWhenProbationIsAllSelected) {
  ResidencyCache cache = MustCreate(Config(1, 5, 2, 3, 1.0));
  StepLayer0(cache, {0, 1});  // slot0 = 0 @0, slot1 = 1 @1, both prob
  StepLayer0(cache, {0, 1});  // both hit: PROT 0 @2, PROT 1 @3
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProtected, kProtected, kProbation}));
  // {2, 3}: 2 takes the empty slot 2 (prob). For 3, the only probation slot holds
  // 2, of the selection, so the oldest protected key, 0 (@2), goes.
  const LayerStep s = StepLayer0(cache, {2, 3});
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(s.evicted_keys, (std::vector<int32_t>{0}));
  EXPECT_EQ(cache.owner(), (std::vector<int32_t>{3, 1, 2}));
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProbation, kProtected, kProbation}));
  EXPECT_EQ(*cache.pools()[0].n_protected, 1);
}

// P = 0 is LRU: 2 slots, k = 1. After 0, 1, 0 the least recent is 1, so 2 evicts 1.
TEST(ResidencyCacheStep, HandWorkedLruWhenNothingIsProtected) {
  ResidencyCache cache = MustCreate(Config(1, 4, 1, 2, 0.0));
  StepLayer0(cache, {0});
  StepLayer0(cache, {1});
  const LayerStep hit = StepLayer0(cache, {0});
  EXPECT_EQ(hit.outcome.n_hits, 1);
  // A hit passes through the protected segment and straight back (P = 0).
  EXPECT_EQ(cache.seg(), (std::vector<uint8_t>{kProbation, kProbation}));
  const LayerStep miss = StepLayer0(cache, {2});
  EXPECT_EQ(miss.evicted_keys, (std::vector<int32_t>{1}));
  EXPECT_EQ(miss.slot_of_rank, (std::vector<int32_t>{1}));
}

// Per-layer pools never touch each other's slots; a global pool shares them.
TEST(ResidencyCacheStep, PerLayerPoolsKeepToTheirSlots) {
  ResidencyCache cache = MustCreate(Config(2, 4, 2, 4, 0.5, PoolMode::kPerLayer));
  const int32_t layer0[] = {0, 1};
  const int32_t layer1[] = {0, 1};
  EXPECT_EQ(cache.Step(0, layer0).slot_of_rank, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(cache.Step(1, layer1).slot_of_rank, (std::vector<int32_t>{2, 3}));
  // Layer 1's pool is full: expert 0 (key 4) hits and is protected, so the new
  // expert 2 evicts expert 1 (key 5) from slot 3, inside layer 1's pool.
  const int32_t layer1_next[] = {2, 0};
  const LayerStep& s = cache.Step(1, layer1_next);
  EXPECT_EQ(s.evicted_keys, (std::vector<int32_t>{5}));  // key of (layer 1, expert 1)
  EXPECT_EQ(s.slot_of_rank, (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(cache.table()[0], 0);
  EXPECT_EQ(cache.table()[1], 1);
  EXPECT_TRUE(cache.CheckInvariants().ok()) << cache.CheckInvariants();
}

TEST(ResidencyCacheStep, TraceIdsStepLikeInt32Ids) {
  ResidencyCache wide = MustCreate(Config(3, 6, 2, 5, 0.4));
  ResidencyCache narrow = MustCreate(Config(3, 6, 2, 5, 0.4));
  for (int32_t t = 0; t < 40; ++t) {
    const int32_t layer = t % 3;
    const int32_t ids[] = {(t * 5 + layer) % 6, (t * 5 + layer + 1 + t % 4) % 6};
    const uint16_t ids16[] = {static_cast<uint16_t>(ids[0]), static_cast<uint16_t>(ids[1])};
    const LayerStep& a = wide.Step(layer, ids);
    const LayerStep& b = narrow.Step(layer, ids16);
    EXPECT_EQ(a.slot_of_rank, b.slot_of_rank);
    EXPECT_EQ(a.evicted_keys, b.evicted_keys);
  }
  EXPECT_EQ(wide.table(), narrow.table());
}

// The pools point into the cache's counters: a moved cache must keep stepping
// on its own state, exactly like a twin that was never moved.
TEST(ResidencyCacheStep, AMovedCacheStillStepsCorrectly) {
  const CacheConfig config = Config(2, 6, 2, 6, 0.5, PoolMode::kPerLayer);
  ResidencyCache twin = MustCreate(config);
  ResidencyCache original = MustCreate(config);
  const auto step_both = [&](ResidencyCache& moved, int32_t t) {
    const int32_t layer = t % 2;
    const int32_t ids[] = {t % 6, (t / 2 + 3) % 6 == t % 6 ? (t + 1) % 6 : (t / 2 + 3) % 6};
    const LayerStep& a = twin.Step(layer, ids);
    const LayerStep& b = moved.Step(layer, ids);
    EXPECT_EQ(a.slot_of_rank, b.slot_of_rank);
    EXPECT_EQ(a.evicted_keys, b.evicted_keys);
    EXPECT_EQ(twin.table(), moved.table());
    EXPECT_EQ(twin.seg(), moved.seg());
    EXPECT_TRUE(moved.CheckInvariants().ok()) << moved.CheckInvariants();
  };
  for (int32_t t = 0; t < 20; ++t) step_both(original, t);
  ResidencyCache constructed(std::move(original));
  for (int32_t t = 20; t < 40; ++t) step_both(constructed, t);
  ResidencyCache assigned = MustCreate(config);
  assigned = std::move(constructed);
  for (int32_t t = 40; t < 60; ++t) step_both(assigned, t);
  for (size_t p = 0; p < assigned.pools().size(); ++p) {
    EXPECT_EQ(*assigned.pools()[p].n_protected, *twin.pools()[p].n_protected);
    EXPECT_EQ(*assigned.pools()[p].clock, *twin.pools()[p].clock);
  }
}

}  // namespace
}  // namespace moegraph
