#include "residency/policy_cache.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "loader/status_util.h"

namespace moegraph {

std::string DescribePolicy(ResidencyPolicy policy, double protected_frac) {
  if (policy == ResidencyPolicy::kSlru) {
    return absl::StrFormat("slru (protected %.2f)", protected_frac);
  }
  return std::string(PolicyName(policy));
}

absl::StatusOr<ResidencyPolicy> ParseResidencyPolicy(std::string_view text,
                                                     std::string_view what) {
  for (ResidencyPolicy policy :
       {ResidencyPolicy::kLru, ResidencyPolicy::kSlru, ResidencyPolicy::kHazard}) {
    if (text == PolicyName(policy)) return policy;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("%s='%s' must be hazard, slru or lru", Av(what), Av(text)));
}

absl::StatusOr<PolicyCache> PolicyCache::Create(ResidencyPolicy policy,
                                                const CacheConfig& config) {
  if (policy == ResidencyPolicy::kHazard) {
    MG_ASSIGN_OR_RETURN(HazardCache cache, HazardCache::Create(config));
    return PolicyCache(policy, std::move(cache));
  }
  CacheConfig slru_config = config;
  if (policy == ResidencyPolicy::kLru) slru_config.protected_frac = 0.0;
  MG_ASSIGN_OR_RETURN(ResidencyCache cache, ResidencyCache::Create(slru_config));
  return PolicyCache(policy, std::move(cache));
}

const LayerStep& PolicyCache::Step(int32_t layer, const int32_t* experts) {
  return std::visit([&](auto& cache) -> const LayerStep& { return cache.Step(layer, experts); },
                    cache_);
}

const LayerStep& PolicyCache::Step(int32_t layer, const uint16_t* experts) {
  return std::visit([&](auto& cache) -> const LayerStep& { return cache.Step(layer, experts); },
                    cache_);
}

const CacheConfig& PolicyCache::config() const {
  return std::visit([](const auto& cache) -> const CacheConfig& { return cache.config(); },
                    cache_);
}

int32_t PolicyCache::pool_of_layer(int32_t layer) const {
  return std::visit([&](const auto& cache) { return cache.pool_of_layer(layer); }, cache_);
}

const std::vector<SlotRange>& PolicyCache::slot_ranges() const {
  return std::visit(
      [](const auto& cache) -> const std::vector<SlotRange>& { return cache.slot_ranges(); },
      cache_);
}

const std::vector<int32_t>& PolicyCache::table() const {
  return std::visit([](const auto& cache) -> const std::vector<int32_t>& { return cache.table(); },
                    cache_);
}

const std::vector<int32_t>& PolicyCache::owner() const {
  return std::visit([](const auto& cache) -> const std::vector<int32_t>& { return cache.owner(); },
                    cache_);
}

absl::Status PolicyCache::CheckInvariants() const {
  return std::visit([](const auto& cache) { return cache.CheckInvariants(); }, cache_);
}

ResidencySnapshot PolicyCache::Snapshot() const {
  ResidencySnapshot out;
  out.table = table();
  out.owner = owner();
  if (const ResidencyCache* slru = slru_cache()) {
    out.stamp = slru->stamp();
    out.seg = slru->seg();
    for (const ResidencyPool& pool : slru->pools()) {
      out.n_protected.push_back(*pool.n_protected);
      out.clock.push_back(*pool.clock);
    }
  } else if (const HazardCache* hazard = hazard_cache()) {
    out.last_visit = hazard->last_visit();
    out.frequency = hazard->frequency();
    out.long_frequency = hazard->long_frequency();
    out.visits = hazard->visits();
    out.cell_hits = hazard->cell_hits();
    out.cell_trials = hazard->cell_trials();
  }
  return out;
}

}  // namespace moegraph
