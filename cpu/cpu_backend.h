// The CPU backend: the oracle's forward pass with the engine's expert path. Each
// token is one T=1 step (the prompt too, teacher forced, as on the GPU); per
// layer the residency policy decides hits and misses, each missed expert's block
// is staged from the ExpertStore into a host slot, and the experts compute from
// the slots. Combine runs in router rank order, so tokens and logits equal the
// oracle's bit for bit whatever hit or missed. Resident (the CUDA engine's
// resident arm): no store, no slots, no policy; every expert is read in place
// from the model's mapped file, as the dense weights always are.
//
// Slots: one pool per size class of the store (layers with identical block
// layouts). A policy cache has one slot size, so each class gets its own cache,
// keyed by the class's layers renumbered 0.. in ascending order; with a single
// class (the usual case) local and model layer numbers coincide.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cpu/forward.h"
#include "loader/expert_file.h"
#include "loader/model_config.h"
#include "loader/placement.h"
#include "reference/oracle.h"
#include "residency/cache.h"
#include "residency/policy_cache.h"
#include "residency/trace.h"

namespace moegraph {

struct CpuBackendOptions {
  int max_ctx = 0;  // KV cache positions
  // Slots over all size classes; 0: auto, every expert (n_layer * n_expert)
  // where host memory allows, else as many as fit in the available host memory
  // less a 1 GiB rail. Classes share them in proportion to their layer counts.
  int32_t n_slots = 0;
  // Host memory auto may use; 0: MemAvailable of /proc/meminfo (every expert
  // where that cannot be read).
  uint64_t host_available_bytes = 0;
  ResidencyPolicy policy = kDefaultResidencyPolicy;
  double protected_frac = kDefaultProtectedFrac;  // slru only
  PoolMode pool_mode = PoolMode::kGlobal;
  // false: MOEGRAPH_MOE_CACHE=0, every selected expert is staged each step into
  // k scratch slots of its class, and no residency state is kept.
  bool cache = true;
  // Every expert read in place from the model's file (n_slots, the policy and
  // cache are then unused): no copy, every computed expert a hit.
  bool resident = false;
  // The disk tier: a miss reads its block from the model's file
  // (loader/expert_file.h) instead of the store's memory, whose blocks the
  // store then need not hold (ExpertStore::Layouts). Must outlive the backend.
  ExpertFileReader* disk = nullptr;
  // --drop-cold-experts F: a routed expert that is not in a slot and whose
  // combine weight is below F / k is skipped (weight 0, the others unchanged;
  // residency/drop_cold.h), the top expert always kept; 0: off. Prompts (a
  // Forward of more than one token) keep their experts unless drop_in_prompts.
  double drop_cold = 0;
  bool drop_in_prompts = false;
  // Routing replay (moegraph bench --routing-trace): step s, layer l takes the
  // trace's row (s mod n_steps, l) instead of the router's selection, with the
  // trace's weights (uniform 1/k when it has none); a row the trace lacks keeps
  // the router's. Null: the router decides. Must outlive the backend.
  const RoutingTrace* routing_trace = nullptr;
  // The arithmetic: the fast path (cpu/forward.h: threads, SIMD, quantized
  // activations) or, with oracle_arithmetic, the oracle's own (f64, one thread),
  // for checks that need the oracle's bits.
  CpuForwardOptions fast;
  bool oracle_arithmetic = false;
};

// A trace that can stand in for the model's router: n_layer and k equal the
// model's, at least one step, every present id below the model's n_expert.
// Errors name the field and both values.
absl::Status CheckRoutingTrace(const RoutingTrace& trace, const ModelConfig& config);

// The expert path's engagement counters, incremented where the work happens
// (the GPU engine keeps the same set in device memory).
struct EngineCounters {
  uint64_t steps = 0;         // T=1 forward steps (tokens fed)
  uint64_t hits = 0;          // selected experts found in a slot
  uint64_t misses = 0;        // selected experts staged (copied) into a slot
  uint64_t evictions = 0;     // resident experts displaced by a miss
  uint64_t bytes_staged = 0;  // block bytes copied into slots
  uint64_t stage_ns = 0;      // CPU backend: wall time inside the stage copies (memcpy or reads)
  uint64_t disk_reads = 0;    // CPU backend's disk tier: blocks read from the file
  uint64_t disk_bytes = 0;    // and the bytes read for them (O_DIRECT's aligned ranges)
  uint64_t dropped = 0;       // --drop-cold-experts: routings skipped
  double dropped_weight = 0;  // and the combine weight they carried
};

// The slot pool of one size class.
struct SlotPoolInfo {
  size_t block_bytes = 0;
  int32_t n_slots = 0;      // after clamping to the class's experts (cache on), k (cache off)
  std::vector<int> layers;  // model layers served, ascending
  size_t pool_bytes() const { return block_bytes * static_cast<size_t>(n_slots); }
};

// Drives like the oracle (Forward, Generate).
// Reset and Truncate touch the KV cache only: resident experts and counters
// carry over.
class CpuBackend final : public Oracle {
 public:
  // model, its file and store must outlive the backend; store must hold model's
  // experts, and may be null only with options.resident (which never reads it).
  // Errors name the flag: a pool below --top-k slots, a bad --protected-frac, a
  // context size below 1, a slot pool that cannot be allocated.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Model& model,
                                                            const ExpertStore* store,
                                                            const CpuBackendOptions& options);
  ~CpuBackend() override;

  // A batch runs as one batch where the slots hold every expert (the residency
  // steps then count the same in any order), else as T=1 steps, token by token.
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) override;
  absl::StatusOr<std::vector<float>> ForwardLast(absl::Span<const int32_t> tokens) override;
  int n_past() const override;
  void Truncate(int n_keep) override;
  int ResumePosition(int n_keep) const override;

  // Whether a batch of tokens runs as one batch (every expert resident).
  bool BatchesPrompts() const;
  const EngineCounters& counters() const;
  // The KV caches' bytes (a windowed layer's ring counted at its rows).
  size_t kv_cache_bytes() const { return kv_bytes_; }
  // One per size class, indexed like store.size_classes(); none when resident.
  const std::vector<SlotPoolInfo>& pools() const;
  // The residency state of a size class's pool; null with the cache off.
  const PolicyCache* cache(int size_class) const;
  // The bytes in one slot of a size class's pool (pools()[size_class].block_bytes).
  const uint8_t* slot_block(int size_class, int32_t slot) const;
  // The routing every step saw: k ids in router rank order per (step, layer), at
  // [(step * n_layer + layer) * k, ... + k).
  const std::vector<int32_t>& routing() const;

 private:
  class SlotExperts;
  CpuBackend() = default;

  const Model* model_ = nullptr;
  int max_ctx_ = 0;
  bool oracle_arithmetic_ = false;
  size_t kv_bytes_ = 0;
  std::vector<SlotPoolInfo> pools_;

  // Declared before oracle_, which calls into it, so it is destroyed after.
  std::unique_ptr<SlotExperts> experts_;
  std::unique_ptr<Oracle> oracle_;

  absl::StatusOr<std::vector<float>> Run(absl::Span<const int32_t> tokens, bool all_logits);
};

}  // namespace moegraph
