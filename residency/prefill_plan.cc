#include "residency/prefill_plan.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "residency/policy.h"

namespace moegraph {

absl::StatusOr<PrefillLayerPlan> PlanPrefillLayer(absl::Span<const int32_t> selection, int32_t k,
                                                  absl::Span<const int32_t> slot_of,
                                                  int32_t ring_buffers, uint64_t block_bytes) {
  if (k < 1 || selection.size() % static_cast<size_t>(k) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefill plan: %d routed ids are not whole tokens of k %d", selection.size(), k));
  }
  if (ring_buffers < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("prefill plan: a ring of %d staging buffers", ring_buffers));
  }
  const int32_t n_expert = static_cast<int32_t>(slot_of.size());
  // A counting sort by expert: scanning the entries in order keeps each
  // expert's tokens ascending.
  std::vector<int32_t> per_expert(static_cast<size_t>(n_expert) + 1, 0);
  for (size_t i = 0; i < selection.size(); ++i) {
    const int32_t e = selection[i];
    if (e < 0 || e >= n_expert) {
      return absl::InvalidArgumentError(
          absl::StrFormat("prefill plan: token %d rank %d routes to expert %d of %d",
                          i / static_cast<size_t>(k), i % static_cast<size_t>(k), e, n_expert));
    }
    ++per_expert[static_cast<size_t>(e) + 1];
  }
  for (int32_t e = 0; e < n_expert; ++e) per_expert[e + 1] += per_expert[e];

  PrefillLayerPlan plan;
  plan.entries.resize(selection.size());
  std::vector<int32_t> next(per_expert.begin(), per_expert.end() - 1);
  for (size_t i = 0; i < selection.size(); ++i) {
    plan.entries[static_cast<size_t>(next[selection[i]]++)] = static_cast<int32_t>(i);
  }
  for (int32_t e = 0; e < n_expert; ++e) {
    const int32_t count = per_expert[e + 1] - per_expert[e];
    if (count == 0) continue;
    PrefillGroup g;
    g.expert = e;
    g.slot = slot_of[static_cast<size_t>(e)];
    g.first = per_expert[e];
    g.count = count;
    if (g.slot == kNoSlot) {
      g.ring_buffer = plan.streamed % ring_buffers;
      ++plan.streamed;
    } else {
      ++plan.in_place;
    }
    plan.groups.push_back(g);
  }
  plan.bytes_streamed = static_cast<uint64_t>(plan.streamed) * block_bytes;
  return plan;
}

}  // namespace moegraph
