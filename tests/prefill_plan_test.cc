// The prefill's plan of a layer (residency/prefill_plan.h): every (token, rank)
// once, grouped by expert in ascending order, resident experts in place,
// the others streamed through the ring, the slot table only read.
#include "residency/prefill_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "residency/policy.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

TEST(PrefillPlanTest, EveryTokenRankOnceGroupedByExpertResidentInPlaceOthersStreamed) {
  std::mt19937 rng(3);
  constexpr int32_t n_expert = 32, k = 4, tokens = 61, ring = 2;
  constexpr uint64_t block_bytes = 1000;
  std::vector<int32_t> slot_of(n_expert, kNoSlot);
  for (int32_t e = 0; e < n_expert; e += 3) slot_of[e] = e / 3;  // 11 resident experts
  std::vector<int32_t> selection;
  for (int32_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> ids(n_expert);
    for (int32_t e = 0; e < n_expert; ++e) ids[e] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    selection.insert(selection.end(), ids.begin(), ids.begin() + k);
  }
  const std::vector<int32_t> table_before = slot_of;
  absl::StatusOr<PrefillLayerPlan> plan =
      PlanPrefillLayer(selection, k, slot_of, ring, block_bytes);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(slot_of, table_before);

  std::vector<int> seen(selection.size(), 0);
  int32_t previous_expert = -1, in_place = 0, streamed = 0;
  for (const PrefillGroup& g : plan->groups) {
    EXPECT_GT(g.expert, previous_expert);
    previous_expert = g.expert;
    EXPECT_EQ(g.slot, slot_of[g.expert]);
    if (g.slot == kNoSlot) {
      EXPECT_EQ(g.ring_buffer, streamed % ring);  // alternating: the next copies while one computes
      ++streamed;
    } else {
      EXPECT_EQ(g.ring_buffer, -1);
      ++in_place;
    }
    ASSERT_GT(g.count, 0);
    for (int32_t i = g.first; i < g.first + g.count; ++i) {
      const int32_t entry = plan->entries[i];
      EXPECT_EQ(selection[entry], g.expert);
      ++seen[entry];
      if (i > g.first) EXPECT_LT(plan->entries[i - 1] / k, entry / k);  // ascending tokens
    }
  }
  EXPECT_EQ(seen, std::vector<int>(selection.size(), 1));
  EXPECT_EQ(plan->in_place, in_place);
  EXPECT_EQ(plan->streamed, streamed);
  EXPECT_GT(in_place, 0);
  EXPECT_GT(streamed, 0);
  EXPECT_EQ(plan->bytes_streamed, static_cast<uint64_t>(streamed) * block_bytes);
}

TEST(PrefillPlanTest, AnExpertOutOfRangeOrAnEmptyRingIsAnErrorNamingIt) {
  const std::vector<int32_t> slot_of(8, kNoSlot);
  absl::StatusOr<PrefillLayerPlan> plan = PlanPrefillLayer({1, 2, 3, 9}, 2, slot_of, 2, 64);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(testing_util::MessageHas(plan.status(), "token 1 rank 1 routes to expert 9 of 8"))
      << plan.status();
  plan = PlanPrefillLayer({1, 2, 3}, 2, slot_of, 2, 64);
  EXPECT_FALSE(plan.ok());
  plan = PlanPrefillLayer({1, 2}, 2, slot_of, 0, 64);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(testing_util::MessageHas(plan.status(), "a ring of 0 staging buffers"))
      << plan.status();
  plan = PlanPrefillLayer({}, 2, slot_of, 2, 64);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->groups.empty());
}

}  // namespace
}  // namespace moegraph
