#include "gates/engines.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/status_util.h"

namespace moegraph {

absl::StatusOr<ResidencySnapshot> ReplayRouting(ResidencyPolicy policy, const CacheConfig& config,
                                                const std::vector<int>& class_layers, int n_layer,
                                                const std::vector<int32_t>& routing, uint64_t* hits,
                                                uint64_t* misses) {
  MG_ASSIGN_OR_RETURN(PolicyCache cache, PolicyCache::Create(policy, config));
  std::vector<int32_t> local(static_cast<size_t>(n_layer), -1);
  for (size_t i = 0; i < class_layers.size(); ++i) {
    local[static_cast<size_t>(class_layers[i])] = static_cast<int32_t>(i);
  }
  const size_t k = static_cast<size_t>(config.k);
  const size_t per_step = static_cast<size_t>(n_layer) * k;
  if (k == 0 || routing.size() % per_step != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("routing of %d ids is not whole steps of %d layers x %d experts",
                        routing.size(), n_layer, config.k));
  }
  for (size_t at = 0; at < routing.size(); at += k) {
    const int32_t layer = local[(at % per_step) / k];
    if (layer < 0) continue;
    const LayerStep& step = cache.Step(layer, routing.data() + at);
    *hits += static_cast<uint64_t>(step.outcome.n_hits);
    *misses += static_cast<uint64_t>(step.outcome.n_misses);
  }
  return cache.Snapshot();
}

}  // namespace moegraph
