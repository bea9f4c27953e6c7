// PolicyCache: the policy names, and that each policy behind the one type steps
// exactly as its own cache and snapshots the arrays it keeps.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "residency/cache.h"
#include "residency/hazard_cache.h"
#include "residency/policy.h"
#include "residency/policy_cache.h"

namespace moegraph {
namespace {

CacheConfig Config() {
  CacheConfig config;
  config.n_layer = 4;
  config.n_expert = 16;
  config.k = 2;
  config.n_slots = 10;
  config.protected_frac = 0.8;
  return config;
}

TEST(PolicyCacheTest, NamesParseBackAndBadNamesNameTheFlag) {
  for (const ResidencyPolicy policy :
       {ResidencyPolicy::kLru, ResidencyPolicy::kSlru, ResidencyPolicy::kHazard}) {
    const absl::StatusOr<ResidencyPolicy> parsed = ParseResidencyPolicy(PolicyName(policy), "X");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, policy);
  }
  const absl::StatusOr<ResidencyPolicy> bad = ParseResidencyPolicy("opt", "MOEGRAPH_POLICY");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "MOEGRAPH_POLICY='opt' must be hazard, slru or lru");
  EXPECT_EQ(DescribePolicy(ResidencyPolicy::kSlru, 0.5), "slru (protected 0.50)");
  EXPECT_EQ(DescribePolicy(ResidencyPolicy::kHazard, 0.5), "hazard");
}

// Each policy through PolicyCache equals its own cache fed the same selections,
// and the snapshot holds exactly the arrays that policy keeps.
TEST(PolicyCacheTest, StepsAsItsOwnCacheAndSnapshotsItsArrays) {
  const CacheConfig config = Config();
  CacheConfig lru_config = config;
  lru_config.protected_frac = 0.0;
  absl::StatusOr<ResidencyCache> lru = ResidencyCache::Create(lru_config);
  absl::StatusOr<ResidencyCache> slru = ResidencyCache::Create(config);
  absl::StatusOr<HazardCache> hazard = HazardCache::Create(config);
  absl::StatusOr<PolicyCache> as_lru = PolicyCache::Create(ResidencyPolicy::kLru, config);
  absl::StatusOr<PolicyCache> as_slru = PolicyCache::Create(ResidencyPolicy::kSlru, config);
  absl::StatusOr<PolicyCache> as_hazard = PolicyCache::Create(ResidencyPolicy::kHazard, config);
  ASSERT_TRUE(lru.ok() && slru.ok() && hazard.ok() && as_lru.ok() && as_slru.ok() &&
              as_hazard.ok());
  std::mt19937 rng(9);
  int64_t hits[2] = {0, 0};
  for (int32_t step = 0; step < 200; ++step) {
    for (int32_t layer = 0; layer < config.n_layer; ++layer) {
      const int32_t a = static_cast<int32_t>(rng() % 6);
      const int32_t experts[2] = {a, a + 1 + static_cast<int32_t>(rng() % 9)};
      EXPECT_EQ(as_lru->Step(layer, experts).slot_of_rank, lru->Step(layer, experts).slot_of_rank);
      EXPECT_EQ(as_slru->Step(layer, experts).slot_of_rank,
                slru->Step(layer, experts).slot_of_rank);
      EXPECT_EQ(as_hazard->Step(layer, experts).slot_of_rank,
                hazard->Step(layer, experts).slot_of_rank);
      hits[0] += as_lru->Step(layer, experts).outcome.n_hits;  // a repeat is all hits
      hits[1] += lru->Step(layer, experts).outcome.n_hits;
    }
  }
  EXPECT_EQ(hits[0], hits[1]);

  const ResidencySnapshot l = as_lru->Snapshot();
  EXPECT_EQ(l.stamp, lru->stamp());
  EXPECT_EQ(l.n_protected, std::vector<int32_t>{0});  // lru: the 0.8 share is not used
  EXPECT_TRUE(l.cell_trials.empty());
  const ResidencySnapshot s = as_slru->Snapshot();
  EXPECT_EQ(s.seg, slru->seg());
  EXPECT_GT(s.n_protected[0], 0);
  const ResidencySnapshot h = as_hazard->Snapshot();
  EXPECT_EQ(h.table, hazard->table());
  EXPECT_EQ(h.cell_trials, hazard->cell_trials());
  EXPECT_EQ(h.frequency, hazard->frequency());
  EXPECT_TRUE(h.stamp.empty() && h.seg.empty() && h.clock.empty());
  EXPECT_FALSE(h == s);
  EXPECT_TRUE(as_hazard->CheckInvariants().ok());
  EXPECT_NE(as_hazard->hazard_cache(), nullptr);
  EXPECT_EQ(as_hazard->slru_cache(), nullptr);
}

// A dropped rank (kNoExpert, --drop-cold-experts) is neither a hit nor a
// miss: no slot, no admission, no eviction; the other ranks step as without it.
TEST(PolicyCacheTest, ADroppedRankTakesNoSlotAndTheOthersStepAsAlone) {
  for (const ResidencyPolicy policy :
       {ResidencyPolicy::kLru, ResidencyPolicy::kSlru, ResidencyPolicy::kHazard}) {
    absl::StatusOr<PolicyCache> cache = PolicyCache::Create(policy, Config());
    ASSERT_TRUE(cache.ok()) << cache.status();
    const int32_t kept_and_dropped[] = {5, kNoExpert};
    const LayerStep& step = cache->Step(1, kept_and_dropped);
    EXPECT_EQ(step.outcome.n_hits, 0);
    EXPECT_EQ(step.outcome.n_misses, 1) << PolicyName(policy);
    EXPECT_EQ(step.missed[0], 1);
    EXPECT_EQ(step.missed[1], 0);
    EXPECT_EQ(step.slot_of_rank[1], kNoSlot);
    const int32_t slot = step.slot_of_rank[0];
    ASSERT_NE(slot, kNoSlot);
    EXPECT_EQ(cache->table()[1 * 16 + 5], slot);
    int32_t held = 0;
    for (const int32_t owner : cache->owner()) held += owner != kNoKey ? 1 : 0;
    EXPECT_EQ(held, 1) << PolicyName(policy);
    // Expert 5 again with another dropped: a hit, nothing else moves.
    const int32_t again[] = {5, kNoExpert};
    const LayerStep& hit = cache->Step(1, again);
    EXPECT_EQ(hit.outcome.n_hits, 1);
    EXPECT_EQ(hit.outcome.n_misses, 0);
    EXPECT_EQ(hit.slot_of_rank[0], slot);
    EXPECT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants();
  }
}

TEST(PolicyCacheTest, RefusalsKeepTheirCachesMessages) {
  CacheConfig config = Config();
  config.n_slots = 1;
  for (const ResidencyPolicy policy : {ResidencyPolicy::kSlru, ResidencyPolicy::kHazard}) {
    const absl::StatusOr<PolicyCache> cache = PolicyCache::Create(policy, config);
    ASSERT_FALSE(cache.ok());
    EXPECT_NE(cache.status().message().find("--slots 1"), std::string::npos) << cache.status();
  }
}

}  // namespace
}  // namespace moegraph
