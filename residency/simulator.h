// The trace simulator: replays a routing trace through a residency policy on the
// host and counts hits, misses and evictions, then turns the misses into a
// predicted decode speed with a simple cost model.
//
// Policies: the online ones of residency/policy_cache.h ("lru", "slru",
// "hazard"), stepped by their host caches; "opt", Belady's clairvoyant policy,
// the upper bound no online policy can beat; "default", the engine's default
// (kDefaultResidencyPolicy). A new policy is a SimPolicy subclass plus one row in
// the registry table in simulator.cc.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "residency/cache.h"
#include "residency/policy_cache.h"
#include "residency/trace.h"

namespace moegraph {

// The policy "default" runs (the engine's default).
inline constexpr std::string_view kDefaultPolicy = PolicyName(kDefaultResidencyPolicy);

struct StepCounts {
  int32_t hits = 0;
  int32_t misses = 0;
  int32_t evictions = 0;
};

// A residency policy as the simulator drives it: one call per present
// (step, layer) row of the trace, in trace order (steps ascending, layers
// ascending within a step).
class SimPolicy {
 public:
  virtual ~SimPolicy() = default;
  virtual std::string_view name() const = 0;
  // experts: the row's k distinct ids in router rank order, as the trace stores them.
  virtual StepCounts Step(int64_t step, int32_t layer, const uint16_t* experts) = 0;
};

// A validated trace plus what policies precompute from it, once for every run.
class SimTrace {
 public:
  // Checks the geometry and every present row (k distinct ids in [0, n_expert));
  // errors name the row. Keeps a pointer: trace must outlive the result.
  static absl::StatusOr<SimTrace> Create(const RoutingTrace& trace);

  const RoutingTrace& trace() const { return *trace_; }
  // Accesses in present rows (present rows * k).
  int64_t n_accesses() const { return n_accesses_; }
  // Per access, indexed row_offset(step, layer) + rank (the global access order
  // (step, layer, rank)): the index of the next access of the same (layer,
  // expert) key, or kNeverAgain. Computed on first use, in O(accesses).
  const std::vector<int64_t>& next_use() const;

  static constexpr int64_t kNeverAgain = std::numeric_limits<int64_t>::max();

 private:
  explicit SimTrace(const RoutingTrace* trace) : trace_(trace) {}

  const RoutingTrace* trace_;
  int64_t n_accesses_ = 0;
  // Lazily built: only OPT needs it, and it costs 8 bytes per access.
  mutable std::vector<int64_t> next_use_;
  mutable bool next_use_ready_ = false;
};

struct SimConfig {
  std::string policy;  // a name from SimPolicyNames()
  int32_t n_slots = 0;
  PoolMode pool_mode = PoolMode::kGlobal;
  double protected_frac = kDefaultProtectedFrac;  // slru only
};

// Builds the named policy for the trace's geometry. Errors name the flag:
// --policy for an unknown name, --slots for a pool the policy cannot run.
absl::StatusOr<std::unique_ptr<SimPolicy>> MakeSimPolicy(const SimTrace& trace,
                                                         const SimConfig& config);
// Every name MakeSimPolicy accepts, "default" included, in registry order.
std::vector<std::string_view> SimPolicyNames();
// The policy a name runs: "default" resolves to kDefaultPolicy, others to themselves.
std::string_view ResolvePolicyName(std::string_view name);

struct SimResult {
  std::string policy;  // as requested ("default" stays "default")
  int32_t n_slots = 0;
  PoolMode pool_mode = PoolMode::kGlobal;
  int64_t n_steps = 0;  // tokens in the trace
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;

  int64_t accesses() const { return hits + misses; }
  double hit_rate() const { return accesses() > 0 ? static_cast<double>(hits) / accesses() : 0; }
};

// Replays every present row of the trace through the policy. Missing rows are
// skipped. Rows with an id outside [0, n_expert) or a repeated id are an error.
absl::StatusOr<SimResult> Simulate(const SimTrace& trace, const SimConfig& config);

std::string_view PoolModeName(PoolMode mode);  // "global" | "per-layer"
// Parses "global" or "per-layer"; the error names --pool.
absl::StatusOr<PoolMode> ParsePoolMode(std::string_view text);

// The cost model. Per token:
//   t_token = t_resident + miss_MiB_per_token * 2^20 B / PCIe_BW
//   tok/s   = 1 / t_token
// t_resident is the step time with every expert resident; when not given it is
// derived as the active expert bytes per token read once from HBM:
//   t_resident = k * n_layer * block_MiB * 2^20 B / HBM_BW.
// Assumption: miss copies do not overlap the step (the worst case: pass B waits
// for every copy), so each missed block adds block_bytes / PCIe_BW. GB/s is 1e9 B/s.
struct CostModel {
  double block_mib = 1.0;
  // PCIe 5 x16 (the H200's host link) is 64 GB/s raw; pinned H2D copies reach
  // about 50 GB/s in practice (PCIe 4 x16: about 25).
  double pcie_gbps = 50.0;
  double hbm_gbps = 4800.0;  // H200 HBM3e
  double ram_gbps = 80.0;    // host RAM read bandwidth a CPU expert pass achieves
  double resident_ms = 0.0;  // 0: derive from hbm_gbps
};

// Checks every field is finite and in range; errors name the flag.
absl::Status ValidateCostModel(const CostModel& model);

struct CostPrediction {
  double resident_ms = 0;  // given or derived
  double mib_per_token = 0;
  double miss_ms = 0;  // per token
  double tok_s = 0;
};

// The step time with every expert resident, in ms (model.resident_ms when > 0).
double ResidentMs(const CostModel& model, int32_t k, int32_t n_layer);
CostPrediction PredictCost(const CostModel& model, const SimResult& result, int32_t k,
                           int32_t n_layer);
// The lowest hit rate at which copying misses over PCIe beats computing every
// routed expert on the CPU from host RAM: 1 - PCIe_BW / RAM_BW, clamped to [0, 1].
double BreakEvenHitRate(const CostModel& model);

}  // namespace moegraph
