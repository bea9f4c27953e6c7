#include "tests/residency_reference.h"

#include <algorithm>
#include <cmath>

namespace moegraph {

namespace {

bool Contains(const std::vector<int32_t>& keys, int32_t key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

bool Contains(const std::list<int32_t>& keys, int32_t key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

// The least recent key of a segment that is not in the selection, or kNoKey.
int32_t OldestNotSelected(const std::list<int32_t>& segment,
                          const std::vector<int32_t>& selection) {
  for (int32_t key : segment) {
    if (!Contains(selection, key)) return key;
  }
  return kNoKey;
}

}  // namespace

ReferenceCache::ReferenceCache(const CacheConfig& config) : config_(config) {
  // Every expert fits: slots beyond n_layer * n_expert would never be used.
  const int32_t total_slots = std::min(config.n_slots, config.n_layer * config.n_expert);
  std::vector<int32_t> pool_sizes;
  if (config.pool_mode == PoolMode::kGlobal) {
    pool_sizes.push_back(total_slots);
  } else {
    // Deal the slots out one at a time, layer 0 first, round after round.
    pool_sizes.assign(config.n_layer, 0);
    for (int32_t dealt = 0; dealt < total_slots; ++dealt) ++pool_sizes[dealt % config.n_layer];
  }
  int32_t next_slot = 0;
  for (int32_t size : pool_sizes) {
    ReferencePool pool;
    pool.first_slot = next_slot;
    pool.n_slots = size;
    pool.protected_cap = static_cast<int32_t>(std::floor(size * config.protected_frac));
    for (int32_t i = 0; i < size; ++i) pool.free_slots.insert(next_slot++);
    pools_.push_back(pool);
  }
}

ReferencePool& ReferenceCache::PoolOfLayer(int32_t layer) {
  return pools_[config_.pool_mode == PoolMode::kGlobal ? 0 : layer];
}

ReferenceStep ReferenceCache::Step(int32_t layer, const std::vector<int32_t>& experts) {
  ReferencePool& pool = PoolOfLayer(layer);
  std::vector<int32_t> selection;
  for (int32_t expert : experts) selection.push_back(layer * config_.n_expert + expert);

  ReferenceStep step;
  step.slot_of_rank.assign(selection.size(), kNoSlot);
  step.missed.assign(selection.size(), 0);

  // 1. Hits, in rank order: a probation key moves to the protected segment as its
  //    most recent key (the least recent protected key falls back to probation as
  //    its most recent when the segment holds more than P); a protected key
  //    becomes the most recent protected key.
  for (size_t r = 0; r < selection.size(); ++r) {
    const int32_t key = selection[r];
    const auto found = slot_of_key_.find(key);
    if (found == slot_of_key_.end()) {
      step.missed[r] = 1;
      continue;
    }
    step.slot_of_rank[r] = found->second;
    ++step.n_hits;
    if (Contains(pool.probation, key)) {
      pool.probation.remove(key);
      pool.protected_keys.push_back(key);
      if (static_cast<int32_t>(pool.protected_keys.size()) > pool.protected_cap) {
        const int32_t demoted = pool.protected_keys.front();
        pool.protected_keys.pop_front();
        pool.probation.push_back(demoted);
      }
    } else {
      pool.protected_keys.remove(key);
      pool.protected_keys.push_back(key);
    }
  }

  // 2. Misses, in rank order: take the lowest free slot, else evict the least
  //    recent probation key outside the selection, else the least recent
  //    protected key outside it. The newcomer is the most recent probation key.
  for (size_t r = 0; r < selection.size(); ++r) {
    if (!step.missed[r]) continue;
    int32_t slot = kNoSlot;
    if (!pool.free_slots.empty()) {
      slot = *pool.free_slots.begin();
      pool.free_slots.erase(pool.free_slots.begin());
    } else {
      int32_t victim = OldestNotSelected(pool.probation, selection);
      if (victim != kNoKey) {
        pool.probation.remove(victim);
      } else {
        victim = OldestNotSelected(pool.protected_keys, selection);
        pool.protected_keys.remove(victim);
      }
      slot = slot_of_key_.at(victim);
      slot_of_key_.erase(victim);
      step.evicted_keys.push_back(victim);
    }
    slot_of_key_[selection[r]] = slot;
    pool.probation.push_back(selection[r]);
    step.slot_of_rank[r] = slot;
  }
  return step;
}

std::vector<int32_t> ReferenceCache::Table() const {
  std::vector<int32_t> table(static_cast<size_t>(config_.n_layer) * config_.n_expert, kNoSlot);
  for (const auto& [key, slot] : slot_of_key_) table[key] = slot;
  return table;
}

}  // namespace moegraph
