#include "residency/hazard_cache.h"

#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {

absl::StatusOr<HazardCache> HazardCache::Create(const CacheConfig& config) {
  HazardCache cache;
  MG_ASSIGN_OR_RETURN(cache.layout_, PartitionSlots(config));
  const int32_t n_slots = cache.layout_.config.n_slots;
  if (n_slots > kHazardMaxSlots) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d exceeds the %d slots the hazard policy's rank can index", n_slots,
        kHazardMaxSlots));
  }
  const int32_t n_keys = config.n_layer * config.n_expert;
  for (const SlotRange& range : cache.layout_.pools) {
    cache.pools_.push_back(HazardPool{range.slot_begin, range.n_slots});
  }
  cache.table_.assign(n_keys, kNoSlot);
  cache.owner_.assign(n_slots, kNoKey);
  cache.last_visit_.assign(n_keys, -1);
  cache.frequency_.assign(n_keys, 0);
  cache.long_frequency_.assign(n_keys, 0);
  cache.visits_.assign(config.n_layer, 0);
  cache.cell_hits_.assign(kHazardCells, 0);
  cache.cell_trials_.assign(kHazardCells, 0);
  cache.cell_cost_.assign(kHazardCells, 0.0f);
  hazard_rebuild_costs(cache.state());
  cache.scratch_ = StepScratch(config.k);
  return cache;
}

HazardState HazardCache::state() {
  const CacheConfig& c = layout_.config;
  return HazardState{.table = table_.data(),
                     .owner = owner_.data(),
                     .last_visit = last_visit_.data(),
                     .frequency = frequency_.data(),
                     .long_frequency = long_frequency_.data(),
                     .visits = visits_.data(),
                     .cell_hits = cell_hits_.data(),
                     .cell_trials = cell_trials_.data(),
                     .cell_cost = cell_cost_.data(),
                     .n_layer = c.n_layer,
                     .n_expert = c.n_expert,
                     .k = c.k};
}

const LayerStep& HazardCache::Step(int32_t layer, const int32_t* experts) {
  const int32_t k = layout_.config.k;
  CheckSelection(layout_.config, layer, experts);
  LayerStep& step = scratch_.step;
  // Room for k evictions at most; within the reserved capacity, so no allocation.
  step.evicted_keys.resize(k);
  step.outcome = hazard_step(state(), pools_[layout_.pool_of_layer[layer]], layer, experts, k,
                             scratch_.selected_keys.data(), step.slot_of_rank.data(),
                             step.missed.data(), step.evicted_keys.data());
  step.evicted_keys.resize(step.outcome.n_evictions);
  return step;
}

const LayerStep& HazardCache::Step(int32_t layer, const uint16_t* experts) {
  return Step(layer, scratch_.Widen(experts));
}

absl::Status HazardCache::CheckInvariants() const {
  MG_RETURN_IF_ERROR(CheckSlotMaps(layout_, table_, owner_));
  for (int32_t key = 0; key < static_cast<int32_t>(last_visit_.size()); ++key) {
    const int32_t layer = key / layout_.config.n_expert;
    if (last_visit_[key] >= visits_[layer]) {
      return absl::InternalError(absl::StrFormat(
          "key %d was last selected at visit %d, but layer %d has had %d visits", key,
          last_visit_[key], layer, visits_[layer]));
    }
  }
  for (int32_t c = 0; c < kHazardCells; ++c) {
    if (cell_hits_[c] > cell_trials_[c] || cell_trials_[c] >= kHazardCountCap) {
      return absl::InternalError(absl::StrFormat("cell %d has %d hits in %d trials (cap %d)", c,
                                                 cell_hits_[c], cell_trials_[c],
                                                 kHazardCountCap));
    }
  }
  return absl::OkStatus();
}

}  // namespace moegraph
