// The hazard policy on the host: owns the state arrays of
// residency/hazard_policy.h and steps them one layer at a time, as
// ResidencyCache does for LRU/SLRU. The simulator uses it; a CUDA engine keeps
// the same arrays in device memory and runs the same step in a kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "residency/cache.h"
#include "residency/hazard_policy.h"

namespace moegraph {

// Slots are laid out pool after pool, as in ResidencyCache: one global pool, or
// one pool per layer (the first N mod n_layer layers get one more slot). The
// learned hazard table is shared by every pool.
class HazardCache {
 public:
  // Refuses what it cannot run, naming the flag, with ResidencyCache's rules
  // (config.protected_frac is not used). More slots than keys are clamped.
  static absl::StatusOr<HazardCache> Create(const CacheConfig& config);

  HazardCache(HazardCache&&) = default;
  HazardCache& operator=(HazardCache&&) = default;
  HazardCache(const HazardCache&) = delete;
  HazardCache& operator=(const HazardCache&) = delete;

  // One layer's step; experts: k distinct ids in [0, n_expert), router rank order
  // (anything else aborts). The result is valid until the next Step.
  const LayerStep& Step(int32_t layer, const int32_t* experts);
  const LayerStep& Step(int32_t layer, const uint16_t* experts);

  const CacheConfig& config() const { return layout_.config; }
  const std::vector<HazardPool>& pools() const { return pools_; }
  const std::vector<SlotRange>& slot_ranges() const { return layout_.pools; }
  int32_t pool_of_layer(int32_t layer) const { return layout_.pool_of_layer[layer]; }
  const std::vector<int32_t>& table() const { return table_; }
  const std::vector<int32_t>& owner() const { return owner_; }
  const std::vector<int32_t>& last_visit() const { return last_visit_; }
  const std::vector<uint32_t>& frequency() const { return frequency_; }
  const std::vector<uint32_t>& long_frequency() const { return long_frequency_; }
  const std::vector<int32_t>& visits() const { return visits_; }
  const std::vector<uint32_t>& cell_trials() const { return cell_trials_; }
  const std::vector<uint32_t>& cell_hits() const { return cell_hits_; }
  const std::vector<float>& cell_cost() const { return cell_cost_; }
  HazardState state();

  // Invariants after any step: table and owner are inverse maps, every key sits
  // in its layer's pool, every cell has hits <= trials < kHazardCountCap, and the
  // keys' last visits lie before their layer's visit count. A message naming the
  // first broken one, or OK.
  absl::Status CheckInvariants() const;

 private:
  HazardCache() = default;

  SlotLayout layout_;
  std::vector<HazardPool> pools_;
  std::vector<int32_t> table_, owner_, last_visit_, visits_;
  std::vector<uint32_t> frequency_, long_frequency_, cell_hits_, cell_trials_;
  std::vector<float> cell_cost_;
  StepScratch scratch_;
};

}  // namespace moegraph
