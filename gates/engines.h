// The engines a gate drives, behind one interface: the CPU backend
// (cpu/cpu_backend.h) and the CUDA engine (capture/engine.h), each built
// from the doors of an arm, with a decode that returns every step's logits when
// asked, a counter snapshot, the routing it ran and its residency state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "capture/doors.h"
#include "capture/engine.h"
#include "cpu/cpu_backend.h"
#include "gates/counters.h"
#include "loader/model_config.h"
#include "residency/cache.h"
#include "residency/policy_cache.h"

namespace moegraph {

enum class Backend { kCpu, kCuda };

// One engine's configuration: the doors of its arm and the pool.
struct ArmSpec {
  Doors doors;
  int32_t n_slots = 0;  // over all size classes
  int max_ctx = 0;
  int steps_per_launch = 1;     // CUDA only
  bool record_routing = false;  // CUDA only (the CPU backend always records it)
  // CUDA only: every step's logits kept on the device, so a decode can return
  // them all (LogitRows::kEvery); the CPU backend always has them.
  bool record_logits = false;
};

enum class LogitRows { kNone, kLast, kEvery };

// A greedy decode: n_predict tokens and, as asked, the logits that picked each
// (rows of n_vocab, row i picked tokens[i]).
struct Transcript {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
};

class GateEngine {
 public:
  virtual ~GateEngine() = default;
  // From position 0 (the KV cache restarts); residency state and counters carry
  // over. kEvery on CUDA needs an engine made with ArmSpec::record_logits.
  virtual absl::StatusOr<Transcript> Decode(absl::Span<const int32_t> prompt, int n_predict,
                                            LogitRows rows) = 0;
  virtual absl::StatusOr<CounterSnapshot> Snapshot() = 0;
  // k ids in router rank order per (step, layer), over every step run so far.
  // CUDA: empty unless ArmSpec::record_routing.
  virtual const std::vector<int32_t>& routing() const = 0;
  virtual const std::vector<SlotPoolInfo>& pools() const = 0;
  // An error where the arm keeps no residency state (stage, resident).
  virtual absl::StatusOr<ResidencySnapshot> Residency(int size_class) = 0;
};

using EngineFactory = std::function<absl::StatusOr<std::unique_ptr<GateEngine>>(
    const Model& model, const ArmSpec& spec)>;

// CPU backends; the factory keeps one ExpertStore per model, so it must outlive
// the engines it makes, and the models must outlive it.
EngineFactory CpuEngineFactory();
// CUDA engines; the factory pins one ExpertStore per model and shares it among
// them, so the models must outlive it (the engines keep their store alive).
EngineFactory CudaEngineFactory();

// The residency state of a size class after a fresh PolicyCache of `policy` and
// `config` is fed that class's rows of `routing` (layers renumbered 0.. within
// the class, as the engines key them). Also adds the replay's hits and misses.
absl::StatusOr<ResidencySnapshot> ReplayRouting(ResidencyPolicy policy, const CacheConfig& config,
                                                const std::vector<int>& class_layers, int n_layer,
                                                const std::vector<int32_t>& routing, uint64_t* hits,
                                                uint64_t* misses);

}  // namespace moegraph
