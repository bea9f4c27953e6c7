// A list-based reading of the canonical residency spec (DESIGN.md, "The
// residency policy"), written to be obviously correct rather than fast: each
// pool keeps its probation and protected segments as lists ordered by recency
// (least recent first), a map from key to slot, and a free list of slots
// (lowest index first). Tests only: the array form of residency/policy.h must
// agree with it step for step.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <set>
#include <vector>

#include "residency/cache.h"

namespace moegraph {

struct ReferenceStep {
  int32_t n_hits = 0;
  std::vector<int32_t> slot_of_rank;  // [k]
  std::vector<uint8_t> missed;        // [k]
  std::vector<int32_t> evicted_keys;  // in eviction order
};

struct ReferencePool {
  int32_t first_slot = 0;
  int32_t n_slots = 0;
  int32_t protected_cap = 0;
  std::list<int32_t> probation;      // keys, least recent first
  std::list<int32_t> protected_keys;  // keys, least recent first
  std::set<int32_t> free_slots;      // iterates lowest index first
};

class ReferenceCache {
 public:
  // config must be one ResidencyCache::Create accepts.
  explicit ReferenceCache(const CacheConfig& config);

  // experts: k distinct ids, router rank order.
  ReferenceStep Step(int32_t layer, const std::vector<int32_t>& experts);

  // The slot of every key (kNoSlot when not cached), indexed like the array table.
  std::vector<int32_t> Table() const;
  int32_t n_pools() const { return static_cast<int32_t>(pools_.size()); }
  const ReferencePool& pool(int32_t index) const { return pools_[index]; }

 private:
  ReferencePool& PoolOfLayer(int32_t layer);

  CacheConfig config_;
  std::vector<ReferencePool> pools_;
  std::map<int32_t, int32_t> slot_of_key_;
};

}  // namespace moegraph
