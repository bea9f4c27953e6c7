#include "residency/simulator.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "loader/status_util.h"
#include "residency/policy.h"
#include "residency/policy_cache.h"

namespace moegraph {
namespace {

constexpr double kBytesPerMib = 1024.0 * 1024.0;
constexpr double kBytesPerGb = 1e9;

// An online policy (lru, slru, hazard) stepped by its host cache.
class OnlinePolicy final : public SimPolicy {
 public:
  explicit OnlinePolicy(PolicyCache cache) : cache_(std::move(cache)) {}

  std::string_view name() const override { return PolicyName(cache_.policy()); }

  StepCounts Step(int64_t, int32_t layer, const uint16_t* experts) override {
    const StepOutcome& outcome = cache_.Step(layer, experts).outcome;
    return {outcome.n_hits, outcome.n_misses, outcome.n_evictions};
  }

 private:
  PolicyCache cache_;
};

// Belady's OPT: on a miss, evict the slot whose key is used again farthest in the
// future, among slots not holding the current selection. Slots never empty once
// filled, so empty slots are handed out by a counter (lowest index first). Each
// pool keeps its occupied slots ordered by next use, so a miss costs O(k + log N).
class OptPolicy final : public SimPolicy {
 public:
  // geometry: a cache for the same configuration, read for its pool layout only.
  OptPolicy(const SimTrace& trace, const ResidencyCache& geometry)
      : trace_(trace.trace()),
        next_use_(trace.next_use()),
        table_(static_cast<size_t>(trace_.n_layer) * trace_.n_expert, kNoSlot),
        owner_(geometry.config().n_slots, kNoKey),
        next_of_slot_(geometry.config().n_slots, SimTrace::kNeverAgain),
        selected_keys_(trace_.k) {
    for (const ResidencyPool& pool : geometry.pools()) {
      pools_.push_back(Pool{pool.slot_begin, pool.n_slots, 0, {}});
    }
    for (int32_t layer = 0; layer < trace_.n_layer; ++layer) {
      pool_of_layer_.push_back(geometry.pool_of_layer(layer));
    }
  }

  std::string_view name() const override { return "opt"; }

  StepCounts Step(int64_t step, int32_t layer, const uint16_t* experts) override {
    StepCounts counts;
    const int32_t k = trace_.k;
    const size_t first_access = trace_.row_offset(step, layer);
    Pool& pool = pools_[pool_of_layer_[layer]];
    for (int32_t r = 0; r < k; ++r) {
      selected_keys_[r] = residency_key(layer, experts[r], trace_.n_expert);
    }
    for (int32_t r = 0; r < k; ++r) {
      const int32_t slot = table_[selected_keys_[r]];
      if (slot == kNoSlot) continue;
      SetNextUse(pool, slot, next_use_[first_access + r]);
      ++counts.hits;
    }
    // Ids are distinct, so a key without a slot here missed in the pass above.
    for (int32_t r = 0; r < k; ++r) {
      const int32_t key = selected_keys_[r];
      if (table_[key] != kNoSlot) continue;
      int32_t slot = kNoSlot;
      if (pool.n_filled < pool.n_slots) {
        slot = pool.slot_begin + pool.n_filled++;
      } else {
        auto victim = pool.by_next_use.begin();
        while (key_in_selection(owner_[victim->second], selected_keys_.data(), k)) ++victim;
        slot = victim->second;
        pool.by_next_use.erase(victim);
        table_[owner_[slot]] = kNoSlot;
        ++counts.evictions;
      }
      owner_[slot] = key;
      table_[key] = slot;
      next_of_slot_[slot] = next_use_[first_access + r];
      pool.by_next_use.insert({next_of_slot_[slot], slot});
      ++counts.misses;
    }
    return counts;
  }

 private:
  // Farthest next use first; equal next uses (only kNeverAgain repeats, since an
  // access index belongs to one key) go lowest slot first.
  struct FartherFirst {
    bool operator()(const std::pair<int64_t, int32_t>& a,
                    const std::pair<int64_t, int32_t>& b) const {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    }
  };
  struct Pool {
    int32_t slot_begin;
    int32_t n_slots;
    int32_t n_filled;
    std::set<std::pair<int64_t, int32_t>, FartherFirst> by_next_use;  // occupied slots
  };

  void SetNextUse(Pool& pool, int32_t slot, int64_t next_use) {
    auto node = pool.by_next_use.extract({next_of_slot_[slot], slot});
    node.value().first = next_use;
    pool.by_next_use.insert(std::move(node));
    next_of_slot_[slot] = next_use;
  }

  const RoutingTrace& trace_;
  const std::vector<int64_t>& next_use_;
  std::vector<Pool> pools_;
  std::vector<int32_t> pool_of_layer_;
  std::vector<int32_t> table_;          // key -> slot or kNoSlot
  std::vector<int32_t> owner_;          // slot -> key or kNoKey
  std::vector<int64_t> next_of_slot_;   // slot -> next use of its key
  std::vector<int32_t> selected_keys_;  // [k], the current row's keys
};

CacheConfig CacheConfigFor(const RoutingTrace& trace, const SimConfig& config,
                           double protected_frac) {
  CacheConfig cache;
  cache.n_layer = trace.n_layer;
  cache.n_expert = trace.n_expert;
  cache.k = trace.k;
  cache.n_slots = config.n_slots;
  cache.protected_frac = protected_frac;
  cache.pool_mode = config.pool_mode;
  return cache;
}

template <ResidencyPolicy kPolicy>
absl::StatusOr<std::unique_ptr<SimPolicy>> MakeOnline(const SimTrace& trace,
                                                      const SimConfig& config) {
  MG_ASSIGN_OR_RETURN(PolicyCache cache,
                      PolicyCache::Create(kPolicy, CacheConfigFor(trace.trace(), config,
                                                                  config.protected_frac)));
  return std::make_unique<OnlinePolicy>(std::move(cache));
}

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeOpt(const SimTrace& trace, const SimConfig& config) {
  // The cache validates the configuration and lays out the pools exactly as the
  // online policies get them.
  MG_ASSIGN_OR_RETURN(ResidencyCache geometry,
                      ResidencyCache::Create(CacheConfigFor(trace.trace(), config, 0.0)));
  return std::make_unique<OptPolicy>(trace, geometry);
}

using PolicyFactory = absl::StatusOr<std::unique_ptr<SimPolicy>> (*)(const SimTrace&,
                                                                     const SimConfig&);
struct PolicyEntry {
  std::string_view name;
  PolicyFactory make;
};

// Every policy the simulator can run. A new policy: one row here.
constexpr PolicyEntry kPolicies[] = {
    {"lru", &MakeOnline<ResidencyPolicy::kLru>},
    {"slru", &MakeOnline<ResidencyPolicy::kSlru>},
    {"hazard", &MakeOnline<ResidencyPolicy::kHazard>},
    {"opt", &MakeOpt},
};

constexpr std::string_view kDefaultAlias = "default";

absl::Status CheckPositive(double value, std::string_view flag) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s %g must be a positive number", Av(flag), value));
}

}  // namespace

absl::StatusOr<SimTrace> SimTrace::Create(const RoutingTrace& trace) {
  if (trace.n_layer <= 0 || trace.n_expert <= 0 || trace.k <= 0 || trace.n_steps < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "trace geometry: n_layer %d, n_expert %d, k %d, n_steps %d must be positive", trace.n_layer,
        trace.n_expert, trace.k, trace.n_steps));
  }
  if (trace.k > trace.n_expert) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "trace geometry: k %d exceeds the %d experts per layer", trace.k, trace.n_expert));
  }
  if (trace.ids.size() != trace.row_offset(trace.n_steps, 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "trace geometry: %d ids, but %d steps x %d layers x k %d need %d", trace.ids.size(),
        trace.n_steps, trace.n_layer, trace.k, trace.row_offset(trace.n_steps, 0)));
  }
  SimTrace sim(&trace);
  // seen[e] == the row's ordinal + 1 when e already occurred in that row.
  std::vector<int64_t> seen(trace.n_expert, 0);
  int64_t row_ordinal = 0;
  for (int64_t step = 0; step < trace.n_steps; ++step) {
    for (int32_t layer = 0; layer < trace.n_layer; ++layer) {
      if (!trace.present(step, layer)) continue;
      ++row_ordinal;
      const uint16_t* row = trace.row(step, layer);
      for (int32_t r = 0; r < trace.k; ++r) {
        if (row[r] >= trace.n_expert) {
          return absl::InvalidArgumentError(
              absl::StrFormat("trace step %d layer %d rank %d: expert %d is outside [0, %d)", step,
                              layer, r, row[r], trace.n_expert));
        }
        if (seen[row[r]] == row_ordinal) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "trace step %d layer %d: expert %d is selected twice", step, layer, row[r]));
        }
        seen[row[r]] = row_ordinal;
      }
    }
  }
  sim.n_accesses_ = row_ordinal * trace.k;
  return sim;
}

const std::vector<int64_t>& SimTrace::next_use() const {
  if (next_use_ready_) return next_use_;
  const RoutingTrace& t = *trace_;
  next_use_.assign(t.ids.size(), kNeverAgain);
  // Walking backwards, next_access[key] is the key's earliest access seen so far.
  std::vector<int64_t> next_access(static_cast<size_t>(t.n_layer) * t.n_expert, kNeverAgain);
  for (int64_t step = t.n_steps - 1; step >= 0; --step) {
    for (int32_t layer = t.n_layer - 1; layer >= 0; --layer) {
      if (!t.present(step, layer)) continue;
      const size_t first = t.row_offset(step, layer);
      for (int32_t r = 0; r < t.k; ++r) {
        const int32_t key = residency_key(layer, t.ids[first + r], t.n_expert);
        next_use_[first + r] = next_access[key];
        next_access[key] = static_cast<int64_t>(first + r);
      }
    }
  }
  next_use_ready_ = true;
  return next_use_;
}

std::string_view ResolvePolicyName(std::string_view name) {
  return name == kDefaultAlias ? kDefaultPolicy : name;
}

std::vector<std::string_view> SimPolicyNames() {
  std::vector<std::string_view> names;
  for (const PolicyEntry& entry : kPolicies) names.push_back(entry.name);
  names.push_back(kDefaultAlias);
  return names;
}

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeSimPolicy(const SimTrace& trace,
                                                         const SimConfig& config) {
  const std::string_view name = ResolvePolicyName(config.policy);
  for (const PolicyEntry& entry : kPolicies) {
    if (entry.name == name) return entry.make(trace, config);
  }
  std::vector<std::string> names;
  for (std::string_view known : SimPolicyNames()) names.emplace_back(known);
  return absl::InvalidArgumentError(
      absl::StrFormat("--policy '%s' is not one of %s", config.policy, absl::StrJoin(names, ", ")));
}

absl::StatusOr<SimResult> Simulate(const SimTrace& trace, const SimConfig& config) {
  MG_ASSIGN_OR_RETURN(std::unique_ptr<SimPolicy> policy, MakeSimPolicy(trace, config));
  const RoutingTrace& t = trace.trace();
  SimResult result;
  result.policy = config.policy;
  result.n_slots = config.n_slots;
  result.pool_mode = config.pool_mode;
  result.n_steps = t.n_steps;
  for (int64_t step = 0; step < t.n_steps; ++step) {
    for (int32_t layer = 0; layer < t.n_layer; ++layer) {
      if (!t.present(step, layer)) continue;
      const StepCounts counts = policy->Step(step, layer, t.row(step, layer));
      result.hits += counts.hits;
      result.misses += counts.misses;
      result.evictions += counts.evictions;
    }
  }
  return result;
}

std::string_view PoolModeName(PoolMode mode) {
  return mode == PoolMode::kGlobal ? "global" : "per-layer";
}

absl::StatusOr<PoolMode> ParsePoolMode(std::string_view text) {
  if (text == "global") return PoolMode::kGlobal;
  if (text == "per-layer") return PoolMode::kPerLayer;
  return absl::InvalidArgumentError(
      absl::StrFormat("--pool '%s' is not one of global, per-layer", Av(text)));
}

absl::Status ValidateCostModel(const CostModel& model) {
  MG_RETURN_IF_ERROR(CheckPositive(model.block_mib, "--block-mib"));
  MG_RETURN_IF_ERROR(CheckPositive(model.pcie_gbps, "--pcie-gbps"));
  MG_RETURN_IF_ERROR(CheckPositive(model.hbm_gbps, "--hbm-gbps"));
  MG_RETURN_IF_ERROR(CheckPositive(model.ram_gbps, "--ram-gbps"));
  if (!(std::isfinite(model.resident_ms) && model.resident_ms >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--resident-ms %g must be 0 (derive it) or a positive number", model.resident_ms));
  }
  return absl::OkStatus();
}

double ResidentMs(const CostModel& model, int32_t k, int32_t n_layer) {
  if (model.resident_ms > 0) return model.resident_ms;
  const double active_bytes = static_cast<double>(k) * n_layer * model.block_mib * kBytesPerMib;
  return active_bytes / (model.hbm_gbps * kBytesPerGb) * 1e3;
}

CostPrediction PredictCost(const CostModel& model, const SimResult& result, int32_t k,
                           int32_t n_layer) {
  CostPrediction p;
  p.resident_ms = ResidentMs(model, k, n_layer);
  p.mib_per_token = result.n_steps > 0
                        ? static_cast<double>(result.misses) * model.block_mib / result.n_steps
                        : 0.0;
  p.miss_ms = p.mib_per_token * kBytesPerMib / (model.pcie_gbps * kBytesPerGb) * 1e3;
  p.tok_s = 1e3 / (p.resident_ms + p.miss_ms);
  return p;
}

double BreakEvenHitRate(const CostModel& model) {
  return std::clamp(1.0 - model.pcie_gbps / model.ram_gbps, 0.0, 1.0);
}

}  // namespace moegraph
