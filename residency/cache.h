// The residency cache on the host: owns the policy state arrays of
// residency/policy.h, split into pools, and steps them one layer at a time.
// The simulator and the CPU backend use it; the CUDA engine keeps the same
// arrays in device memory and runs the same step in a kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "residency/policy.h"

namespace moegraph {

enum class PoolMode { kGlobal, kPerLayer };

struct CacheConfig {
  int32_t n_layer = 0;
  int32_t n_expert = 0;
  int32_t k = 0;  // experts selected per layer per step
  int32_t n_slots = 0;
  double protected_frac = 0.0;  // 0: LRU
  PoolMode pool_mode = PoolMode::kGlobal;
};

// Per step of one layer: where each rank's expert lives and what changed.
struct LayerStep {
  StepOutcome outcome = {0, 0, 0};
  std::vector<int32_t> slot_of_rank;  // [k]
  std::vector<uint8_t> missed;        // [k]
  std::vector<int32_t> evicted_keys;  // [outcome.n_evictions], in eviction order
};

// One pool's slots: [slot_begin, slot_begin + n_slots).
struct SlotRange {
  int32_t slot_begin = 0;
  int32_t n_slots = 0;
};

// A configuration's slots split into pools, as ResidencyCache describes below.
struct SlotLayout {
  CacheConfig config;  // n_slots clamped to n_layer * n_expert
  std::vector<SlotRange> pools;
  std::vector<int32_t> pool_of_layer;  // [n_layer]
};

// The checks and the pool split every host cache shares: refuses what no cache
// can run with ResidencyCache::Create's messages, else lays the slots out.
absl::StatusOr<SlotLayout> PartitionSlots(const CacheConfig& config);

// Aborts unless layer is one of config's and experts are k distinct ids in
// [0, n_expert): the router never produces anything else.
void CheckSelection(const CacheConfig& config, int32_t layer, const int32_t* experts);

// Table and owner are inverse maps and every key sits in its layer's pool: a
// message naming the first broken invariant, or OK.
absl::Status CheckSlotMaps(const SlotLayout& layout, const std::vector<int32_t>& table,
                           const std::vector<int32_t>& owner);

// The buffers of one host-cache step, sized once for k: a step allocates nothing.
struct StepScratch {
  StepScratch() = default;
  explicit StepScratch(int32_t k);
  // Trace ids (uint16_t) widened into `widened_experts`.
  const int32_t* Widen(const uint16_t* experts);

  std::vector<int32_t> selected_keys;    // [k]
  std::vector<int32_t> widened_experts;  // [k]
  LayerStep step;
};

// Slots are laid out pool after pool. kGlobal: one pool of every slot, keyed by
// (layer, expert). kPerLayer: pool l serves layer l; the N slots are split as
// evenly as possible, the first N mod n_layer layers getting one more. Each pool
// protects P = floor(its slots * protected_frac) of them.
//
// Move-only: pools point into the cache's own counters, and a move keeps those
// buffers where they are while a copy would not.
class ResidencyCache {
 public:
  // Refuses a configuration it cannot run, naming the flag: "--slots 1 is below
  // --top-k 2", or for per-layer pools "--slots 16 with --pool per-layer gives
  // layer 31 0 slots, fewer than --top-k 2". More slots than n_layer * n_expert
  // are clamped to that (every expert fits); config().n_slots is the clamped count.
  static absl::StatusOr<ResidencyCache> Create(const CacheConfig& config);

  ResidencyCache(ResidencyCache&&) = default;
  ResidencyCache& operator=(ResidencyCache&&) = default;
  ResidencyCache(const ResidencyCache&) = delete;
  ResidencyCache& operator=(const ResidencyCache&) = delete;

  // One layer's step. experts: k distinct ids in [0, n_expert), router rank
  // order (out-of-range or repeated ids abort: the router never produces them).
  // The result lives in a buffer of the cache, valid until the next Step: no
  // allocation per step.
  const LayerStep& Step(int32_t layer, const int32_t* experts);
  // The same for ids as stored in a RoutingTrace row.
  const LayerStep& Step(int32_t layer, const uint16_t* experts);

  const CacheConfig& config() const { return layout_.config; }
  const std::vector<ResidencyPool>& pools() const { return pools_; }
  const std::vector<SlotRange>& slot_ranges() const { return layout_.pools; }
  int32_t pool_of_layer(int32_t layer) const { return layout_.pool_of_layer[layer]; }
  const std::vector<int32_t>& table() const { return table_; }
  const std::vector<int32_t>& owner() const { return owner_; }
  const std::vector<uint64_t>& stamp() const { return stamp_; }
  const std::vector<uint8_t>& seg() const { return seg_; }

  // Invariants after any step: table and owner are inverse maps, every key sits
  // in its layer's pool, every pool has n_protected equal to its protected slots
  // and at most P, empty slots are on probation, and the stamps of a pool's
  // occupied slots are unique and below its clock. A message naming the first
  // broken one, or OK.
  absl::Status CheckInvariants() const;

 private:
  ResidencyCache() = default;
  ResidencyState state();

  SlotLayout layout_;
  std::vector<ResidencyPool> pools_;
  std::vector<int32_t> table_, owner_;
  std::vector<uint64_t> stamp_;
  std::vector<uint8_t> seg_;
  std::vector<int32_t> n_protected_;
  std::vector<uint64_t> clock_;
  StepScratch scratch_;
};

}  // namespace moegraph
