// The emulator's internal state: one device with its allocations, streams,
// events, captures and graphs, behind one mutex.
//
// Device work runs only inside the host calls that wait for it (a synchronize,
// a blocking copy, cudaFree), on the calling thread: the scheduler picks, with
// the seeded generator, any stream whose next operation is ready and advances it
// by one quantum (a block of a kernel, a whole copy), so streams interleave at
// random, ordered only by stream order, events and the legacy stream's implicit
// synchronization.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "cuda_runtime.h"
#include "emulator/testing.h"

namespace moegraph_emu {

// splitmix64: small, fast, and the same sequence on every machine.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0, by multiply and shift (Lemire): no division.
  size_t Below(size_t n) {
    return static_cast<size_t>((static_cast<unsigned __int128>(Next()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

// Runs one block of launch: its threads as fibers on this OS thread, in a random
// order between the points where they wait. Returns the fault that stopped the
// block (a divergent barrier, a warp primitive some lane cannot reach, a
// deadlock), or an empty string.
std::string RunBlock(const KernelLaunch& launch, uint3 block, Rng& rng);

// The 32-bit word every fresh allocation and every block's shared memory is
// filled with: a NaN as f32 and f64, a huge index as an integer.
inline constexpr uint32_t kPoisonWord = 0x7fffdeadu;
void Poison(void* begin, size_t bytes);

enum class MemoryKind { kDevice, kPinned, kPinnedMapped };

struct Allocation {
  uintptr_t begin = 0;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kDevice;
};

struct CopyOp {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  // A pageable source of a host-to-device copy, copied when the call was made.
  std::shared_ptr<const std::vector<uint8_t>> staged;
};

struct MemsetOp {
  void* dst = nullptr;
  int value = 0;
  size_t bytes = 0;
};

using Op = std::variant<std::shared_ptr<const KernelLaunch>, CopyOp, MemsetOp>;

struct Node {
  Op op;
  std::vector<int> deps;  // indices of earlier nodes of the same graph
};

struct Capture;
class Device;

// A point in a stream's order: reached once the stream has completed `seq` operations.
struct StreamPoint {
  std::shared_ptr<CUstream_st> stream;
  uint64_t seq = 0;
  bool Reached() const;
};

// One operation of device work, advanced by quanta.
class Work {
 public:
  virtual ~Work() = default;
  // Advances by one quantum; true when finished. A fault goes to device.Fault.
  virtual bool Step(Device& device) = 0;
  bool Ready() const;

  std::vector<StreamPoint> after;  // reached before the first quantum
};

// Completes once the points in `after` are reached (cudaStreamWaitEvent).
class WaitWork final : public Work {
 public:
  bool Step(Device&) override { return true; }
};

}  // namespace moegraph_emu

// The handles' objects, at global scope as cuda_runtime_api.h declares them.
struct CUstream_st {
  bool legacy = false;
  bool blocking = true;  // synchronizes with the legacy stream
  int priority = 0;      // recorded; the scheduler picks streams at random whatever it is
  std::deque<std::unique_ptr<moegraph_emu::Work>> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  // While capturing: the capture and the nodes the next captured operation follows.
  std::shared_ptr<moegraph_emu::Capture> capture;
  std::vector<int> capture_deps;
};

struct CUevent_st {
  unsigned flags = 0;
  // The last record outside a capture (seq 0: never recorded) and the time it ran
  // (NaN until then).
  moegraph_emu::StreamPoint point;
  std::shared_ptr<double> time_ms;
  // Non-null when last recorded in a capture: the nodes it stands for.
  std::shared_ptr<moegraph_emu::Capture> capture;
  std::vector<int> capture_deps;
};

struct CUgraph_st {
  std::vector<moegraph_emu::Node> nodes;
};

namespace moegraph_emu {

// An instantiated graph: its nodes and, for each, the nodes that depend on it.
struct ExecGraph {
  std::vector<Node> nodes;
  std::vector<std::vector<int>> dependents;
};

}  // namespace moegraph_emu

struct CUgraphExec_st {
  std::shared_ptr<const moegraph_emu::ExecGraph> graph;
  moegraph_emu::StreamPoint last_launch;  // a graph's launches run one after another
};

namespace moegraph_emu {

struct Capture {
  std::shared_ptr<CUstream_st> origin;
  std::thread::id thread;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  bool invalidated = false;
  std::vector<Node> nodes;
  std::vector<std::shared_ptr<CUstream_st>> streams;  // the origin and every stream forked in
};

class Device {
 public:
  // The one device; its configuration comes from the environment (docs/FLAGS.md).
  static Device& Get();

  std::mutex mutex;
  // Empty, or why the environment's configuration is unusable (every call then
  // fails with cudaErrorInitializationError).
  std::string config_error;
  uint64_t seed = 1;
  size_t memory_bytes = 0;
  Rng rng{1};
  cudaError_t sticky = cudaSuccess;

  // The error every call returns before it does anything: a bad configuration,
  // or a sticky fault.
  cudaError_t Blocked() const {
    return config_error.empty() ? sticky : cudaErrorInitializationError;
  }

  std::map<uintptr_t, Allocation> allocations;
  size_t device_bytes_in_use = 0;

  std::shared_ptr<CUstream_st> legacy;
  std::map<CUstream_st*, std::shared_ptr<CUstream_st>> streams;  // created and not destroyed
  std::vector<std::shared_ptr<CUstream_st>> orphans;             // destroyed with work still queued
  std::map<CUevent_st*, std::unique_ptr<CUevent_st>> events;
  std::vector<std::shared_ptr<Capture>> captures;  // active
  std::map<CUgraph_st*, std::unique_ptr<CUgraph_st>> graphs;
  std::map<CUgraphExec_st*, std::unique_ptr<CUgraphExec_st>> execs;
  // The open LaunchRecorder's launches (emulator/testing.h), or null.
  std::vector<RecordedLaunch>* recorded_launches = nullptr;

  // ---- called with the mutex held ----

  // The stream of a handle (null and cudaStreamLegacy: the legacy stream); null
  // for an unknown handle.
  CUstream_st* FindStream(cudaStream_t handle);
  std::shared_ptr<CUstream_st> Share(CUstream_st* stream);
  // The allocation holding [p, p + bytes), or null.
  const Allocation* FindAllocation(const void* p, size_t bytes = 1) const;
  // Device memory or mapped pinned memory.
  bool DeviceCanAccess(const void* p, size_t bytes) const;

  // Runs an operation on a stream, or records it in the stream's capture.
  cudaError_t Submit(CUstream_st* stream, Op op);
  void Enqueue(CUstream_st* stream, std::unique_ptr<Work> work);
  static std::unique_ptr<Work> MakeWork(const Op& op);

  // Runs device work until done() holds or a fault makes the device's error sticky.
  void RunUntil(const std::function<bool()>& done);
  void RunStream(CUstream_st* stream);
  void RunAll();

  // A kernel or copy failed: the error becomes sticky (every later call returns
  // it) and the message goes to stderr with the seed; RunUntil then drops all
  // queued work once the faulting step has returned.
  void Fault(cudaError_t error, const std::string& message);
  // A call the program got wrong: one line on stderr.
  void Diagnose(const std::string& message) const;

  // ---- stream capture (capture.cc) ----

  // The calling thread may not make an unsafe call (allocate, free, synchronize
  // the device, copy synchronously) while it, or any thread in global mode,
  // captures: those captures are invalidated and the call fails.
  cudaError_t CheckUnsafeCall();
  // Legacy-stream work while a blocking stream captures: invalidates those
  // captures and fails.
  cudaError_t CheckLegacyUse();
  void Invalidate(const std::shared_ptr<Capture>& capture);
};

// Sets the calling thread's last error when error is not cudaSuccess; returns error.
cudaError_t Return(cudaError_t error);

}  // namespace moegraph_emu

// The start of every runtime call: `d` is the device, locked; a blocked device
// returns at once.
#define MG_EMU_CALL(d)                                                         \
  ::moegraph_emu::Device& d = ::moegraph_emu::Device::Get();                   \
  std::lock_guard<std::mutex> d##_lock(d.mutex);                               \
  if (const cudaError_t d##_blocked = d.Blocked(); d##_blocked != cudaSuccess) \
  return ::moegraph_emu::Return(d##_blocked)
