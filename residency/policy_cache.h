// The host cache of any online residency policy, behind one type: lru and slru
// (residency/policy.h, stepped by ResidencyCache) and hazard
// (residency/hazard_policy.h, stepped by HazardCache). The CPU backend, the CUDA
// engine's host arm, the gates' replays and the simulator step it; a snapshot
// holds the state arrays as the CUDA engine's device copy is compared with them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "residency/cache.h"
#include "residency/hazard_cache.h"

namespace moegraph {

enum class ResidencyPolicy { kLru, kSlru, kHazard };

// The engine's default: hazard, the best online policy in docs/POLICY.md.
inline constexpr ResidencyPolicy kDefaultResidencyPolicy = ResidencyPolicy::kHazard;
// slru's protected share of the slots.
inline constexpr double kDefaultProtectedFrac = 0.8;

constexpr std::string_view PolicyName(ResidencyPolicy policy) {
  switch (policy) {
    case ResidencyPolicy::kLru:
      return "lru";
    case ResidencyPolicy::kSlru:
      return "slru";
    case ResidencyPolicy::kHazard:
      return "hazard";
  }
  return "?";
}
// "hazard", "lru" or "slru (protected 0.80)", for banners.
std::string DescribePolicy(ResidencyPolicy policy, double protected_frac);
// The error names `what` (a flag or a variable) and lists the policies.
absl::StatusOr<ResidencyPolicy> ParseResidencyPolicy(std::string_view text, std::string_view what);

// A policy's state arrays. Every policy fills table and owner; slru and lru also
// stamp, seg, n_protected and clock (one per pool); hazard last_visit, the two
// frequencies, visits and the cell counts. Arrays a policy does not keep are empty.
struct ResidencySnapshot {
  std::vector<int32_t> table;
  std::vector<int32_t> owner;
  std::vector<uint64_t> stamp;
  std::vector<uint8_t> seg;
  std::vector<int32_t> n_protected;
  std::vector<uint64_t> clock;
  std::vector<int32_t> last_visit;
  std::vector<uint32_t> frequency;
  std::vector<uint32_t> long_frequency;
  std::vector<int32_t> visits;
  std::vector<uint32_t> cell_hits;
  std::vector<uint32_t> cell_trials;

  bool operator==(const ResidencySnapshot&) const = default;
};

class PolicyCache {
 public:
  // config.protected_frac is used by slru only (lru runs with 0). Errors as
  // ResidencyCache::Create and HazardCache::Create, naming the flag.
  static absl::StatusOr<PolicyCache> Create(ResidencyPolicy policy, const CacheConfig& config);

  // One layer's step, as ResidencyCache::Step; valid until the next Step.
  const LayerStep& Step(int32_t layer, const int32_t* experts);
  const LayerStep& Step(int32_t layer, const uint16_t* experts);

  ResidencyPolicy policy() const { return policy_; }
  const CacheConfig& config() const;
  int32_t pool_of_layer(int32_t layer) const;
  const std::vector<SlotRange>& slot_ranges() const;  // the pools' slots
  const std::vector<int32_t>& table() const;
  const std::vector<int32_t>& owner() const;
  ResidencySnapshot Snapshot() const;
  absl::Status CheckInvariants() const;

  // The underlying cache, or null for a policy of the other family.
  const ResidencyCache* slru_cache() const { return std::get_if<ResidencyCache>(&cache_); }
  const HazardCache* hazard_cache() const { return std::get_if<HazardCache>(&cache_); }

 private:
  PolicyCache(ResidencyPolicy policy, std::variant<ResidencyCache, HazardCache> cache)
      : policy_(policy), cache_(std::move(cache)) {}

  ResidencyPolicy policy_;
  std::variant<ResidencyCache, HazardCache> cache_;
};

}  // namespace moegraph
