#include "residency/hazard_cache.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {

absl::StatusOr<HazardCache> HazardCache::Create(const CacheConfig& config) {
  // The geometry checks and error messages are ResidencyCache's; its pool
  // layout is the one this cache copies.
  MG_ASSIGN_OR_RETURN(const ResidencyCache layout, ResidencyCache::Create(config));
  if (layout.config().n_slots > kHazardMaxSlots) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d exceeds the %d slots the hazard policy's rank can index",
        layout.config().n_slots, kHazardMaxSlots));
  }
  HazardCache cache;
  cache.config_ = layout.config();
  const int32_t n_keys = config.n_layer * config.n_expert;
  for (const ResidencyPool& pool : layout.pools()) {
    cache.pools_.push_back(HazardPool{pool.slot_begin, pool.n_slots});
  }
  for (int32_t layer = 0; layer < config.n_layer; ++layer) {
    cache.pool_of_layer_.push_back(layout.pool_of_layer(layer));
  }
  cache.table_.assign(n_keys, kNoSlot);
  cache.owner_.assign(cache.config_.n_slots, kNoKey);
  cache.last_visit_.assign(n_keys, -1);
  cache.frequency_.assign(n_keys, 0);
  cache.visits_.assign(config.n_layer, 0);
  cache.cell_hits_.assign(kHazardCells, 0);
  cache.cell_trials_.assign(kHazardCells, 0);
  cache.cell_cost_.assign(kHazardCells, 0.0f);
  hazard_rebuild_costs(cache.state());

  cache.selected_keys_.resize(config.k);
  cache.widened_experts_.resize(config.k);
  cache.step_.slot_of_rank.resize(config.k);
  cache.step_.missed.resize(config.k);
  cache.step_.evicted_keys.reserve(config.k);
  return cache;
}

HazardState HazardCache::state() {
  return HazardState{table_.data(),       owner_.data(),     last_visit_.data(),
                     frequency_.data(),   visits_.data(),    cell_hits_.data(),
                     cell_trials_.data(), cell_cost_.data(), config_.n_layer,
                     config_.n_expert,    config_.k};
}

const LayerStep& HazardCache::Step(int32_t layer, const int32_t* experts) {
  const int32_t k = config_.k;
  MG_CHECK(layer >= 0 && layer < config_.n_layer, "hazard step: layer out of range");
  for (int32_t r = 0; r < k; ++r) {
    MG_CHECK(experts[r] >= 0 && experts[r] < config_.n_expert,
             "hazard step: expert id out of range");
    for (int32_t q = 0; q < r; ++q) {
      MG_CHECK(experts[q] != experts[r], "hazard step: repeated expert in one selection");
    }
  }
  // Room for k evictions at most; within the reserved capacity, so no allocation.
  step_.evicted_keys.resize(k);
  step_.outcome = hazard_step(state(), pools_[pool_of_layer_[layer]], layer, experts, k,
                              selected_keys_.data(), step_.slot_of_rank.data(),
                              step_.missed.data(), step_.evicted_keys.data());
  step_.evicted_keys.resize(step_.outcome.n_evictions);
  return step_;
}

const LayerStep& HazardCache::Step(int32_t layer, const uint16_t* experts) {
  for (int32_t r = 0; r < config_.k; ++r) widened_experts_[r] = experts[r];
  return Step(layer, widened_experts_.data());
}

absl::Status HazardCache::CheckInvariants() const {
  const int32_t n_keys = static_cast<int32_t>(table_.size());
  for (int32_t key = 0; key < n_keys; ++key) {
    const int32_t layer = key / config_.n_expert;
    if (last_visit_[key] >= visits_[layer]) {
      return absl::InternalError(absl::StrFormat(
          "key %d was last selected at visit %d, but layer %d has had %d visits", key,
          last_visit_[key], layer, visits_[layer]));
    }
    const int32_t slot = table_[key];
    if (slot == kNoSlot) continue;
    if (slot < 0 || slot >= static_cast<int32_t>(owner_.size()) || owner_[slot] != key) {
      return absl::InternalError(
          absl::StrFormat("table[%d] = %d but that slot's owner is not key %d", key, slot, key));
    }
    const HazardPool& pool = pools_[pool_of_layer_[layer]];
    if (slot < pool.slot_begin || slot >= pool.slot_begin + pool.n_slots) {
      return absl::InternalError(
          absl::StrFormat("key %d sits in slot %d, outside its pool [%d, %d)", key, slot,
                          pool.slot_begin, pool.slot_begin + pool.n_slots));
    }
  }
  for (int32_t slot = 0; slot < static_cast<int32_t>(owner_.size()); ++slot) {
    const int32_t key = owner_[slot];
    if (key == kNoKey) continue;
    if (key < 0 || key >= n_keys || table_[key] != slot) {
      return absl::InternalError(absl::StrFormat(
          "owner[%d] = %d but table does not point back to slot %d", slot, key, slot));
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
