// Stream capture and graphs, with CUDA's rules and error codes.
//
// A capture records each operation submitted to a capturing stream as a node
// that depends on the nodes the stream had reached; an event recorded in a
// capturing stream stands for those nodes, and a stream that waits on such an
// event joins the capture (a fork). cudaStreamEndCapture on the origin stream
// fails unless every forked stream's last nodes are among the origin's (joined).
// A graph launch runs its nodes in a random order their dependencies allow,
// interleaving the blocks of nodes that are ready together, with the argument
// values captured.
#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "emulator/state.h"

namespace moegraph_emu {
namespace {

class GraphWork final : public Work {
 public:
  explicit GraphWork(std::shared_ptr<const ExecGraph> graph) : graph_(std::move(graph)) {}

  bool Step(Device& device) override {
    const size_t n = graph_->nodes.size();
    if (!started_) {
      started_ = true;
      running_.resize(n);
      waiting_for_.resize(n);
      for (size_t i = 0; i < n; ++i) {
        waiting_for_[i] = graph_->nodes[i].deps.size();
        if (waiting_for_[i] == 0) ready_.push_back(static_cast<int>(i));
      }
    }
    if (finished_ == n) return true;
    const size_t pick = device.rng.Below(ready_.size());
    const int node = ready_[pick];
    std::unique_ptr<Work>& work = running_[static_cast<size_t>(node)];
    if (work == nullptr) work = Device::MakeWork(graph_->nodes[static_cast<size_t>(node)].op);
    if (!work->Step(device)) return false;
    if (device.sticky != cudaSuccess) return true;
    work.reset();
    ready_[pick] = ready_.back();
    ready_.pop_back();
    ++finished_;
    for (int next : graph_->dependents[static_cast<size_t>(node)]) {
      if (--waiting_for_[static_cast<size_t>(next)] == 0) ready_.push_back(next);
    }
    return finished_ == n;
  }

 private:
  std::shared_ptr<const ExecGraph> graph_;
  bool started_ = false;
  std::vector<std::unique_ptr<Work>> running_;  // the node's work once started
  std::vector<size_t> waiting_for_;             // unfinished dependencies per node
  std::vector<int> ready_;                      // started or startable nodes
  size_t finished_ = 0;
};

bool IsActive(const Device& d, const std::shared_ptr<Capture>& capture) {
  return std::find(d.captures.begin(), d.captures.end(), capture) != d.captures.end();
}

// Every stream forked into the capture has joined the origin: its last nodes are
// the origin's last nodes or their ancestors.
std::string UnjoinedStream(const Capture& capture) {
  std::set<int> reached(capture.origin->capture_deps.begin(), capture.origin->capture_deps.end());
  std::vector<int> stack(reached.begin(), reached.end());
  while (!stack.empty()) {
    const int node = stack.back();
    stack.pop_back();
    for (int dep : capture.nodes[static_cast<size_t>(node)].deps) {
      if (reached.insert(dep).second) stack.push_back(dep);
    }
  }
  for (size_t i = 1; i < capture.streams.size(); ++i) {
    for (int node : capture.streams[i]->capture_deps) {
      if (reached.count(node) == 0) {
        return "forked stream " + std::to_string(i) + " has " +
               std::to_string(capture.streams[i]->capture_deps.size()) +
               " node(s) the origin stream never waited for";
      }
    }
  }
  return "";
}

}  // namespace

cudaError_t Device::CheckUnsafeCall() {
  const std::thread::id self = std::this_thread::get_id();
  bool conflict = false;
  for (const std::shared_ptr<Capture>& capture : captures) {
    if (capture->mode == cudaStreamCaptureModeGlobal ||
        (capture->mode == cudaStreamCaptureModeThreadLocal && capture->thread == self)) {
      Invalidate(capture);
      conflict = true;
    }
  }
  return conflict ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t Device::CheckLegacyUse() {
  bool conflict = false;
  for (const std::shared_ptr<Capture>& capture : captures) {
    for (const auto& stream : capture->streams) {
      if (stream->blocking) {
        Invalidate(capture);
        conflict = true;
        break;
      }
    }
  }
  return conflict ? cudaErrorStreamCaptureImplicit : cudaSuccess;
}

void Device::Invalidate(const std::shared_ptr<Capture>& capture) { capture->invalidated = true; }

}  // namespace moegraph_emu

using moegraph_emu::Capture;
using moegraph_emu::Device;
using moegraph_emu::Return;

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed) {
    return Return(cudaErrorInvalidValue);
  }
  if (s->legacy) return Return(cudaErrorStreamCaptureUnsupported);
  if (s->capture != nullptr) return Return(cudaErrorIllegalState);
  auto capture = std::make_shared<Capture>();
  capture->origin = d.Share(s);
  capture->thread = std::this_thread::get_id();
  capture->mode = mode;
  capture->streams.push_back(capture->origin);
  s->capture = capture;
  s->capture_deps.clear();
  d.captures.push_back(std::move(capture));
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (pGraph == nullptr) return Return(cudaErrorInvalidValue);
  const std::shared_ptr<Capture> capture = s->capture;
  if (capture == nullptr) return Return(cudaErrorIllegalState);
  if (capture->origin.get() != s) {
    d.Invalidate(capture);
    return Return(cudaErrorStreamCaptureUnmatched);
  }
  if (capture->mode != cudaStreamCaptureModeRelaxed &&
      capture->thread != std::this_thread::get_id()) {
    return Return(cudaErrorStreamCaptureWrongThread);
  }
  // The capture ends whatever its state; its streams leave capture mode.
  const std::string unjoined = moegraph_emu::UnjoinedStream(*capture);
  for (const auto& member : capture->streams) {
    member->capture = nullptr;
    member->capture_deps.clear();
  }
  std::erase(d.captures, capture);
  *pGraph = nullptr;
  if (capture->invalidated) return Return(cudaErrorStreamCaptureInvalidated);
  if (!unjoined.empty()) {
    d.Diagnose("cudaStreamEndCapture: " + unjoined);
    return Return(cudaErrorStreamCaptureUnjoined);
  }
  auto graph = std::make_unique<CUgraph_st>();
  graph->nodes = std::move(capture->nodes);
  *pGraph = graph.get();
  d.graphs[graph.get()] = std::move(graph);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  auto found = d.events.find(event);
  if (s == nullptr || found == d.events.end()) return Return(cudaErrorInvalidResourceHandle);
  if (flags != 0) return Return(cudaErrorInvalidValue);
  CUevent_st* e = found->second.get();
  if (e->capture != nullptr) {
    const std::shared_ptr<Capture> capture = e->capture;
    if (!moegraph_emu::IsActive(d, capture)) return Return(cudaErrorStreamCaptureIsolation);
    if (s->capture == nullptr) {
      if (s->legacy) return Return(cudaErrorStreamCaptureUnsupported);
      // A fork: the stream joins the capture after the event's nodes.
      s->capture = capture;
      s->capture_deps = e->capture_deps;
      capture->streams.push_back(d.Share(s));
    } else if (s->capture == capture) {
      for (int node : e->capture_deps) {
        if (std::find(s->capture_deps.begin(), s->capture_deps.end(), node) ==
            s->capture_deps.end()) {
          s->capture_deps.push_back(node);
        }
      }
    } else {
      d.Invalidate(capture);
      d.Invalidate(s->capture);
      return Return(cudaErrorStreamCaptureMerge);
    }
    return capture->invalidated ? Return(cudaErrorStreamCaptureInvalidated) : cudaSuccess;
  }
  // An event never recorded stands for no work.
  if (e->point.stream == nullptr) return cudaSuccess;
  if (s->capture != nullptr) {
    // Only a stream's own order may cross into a capture.
    d.Invalidate(s->capture);
    return Return(cudaErrorStreamCaptureIsolation);
  }
  if (s->legacy) {
    if (const cudaError_t err = d.CheckLegacyUse(); err != cudaSuccess) return Return(err);
  }
  auto wait = std::make_unique<moegraph_emu::WaitWork>();
  wait->after.push_back(e->point);
  d.Enqueue(s, std::move(wait));
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags) {
  MG_EMU_CALL(d);
  auto found = d.graphs.find(graph);
  if (pGraphExec == nullptr || found == d.graphs.end() ||
      (flags & ~static_cast<unsigned long long>(cudaGraphInstantiateFlagUseNodePriority)) != 0) {
    return Return(cudaErrorInvalidValue);
  }
  auto exec_graph = std::make_shared<moegraph_emu::ExecGraph>();
  exec_graph->nodes = found->second->nodes;
  exec_graph->dependents.resize(exec_graph->nodes.size());
  for (size_t i = 0; i < exec_graph->nodes.size(); ++i) {
    for (int dep : exec_graph->nodes[i].deps) {
      exec_graph->dependents[static_cast<size_t>(dep)].push_back(static_cast<int>(i));
    }
  }
  auto exec = std::make_unique<CUgraphExec_st>();
  exec->graph = std::move(exec_graph);
  *pGraphExec = exec.get();
  d.execs[exec.get()] = std::move(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  MG_EMU_CALL(d);
  auto found = d.execs.find(graphExec);
  CUstream_st* s = d.FindStream(stream);
  if (found == d.execs.end() || s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  // Capturing a graph launch (a child graph node) is not emulated.
  if (s->capture != nullptr) return Return(cudaErrorStreamCaptureUnsupported);
  if (s->legacy) {
    if (const cudaError_t err = d.CheckLegacyUse(); err != cudaSuccess) return Return(err);
  }
  CUgraphExec_st& exec = *found->second;
  auto work = std::make_unique<moegraph_emu::GraphWork>(exec.graph);
  if (exec.last_launch.stream != nullptr) work->after.push_back(exec.last_launch);
  d.Enqueue(s, std::move(work));
  exec.last_launch = {d.Share(s), s->enqueued};
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  MG_EMU_CALL(d);
  return d.graphs.erase(graph) == 1 ? cudaSuccess : Return(cudaErrorInvalidValue);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  MG_EMU_CALL(d);
  // A launch still queued keeps its graph.
  return d.execs.erase(graphExec) == 1 ? cudaSuccess : Return(cudaErrorInvalidValue);
}
