#include "residency/cache.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {

namespace {

absl::Status ValidateShape(const CacheConfig& c) {
  if (c.n_layer <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("residency cache: n_layer %d must be positive", c.n_layer));
  }
  if (c.n_expert <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("residency cache: n_expert %d must be positive", c.n_expert));
  }
  if (static_cast<int64_t>(c.n_layer) * c.n_expert > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "residency cache: %d layers x %d experts overflow the 32-bit key", c.n_layer,
        c.n_expert));
  }
  if (c.k <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("--top-k %d must be positive", c.k));
  }
  if (c.k > c.n_expert) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--top-k %d exceeds the %d experts per layer", c.k, c.n_expert));
  }
  // Written so that NaN fails too.
  if (!(c.protected_frac >= 0.0 && c.protected_frac <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--protected-frac %g is outside [0, 1]", c.protected_frac));
  }
  if (c.n_slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--slots %d must be at least 1", c.n_slots));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResidencyCache> ResidencyCache::Create(const CacheConfig& config) {
  MG_RETURN_IF_ERROR(ValidateShape(config));
  const int32_t n_keys = config.n_layer * config.n_expert;
  const bool per_layer = config.pool_mode == PoolMode::kPerLayer;
  // A step needs a slot for each selected expert; the smallest per-layer pool is
  // the last layer's (the remainder goes to the first layers).
  if (!per_layer && config.n_slots < config.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d is below --top-k %d: a step needs a slot for each selected expert",
        config.n_slots, config.k));
  }
  if (per_layer && config.n_slots / config.n_layer < config.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d with --pool per-layer gives layer %d %d slots, fewer than --top-k %d",
        config.n_slots, config.n_layer - 1, config.n_slots / config.n_layer, config.k));
  }

  ResidencyCache cache;
  cache.config_ = config;
  // Past n_keys every expert already has a slot; more would stay empty forever.
  cache.config_.n_slots = std::min(config.n_slots, n_keys);
  const int32_t n_slots = cache.config_.n_slots;
  const int32_t n_pools = per_layer ? config.n_layer : 1;

  cache.table_.assign(n_keys, kNoSlot);
  cache.owner_.assign(n_slots, kNoKey);
  cache.stamp_.assign(n_slots, 0);
  cache.seg_.assign(n_slots, kProbation);
  cache.n_protected_.assign(n_pools, 0);
  cache.clock_.assign(n_pools, 0);
  cache.pools_.resize(n_pools);
  int32_t slot_begin = 0;
  for (int32_t p = 0; p < n_pools; ++p) {
    const int32_t pool_slots =
        per_layer ? n_slots / n_pools + (p < n_slots % n_pools ? 1 : 0) : n_slots;
    ResidencyPool& pool = cache.pools_[p];
    pool.slot_begin = slot_begin;
    pool.n_slots = pool_slots;
    pool.protected_cap = static_cast<int32_t>(std::floor(pool_slots * config.protected_frac));
    pool.n_protected = &cache.n_protected_[p];
    pool.clock = &cache.clock_[p];
    slot_begin += pool_slots;
  }
  cache.pool_of_layer_.resize(config.n_layer);
  for (int32_t layer = 0; layer < config.n_layer; ++layer) {
    cache.pool_of_layer_[layer] = per_layer ? layer : 0;
  }

  cache.selected_keys_.resize(config.k);
  cache.widened_experts_.resize(config.k);
  cache.step_.slot_of_rank.resize(config.k);
  cache.step_.missed.resize(config.k);
  cache.step_.evicted_keys.reserve(config.k);
  return cache;
}

ResidencyState ResidencyCache::state() {
  return ResidencyState{table_.data(), owner_.data(), stamp_.data(), seg_.data(),
                        config_.n_expert};
}

const LayerStep& ResidencyCache::Step(int32_t layer, const int32_t* experts) {
  const int32_t k = config_.k;
  MG_CHECK(layer >= 0 && layer < config_.n_layer, "residency step: layer out of range");
  for (int32_t r = 0; r < k; ++r) {
    MG_CHECK(experts[r] >= 0 && experts[r] < config_.n_expert,
             "residency step: expert id out of range");
    for (int32_t q = 0; q < r; ++q) {
      MG_CHECK(experts[q] != experts[r], "residency step: repeated expert in one selection");
    }
  }
  // Room for k evictions at most; within the reserved capacity, so no allocation.
  step_.evicted_keys.resize(k);
  step_.outcome = residency_step(state(), pools_[pool_of_layer_[layer]], layer, experts, k,
                                 selected_keys_.data(), step_.slot_of_rank.data(),
                                 step_.missed.data(), step_.evicted_keys.data());
  step_.evicted_keys.resize(step_.outcome.n_evictions);
  return step_;
}

const LayerStep& ResidencyCache::Step(int32_t layer, const uint16_t* experts) {
  for (int32_t r = 0; r < config_.k; ++r) widened_experts_[r] = experts[r];
  return Step(layer, widened_experts_.data());
}

absl::Status ResidencyCache::CheckInvariants() const {
  for (int32_t key = 0; key < static_cast<int32_t>(table_.size()); ++key) {
    const int32_t slot = table_[key];
    if (slot == kNoSlot) continue;
    if (slot < 0 || slot >= static_cast<int32_t>(owner_.size()) || owner_[slot] != key) {
      return absl::InternalError(
          absl::StrFormat("table[%d] = %d but that slot's owner is not key %d", key, slot, key));
    }
    const ResidencyPool& pool = pools_[pool_of_layer_[key / config_.n_expert]];
    if (slot < pool.slot_begin || slot >= pool.slot_begin + pool.n_slots) {
      return absl::InternalError(absl::StrFormat(
          "key %d sits in slot %d, outside its pool [%d, %d)", key, slot, pool.slot_begin,
          pool.slot_begin + pool.n_slots));
    }
  }
  for (int32_t slot = 0; slot < static_cast<int32_t>(owner_.size()); ++slot) {
    const int32_t key = owner_[slot];
    if (key == kNoKey) {
      if (seg_[slot] != kProbation) {
        return absl::InternalError(absl::StrFormat("empty slot %d is marked protected", slot));
      }
      continue;
    }
    if (key < 0 || key >= static_cast<int32_t>(table_.size()) || table_[key] != slot) {
      return absl::InternalError(
          absl::StrFormat("owner[%d] = %d but table does not point back to slot %d", slot, key,
                          slot));
    }
  }
  std::vector<uint64_t> pool_stamps;
  for (size_t p = 0; p < pools_.size(); ++p) {
    const ResidencyPool& pool = pools_[p];
    int32_t n_protected = 0;
    pool_stamps.clear();
    for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
      if (owner_[slot] == kNoKey) continue;
      if (seg_[slot] == kProtected) ++n_protected;
      if (stamp_[slot] >= *pool.clock) {
        return absl::InternalError(absl::StrFormat(
            "pool %d: slot %d has stamp %d, not below the clock %d", p, slot, stamp_[slot],
            *pool.clock));
      }
      pool_stamps.push_back(stamp_[slot]);
    }
    if (n_protected != *pool.n_protected) {
      return absl::InternalError(absl::StrFormat(
          "pool %d: n_protected is %d but %d slots are protected", p, *pool.n_protected,
          n_protected));
    }
    if (n_protected > pool.protected_cap) {
      return absl::InternalError(absl::StrFormat("pool %d: %d protected slots exceed P = %d", p,
                                                 n_protected, pool.protected_cap));
    }
    std::sort(pool_stamps.begin(), pool_stamps.end());
    if (std::adjacent_find(pool_stamps.begin(), pool_stamps.end()) != pool_stamps.end()) {
      return absl::InternalError(
          absl::StrFormat("pool %d: two occupied slots share a stamp", p));
    }
  }
  return absl::OkStatus();
}

}  // namespace moegraph
