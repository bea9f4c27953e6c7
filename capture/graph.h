// Host-side engagement counters, CUDA errors as absl::Status, and a walk
// captured once as a CUDA graph and replayed per launch.
#pragma once

#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "capture/walk.h"

namespace moegraph {

// Incremented where the host does the work; a gate compares snapshots.
struct HostCounters {
  uint64_t graph_launches = 0;  // cudaGraphLaunch calls
  uint64_t captures = 0;        // walks captured and instantiated
  uint64_t eager_steps = 0;     // steps run as eager walks
  uint64_t host_syncs = 0;      // stream or event synchronizations, blocking copies
  uint64_t h2d_memcpys = 0;     // host-to-device copy calls (uploads, the host arm's misses)
  // Kernels launched (or captured) with programmatic dependent launch.
  uint64_t programmatic_launches = 0;
  // Prompts: tokens run as T=1 decode steps, or in the batched prefill's
  // ubatches; the prefill's routed experts read in place from their slots or
  // streamed through the staging ring (once per ubatch and layer), and the
  // bytes streamed.
  uint64_t prompt_steps = 0;
  uint64_t prefill_tokens = 0;
  uint64_t prefill_ubatches = 0;
  uint64_t prefill_experts_in_place = 0;
  uint64_t prefill_experts_streamed = 0;
  uint64_t prefill_bytes_streamed = 0;
  // Generates that fed their kept positions again from 0: the windowed
  // layers' KV rings no longer held them (CudaEngineOptions::swa_full).
  uint64_t ring_refills = 0;
  // ... or a Gated DeltaNet's state was not at the position the Generate
  // started from (it holds every position fed, and only those).
  uint64_t state_refills = 0;
};

// OK for cudaSuccess; otherwise an error naming `what` and the CUDA error
// (ResourceExhausted for cudaErrorMemoryAllocation, Internal for the rest), and
// the thread's last CUDA error is cleared.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

// RunWalk, its kernels launched programmatically (counted in
// counters.programmatic_launches) when walk.config.programmatic_launch is set.
cudaError_t LaunchWalk(const StepWalk& walk, HostCounters& counters, size_t* failed_entry);

// One walk captured on `main` (the copy stream joins through the walk's fork
// events) and instantiated. Move-only; destroys the graph with it.
class StepGraph {
 public:
  // Captures in thread-local mode, so other threads' CUDA calls are not
  // affected. Errors name the entry whose enqueue failed.
  static absl::StatusOr<StepGraph> Capture(const StepWalk& walk, cudaStream_t main,
                                           HostCounters& counters);
  StepGraph(StepGraph&& other) noexcept;
  StepGraph& operator=(StepGraph&& other) noexcept;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  ~StepGraph();

  // Enqueues one replay on main (no wait).
  absl::Status Launch(cudaStream_t main, HostCounters& counters) const;
  int steps() const { return steps_; }

 private:
  StepGraph() = default;
  void Release();

  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  int steps_ = 0;
};

}  // namespace moegraph
