#include "residency/budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moegraph {
namespace {

// The sum of four u64 values can overflow u64, so the arithmetic is signed 128-bit.
using Wide = __int128;

std::string FormatBytes(Wide bytes) {
  const double value = static_cast<double>(bytes);
  const double magnitude = value < 0 ? -value : value;
  if (magnitude >= 1024.0 * 1024 * 1024) return absl::StrFormat("%.2f GiB", value / (1 << 30));
  if (magnitude >= 1024.0 * 1024) return absl::StrFormat("%.2f MiB", value / (1 << 20));
  if (magnitude >= 1024.0) return absl::StrFormat("%.2f KiB", value / 1024);
  return absl::StrFormat("%d B", static_cast<int64_t>(bytes));
}

}  // namespace

absl::StatusOr<SlotBudget> PlanSlots(const BudgetInputs& in) {
  if (in.block_bytes == 0) {
    return absl::InvalidArgumentError("slot budget: the expert block size is 0 bytes");
  }
  if (in.k < 1 || in.total_experts < in.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "slot budget: top-k %d must be in [1, %d experts]", in.k, in.total_experts));
  }
  if (in.requested_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--slots %d must be 0 (auto) or positive", in.requested_slots));
  }
  if (in.requested_slots > 0 && in.requested_slots < in.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d is below top-k %d: a step needs a slot for each selected expert",
        in.requested_slots, in.k));
  }

  if (in.sharing_engines < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "slot budget: %d engines sharing the device; it takes at least 1", in.sharing_engines));
  }
  const Wide share = (Wide{in.free_vram_bytes} - Wide{in.rail_bytes}) / in.sharing_engines;
  const Wide remainder =
      share - Wide{in.dense_bytes} - Wide{in.kv_bytes} - Wide{in.scratch_bytes};
  const std::string fixed =
      absl::StrCat(" - ", FormatBytes(in.dense_bytes), " dense - ", FormatBytes(in.kv_bytes),
                   " KV - ", FormatBytes(in.scratch_bytes), " scratch");
  const std::string left =
      in.sharing_engines == 1
          ? absl::StrCat(FormatBytes(in.free_vram_bytes), " free", fixed, " - ",
                         FormatBytes(in.rail_bytes), " rail")
          : absl::StrCat("(", FormatBytes(in.free_vram_bytes), " free - ",
                         FormatBytes(in.rail_bytes), " rail) / ", in.sharing_engines,
                         " engines", fixed);
  // remainder <= free VRAM, a u64, so the quotient fits u64.
  const uint64_t fit = remainder > 0 ? static_cast<uint64_t>(remainder / in.block_bytes) : 0;
  if (fit < static_cast<uint64_t>(in.k)) {
    const Wide needed = Wide{in.k} * in.block_bytes;
    return absl::ResourceExhaustedError(absl::StrCat(
        "not enough GPU memory for the expert pool: top-k ", in.k, " slots of ",
        FormatBytes(in.block_bytes), " need ", FormatBytes(needed), ", but ", left, " = ",
        FormatBytes(remainder), " (", FormatBytes(needed - remainder), " short)"));
  }

  const uint64_t total = static_cast<uint64_t>(in.total_experts);
  const uint64_t cap = std::min(fit, total);
  SlotBudget budget;
  const bool is_auto = in.requested_slots == 0;
  const uint64_t requested = static_cast<uint64_t>(in.requested_slots);
  budget.slots = static_cast<int64_t>(is_auto ? cap : std::min(requested, cap));
  if (!is_auto && requested > cap) {
    budget.warning =
        requested > total && total <= fit
            ? absl::StrFormat("--slots %d exceeds the %d experts: the pool holds them all",
                              requested, total)
            : absl::StrFormat("--slots %d does not fit in GPU memory: scaled down to %d slots",
                              requested, budget.slots);
  }
  budget.banner = absl::StrCat(
      "slots: min(", is_auto ? std::string("auto") : absl::StrCat("requested ", requested), ", ",
      total, " experts, (", left, ") / ", FormatBytes(in.block_bytes), " = ", fit,
      ") = ", budget.slots, " of ", total, " experts",
      static_cast<uint64_t>(budget.slots) == total ? " (every expert resident)" : "");
  return budget;
}

}  // namespace moegraph
