#include "capture/graph.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "kernels/kernels.h"
#include "loader/status_util.h"

namespace moegraph {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  // A failed call also leaves its error as the thread's last error, which every
  // launcher returns through cudaGetLastError: consumed here, so a non-sticky
  // error (a failed allocation or capture) does not fail the next, good launch.
  cudaGetLastError();
  const std::string message = absl::StrFormat("%s: %s (%s)", Av(what), cudaGetErrorName(err),
                                              cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

cudaError_t LaunchWalk(const StepWalk& walk, HostCounters& counters, size_t* failed_entry) {
  const ProgrammaticLaunchScope scope(
      walk.config.programmatic_launch ? &counters.programmatic_launches : nullptr);
  return RunWalk(walk, failed_entry);
}

absl::StatusOr<StepGraph> StepGraph::Capture(const StepWalk& walk, cudaStream_t main,
                                             HostCounters& counters) {
  StepGraph out;
  out.steps_ = walk.config.steps;
  MG_RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal),
                                "graph capture: cudaStreamBeginCapture"));
  size_t failed = 0;
  const cudaError_t walk_err = LaunchWalk(walk, counters, &failed);
  // The capture ends whatever happened, so the stream is usable afterwards.
  const cudaError_t end_err = cudaStreamEndCapture(main, &out.graph_);
  if (walk_err != cudaSuccess) {
    return CudaStatus(walk_err, absl::StrFormat("graph capture: %s",
                                                EntryLabel(walk.entries[failed])));
  }
  MG_RETURN_IF_ERROR(CudaStatus(end_err, "graph capture: cudaStreamEndCapture"));
  MG_RETURN_IF_ERROR(CudaStatus(
      cudaGraphInstantiate(&out.exec_, out.graph_, cudaGraphInstantiateFlagUseNodePriority),
      "graph capture: cudaGraphInstantiate"));
  ++counters.captures;
  return out;
}

StepGraph::StepGraph(StepGraph&& other) noexcept { *this = std::move(other); }

StepGraph& StepGraph::operator=(StepGraph&& other) noexcept {
  if (this == &other) return *this;
  Release();
  graph_ = std::exchange(other.graph_, nullptr);
  exec_ = std::exchange(other.exec_, nullptr);
  steps_ = other.steps_;
  return *this;
}

StepGraph::~StepGraph() { Release(); }

void StepGraph::Release() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}

absl::Status StepGraph::Launch(cudaStream_t main, HostCounters& counters) const {
  MG_RETURN_IF_ERROR(CudaStatus(cudaGraphLaunch(exec_, main), "cudaGraphLaunch"));
  ++counters.graph_launches;
  return absl::OkStatus();
}

}  // namespace moegraph
