// The slot budget at its edges: exact fit, one byte short, nothing free, a
// negative remainder, auto, over-request, and inputs whose sum overflows u64.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "residency/budget.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// 2 GiB of overheads and 9 MiB blocks; free VRAM leaves room for `fit` blocks
// plus `extra` bytes.
BudgetInputs Inputs(uint64_t fit, int64_t extra, int64_t requested) {
  BudgetInputs in;
  in.dense_bytes = kGiB;
  in.kv_bytes = kGiB / 2;
  in.scratch_bytes = kGiB / 4;
  in.rail_bytes = kGiB / 4;
  in.block_bytes = 9 * kMiB;
  in.free_vram_bytes = 2 * kGiB + fit * in.block_bytes + extra;
  in.total_experts = 6144;
  in.k = 8;
  in.requested_slots = requested;
  return in;
}

TEST(BudgetTest, BannerShowsTheArithmetic) {
  BudgetInputs in;
  in.free_vram_bytes = 80 * kGiB;
  in.dense_bytes = 3 * kGiB + kGiB / 4;
  in.kv_bytes = kGiB + kGiB / 2;
  in.scratch_bytes = kGiB / 2;
  in.rail_bytes = kGiB;
  in.block_bytes = 9 * kMiB;
  in.total_experts = 6144;
  in.k = 8;
  in.requested_slots = 64;
  absl::StatusOr<SlotBudget> budget = PlanSlots(in);
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_EQ(budget->slots, 64);
  EXPECT_EQ(budget->warning, "");
  // 73.75 GiB = 75520 MiB left; 75520 / 9 = 8391.1.
  EXPECT_EQ(budget->banner,
            "slots: min(requested 64, 6144 experts, (80.00 GiB free - 3.25 GiB dense - 1.50 GiB "
            "KV - 512.00 MiB scratch - 1.00 GiB rail) / 9.00 MiB = 8391) = 64 of 6144 experts");
}

TEST(BudgetTest, ExactFitGetsEverySlotAndOneMoreIsScaledDown) {
  absl::StatusOr<SlotBudget> exact = PlanSlots(Inputs(100, 0, 100));
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(exact->slots, 100);
  EXPECT_EQ(exact->warning, "");
  absl::StatusOr<SlotBudget> over = PlanSlots(Inputs(100, 0, 101));
  ASSERT_TRUE(over.ok()) << over.status();
  EXPECT_EQ(over->slots, 100);
  EXPECT_TRUE(Contains(over->warning, "--slots 101")) << over->warning;
  EXPECT_TRUE(Contains(over->warning, "scaled down to 100")) << over->warning;
  // One byte short of 100 blocks: 99 fit.
  absl::StatusOr<SlotBudget> short_one = PlanSlots(Inputs(100, -1, 100));
  ASSERT_TRUE(short_one.ok()) << short_one.status();
  EXPECT_EQ(short_one->slots, 99);
}

TEST(BudgetTest, FewerThanTopKSlotsIsAMemoryError) {
  absl::StatusOr<SlotBudget> exactly_k = PlanSlots(Inputs(8, 0, 0));
  ASSERT_TRUE(exactly_k.ok()) << exactly_k.status();
  EXPECT_EQ(exactly_k->slots, 8);
  absl::StatusOr<SlotBudget> short_one = PlanSlots(Inputs(8, -1, 0));
  ASSERT_FALSE(short_one.ok());
  EXPECT_EQ(short_one.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(std::string(short_one.status().message()), "1 B short"))
      << short_one.status();
  EXPECT_TRUE(Contains(std::string(short_one.status().message()), "top-k 8")) << short_one.status();
}

TEST(BudgetTest, NothingFreeAndNegativeRemainderAreMemoryErrors) {
  BudgetInputs zero = Inputs(0, 0, 0);
  zero.free_vram_bytes = 0;
  absl::StatusOr<SlotBudget> none = PlanSlots(zero);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  // 2 GiB of overheads plus 8 x 9 MiB of blocks missing.
  EXPECT_TRUE(Contains(std::string(none.status().message()), "2.07 GiB short")) << none.status();

  BudgetInputs negative = Inputs(0, 0, 0);
  negative.free_vram_bytes = kGiB;  // less than the dense weights alone
  absl::StatusOr<SlotBudget> below = PlanSlots(negative);
  ASSERT_FALSE(below.ok());
  EXPECT_EQ(below.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(std::string(below.status().message()), "= -1.00 GiB")) << below.status();
}

TEST(BudgetTest, AutoTakesWhatFitsAndHoldsEveryExpertWhenAllFit) {
  absl::StatusOr<SlotBudget> partial = PlanSlots(Inputs(500, 5, 0));
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_EQ(partial->slots, 500);
  EXPECT_EQ(partial->warning, "");
  EXPECT_TRUE(Contains(partial->banner, "min(auto, ")) << partial->banner;

  absl::StatusOr<SlotBudget> all = PlanSlots(Inputs(7000, 0, 0));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->slots, 6144);
  EXPECT_EQ(all->warning, "");
  EXPECT_TRUE(Contains(all->banner, "= 6144 of 6144 experts (every expert resident)"))
      << all->banner;
}

// Three engines side by side: each pays its own 1.75 GiB of overheads out of a
// third of (free - rail), and the three pools together fit what is free.
TEST(BudgetTest, SharingEnginesSplitTheFreeMemoryEvenly) {
  BudgetInputs in = Inputs(0, 0, 0);
  in.free_vram_bytes = in.rail_bytes + 3 * (7 * kGiB / 4 + 100 * in.block_bytes) + 2;
  in.sharing_engines = 3;
  absl::StatusOr<SlotBudget> shared = PlanSlots(in);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->slots, 100);
  EXPECT_TRUE(Contains(shared->banner, "rail) / 3 engines - 1.00 GiB dense")) << shared->banner;
  const uint64_t used = 3 * (in.dense_bytes + in.kv_bytes + in.scratch_bytes +
                             static_cast<uint64_t>(shared->slots) * in.block_bytes);
  EXPECT_LE(used + in.rail_bytes, in.free_vram_bytes);

  in.sharing_engines = 1;
  absl::StatusOr<SlotBudget> alone = PlanSlots(in);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_GT(alone->slots, 3 * shared->slots);  // one engine pays the overheads once

  in.sharing_engines = 0;
  absl::StatusOr<SlotBudget> none = PlanSlots(in);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(Contains(std::string(none.status().message()), "0 engines")) << none.status();
}

TEST(BudgetTest, RequestAboveTheExpertCount) {
  // Memory for all: the pool holds every expert, with a warning.
  absl::StatusOr<SlotBudget> all = PlanSlots(Inputs(7000, 0, 9000));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->slots, 6144);
  EXPECT_TRUE(Contains(all->warning, "holds them all")) << all->warning;
  // Memory for fewer: scaled down to what fits.
  absl::StatusOr<SlotBudget> some = PlanSlots(Inputs(3000, 0, 9000));
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(some->slots, 3000);
  EXPECT_TRUE(Contains(some->warning, "scaled down to 3000")) << some->warning;
}

TEST(BudgetTest, BadRequestsAndInputsNameTheProblem) {
  absl::StatusOr<SlotBudget> below_k = PlanSlots(Inputs(100, 0, 7));
  ASSERT_FALSE(below_k.ok());
  EXPECT_EQ(below_k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(std::string(below_k.status().message()), "--slots 7")) << below_k.status();
  absl::StatusOr<SlotBudget> negative = PlanSlots(Inputs(100, 0, -4));
  ASSERT_FALSE(negative.ok());
  EXPECT_TRUE(Contains(std::string(negative.status().message()), "--slots -4"))
      << negative.status();
  BudgetInputs no_block = Inputs(100, 0, 0);
  no_block.block_bytes = 0;
  EXPECT_FALSE(PlanSlots(no_block).ok());
  BudgetInputs k_above_total = Inputs(100, 0, 0);
  k_above_total.total_experts = 4;
  EXPECT_FALSE(PlanSlots(k_above_total).ok());
}

TEST(BudgetTest, ArithmeticDoesNotOverflow) {
  // Overheads summing past 2^64: a u64 sum would wrap to a small number and
  // claim the whole free VRAM for slots.
  BudgetInputs wrap = Inputs(0, 0, 0);
  wrap.free_vram_bytes = kMax;
  wrap.dense_bytes = kMax / 2 + 1;
  wrap.kv_bytes = kMax / 2 + 1;
  absl::StatusOr<SlotBudget> wrapped = PlanSlots(wrap);
  ASSERT_FALSE(wrapped.ok());
  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kResourceExhausted);

  // The largest inputs that fit: 2^64 - 1 one-byte blocks, capped by the expert count.
  BudgetInputs huge;
  huge.free_vram_bytes = kMax;
  huge.block_bytes = 1;
  huge.total_experts = std::numeric_limits<int64_t>::max();
  huge.k = 1;
  absl::StatusOr<SlotBudget> all = PlanSlots(huge);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->slots, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(Contains(all->banner, "= 18446744073709551615)")) << all->banner;
}

}  // namespace
}  // namespace moegraph
