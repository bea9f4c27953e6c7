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

absl::StatusOr<SlotLayout> PartitionSlots(const CacheConfig& config) {
  MG_RETURN_IF_ERROR(ValidateShape(config));
  const bool per_layer = config.pool_mode == PoolMode::kPerLayer;
  // A step needs a slot for each selected expert; the smallest per-layer pool is
  // the last layer's (the remainder goes to the first layers).
  if (!per_layer && config.n_slots < config.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d is below the %d experts a token selects (the model's expert_used_count): a "
        "step needs a slot for each",
        config.n_slots, config.k));
  }
  if (per_layer && config.n_slots / config.n_layer < config.k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d with --pool per-layer gives layer %d %d slots, fewer than the %d experts a "
        "token selects",
        config.n_slots, config.n_layer - 1, config.n_slots / config.n_layer, config.k));
  }

  SlotLayout layout;
  layout.config = config;
  // Past n_keys every expert already has a slot; more would stay empty forever.
  layout.config.n_slots = std::min(config.n_slots, config.n_layer * config.n_expert);
  const int32_t n_slots = layout.config.n_slots;
  const int32_t n_pools = per_layer ? config.n_layer : 1;
  int32_t slot_begin = 0;
  for (int32_t p = 0; p < n_pools; ++p) {
    const int32_t pool_slots =
        per_layer ? n_slots / n_pools + (p < n_slots % n_pools ? 1 : 0) : n_slots;
    layout.pools.push_back(SlotRange{slot_begin, pool_slots});
    slot_begin += pool_slots;
  }
  for (int32_t layer = 0; layer < config.n_layer; ++layer) {
    layout.pool_of_layer.push_back(per_layer ? layer : 0);
  }
  return layout;
}

void CheckSelection(const CacheConfig& config, int32_t layer, const int32_t* experts) {
  MG_CHECK(layer >= 0 && layer < config.n_layer, "residency step: layer out of range");
  for (int32_t r = 0; r < config.k; ++r) {
    if (experts[r] == kNoExpert) continue;  // a dropped rank
    MG_CHECK(experts[r] >= 0 && experts[r] < config.n_expert,
             "residency step: expert id out of range");
    for (int32_t q = 0; q < r; ++q) {
      MG_CHECK(experts[q] != experts[r], "residency step: repeated expert in one selection");
    }
  }
}

absl::Status CheckSlotMaps(const SlotLayout& layout, const std::vector<int32_t>& table,
                           const std::vector<int32_t>& owner) {
  const int32_t n_keys = static_cast<int32_t>(table.size());
  const int32_t n_slots = static_cast<int32_t>(owner.size());
  for (int32_t key = 0; key < n_keys; ++key) {
    const int32_t slot = table[key];
    if (slot == kNoSlot) continue;
    if (slot < 0 || slot >= n_slots || owner[slot] != key) {
      return absl::InternalError(
          absl::StrFormat("table[%d] = %d but that slot's owner is not key %d", key, slot, key));
    }
    const SlotRange& pool = layout.pools[layout.pool_of_layer[key / layout.config.n_expert]];
    if (slot < pool.slot_begin || slot >= pool.slot_begin + pool.n_slots) {
      return absl::InternalError(absl::StrFormat(
          "key %d sits in slot %d, outside its pool [%d, %d)", key, slot, pool.slot_begin,
          pool.slot_begin + pool.n_slots));
    }
  }
  for (int32_t slot = 0; slot < n_slots; ++slot) {
    const int32_t key = owner[slot];
    if (key == kNoKey) continue;
    if (key < 0 || key >= n_keys || table[key] != slot) {
      return absl::InternalError(absl::StrFormat(
          "owner[%d] = %d but table does not point back to slot %d", slot, key, slot));
    }
  }
  return absl::OkStatus();
}

StepScratch::StepScratch(int32_t k) : selected_keys(k), widened_experts(k) {
  step.slot_of_rank.resize(k);
  step.missed.resize(k);
  step.evicted_keys.reserve(k);
}

const int32_t* StepScratch::Widen(const uint16_t* experts) {
  for (size_t r = 0; r < widened_experts.size(); ++r) widened_experts[r] = experts[r];
  return widened_experts.data();
}

absl::StatusOr<ResidencyCache> ResidencyCache::Create(const CacheConfig& config) {
  ResidencyCache cache;
  MG_ASSIGN_OR_RETURN(cache.layout_, PartitionSlots(config));
  const int32_t n_slots = cache.layout_.config.n_slots;
  const int32_t n_pools = static_cast<int32_t>(cache.layout_.pools.size());

  cache.table_.assign(config.n_layer * config.n_expert, kNoSlot);
  cache.owner_.assign(n_slots, kNoKey);
  cache.stamp_.assign(n_slots, 0);
  cache.seg_.assign(n_slots, kProbation);
  cache.n_protected_.assign(n_pools, 0);
  cache.clock_.assign(n_pools, 0);
  for (int32_t p = 0; p < n_pools; ++p) {
    const SlotRange& range = cache.layout_.pools[p];
    cache.pools_.push_back(ResidencyPool{
        range.slot_begin, range.n_slots,
        static_cast<int32_t>(std::floor(range.n_slots * config.protected_frac)),
        &cache.n_protected_[p], &cache.clock_[p]});
  }
  cache.scratch_ = StepScratch(config.k);
  return cache;
}

ResidencyState ResidencyCache::state() {
  return ResidencyState{table_.data(), owner_.data(), stamp_.data(), seg_.data(),
                        layout_.config.n_expert};
}

const LayerStep& ResidencyCache::Step(int32_t layer, const int32_t* experts) {
  const int32_t k = layout_.config.k;
  CheckSelection(layout_.config, layer, experts);
  LayerStep& step = scratch_.step;
  // Room for k evictions at most; within the reserved capacity, so no allocation.
  step.evicted_keys.resize(k);
  step.outcome = residency_step(state(), pools_[layout_.pool_of_layer[layer]], layer, experts,
                                k, scratch_.selected_keys.data(), step.slot_of_rank.data(),
                                step.missed.data(), step.evicted_keys.data());
  step.evicted_keys.resize(step.outcome.n_evictions);
  return step;
}

const LayerStep& ResidencyCache::Step(int32_t layer, const uint16_t* experts) {
  return Step(layer, scratch_.Widen(experts));
}

absl::Status ResidencyCache::CheckInvariants() const {
  MG_RETURN_IF_ERROR(CheckSlotMaps(layout_, table_, owner_));
  for (int32_t slot = 0; slot < static_cast<int32_t>(owner_.size()); ++slot) {
    if (owner_[slot] == kNoKey && seg_[slot] != kProbation) {
      return absl::InternalError(absl::StrFormat("empty slot %d is marked protected", slot));
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
