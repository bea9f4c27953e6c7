// The emulated runtime: the device and its configuration, errors, memory,
// streams, events, copies, kernel launches and the scheduler that runs them.
// Stream capture and graphs are in capture.cc.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include "emulator/state.h"
#include "emulator/testing.h"

namespace moegraph_emu {
namespace {

// An H200 as the CUDA runtime describes it.
constexpr size_t kH200Memory = size_t{143771} << 20;
constexpr size_t kDeviceAlignment = 256;
constexpr size_t kPinnedAlignment = 4096;
constexpr int kLeastStreamPriority = 0;
constexpr int kGreatestStreamPriority = -5;

thread_local cudaError_t last_error = cudaSuccess;

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// "1048576", "512M", "2G" (binary units); false when it is not one.
bool ParseBytes(const char* text, size_t* bytes) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text || text[0] == '-') return false;
  unsigned shift = 0;
  if (*end != '\0') {
    static constexpr char kUnits[] = "KMGT";
    const char* unit = std::strchr(kUnits, *end);
    if (unit == nullptr || end[1] != '\0') return false;
    shift = 10 * static_cast<unsigned>(unit - kUnits + 1);
  }
  if (value == 0 || value > (~0ull >> shift)) return false;
  *bytes = static_cast<size_t>(value << shift);
  return true;
}

void Configure(Device& d) {
  d.memory_bytes = kH200Memory;
  if (const char* text = std::getenv("MOEGRAPH_EMU_SEED"); text != nullptr) {
    char* end = nullptr;
    d.seed = std::strtoull(text, &end, 10);
    if (end == text || *end != '\0' || text[0] == '-') {
      d.config_error = std::string("MOEGRAPH_EMU_SEED='") + text + "' is not an unsigned integer";
    }
  }
  if (const char* text = std::getenv("MOEGRAPH_EMU_DEVICE_MEMORY"); text != nullptr) {
    if (!ParseBytes(text, &d.memory_bytes)) {
      d.config_error = std::string("MOEGRAPH_EMU_DEVICE_MEMORY='") + text +
                       "' is not a size in bytes (e.g. 4294967296, 4096M, 4G)";
    }
  }
  if (!d.config_error.empty()) {
    std::fprintf(stderr, "moegraph-emu: %s; every CUDA call fails\n", d.config_error.c_str());
  }
  d.rng = Rng(d.seed);
  d.legacy = std::make_shared<CUstream_st>();
  d.legacy->legacy = true;
}

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};

// The names and strings of CUDA 13's runtime, for the errors the emulator returns.
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState",
     "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureMerge, "cudaErrorStreamCaptureMerge",
     "operation would result in a merge of separate capture sequences"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined",
     "capturing stream has unjoined work"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorCapturedEvent, "cudaErrorCapturedEvent",
     "operation not permitted on an event last recorded in a capturing stream"},
    {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText* FindError(cudaError_t error) {
  for (const ErrorText& e : kErrors) {
    if (e.error == error) return &e;
  }
  return nullptr;
}

// ---- work on a stream ----

class OpWork final : public Work {
 public:
  explicit OpWork(Op op) : op_(std::move(op)) {}

  bool Step(Device& device) override {
    if (const auto* kernel = std::get_if<std::shared_ptr<const KernelLaunch>>(&op_)) {
      return StepKernel(device, **kernel);
    }
    if (const auto* copy = std::get_if<CopyOp>(&op_)) {
      RunCopy(device, *copy);
      return true;
    }
    const MemsetOp& memset = std::get<MemsetOp>(op_);
    if (!device.DeviceCanAccess(memset.dst, memset.bytes)) {
      device.Fault(cudaErrorIllegalAddress, "memset of freed memory");
      return true;
    }
    std::memset(memset.dst, memset.value, memset.bytes);
    return true;
  }

 private:
  bool StepKernel(Device& device, const KernelLaunch& launch) {
    const dim3 grid = launch.grid();
    const size_t n_blocks = static_cast<size_t>(grid.x) * grid.y * grid.z;
    if (order_.empty()) {
      // Checked when the kernel starts, so a replayed graph finds memory freed
      // since its capture.
      std::string bad;
      struct Check {
        Device* device;
        std::string* bad;
      } check{&device, &bad};
      launch.ForEachPointer(
          [](void* context, int index, const void* address) {
            auto* c = static_cast<Check*>(context);
            if (address == nullptr || !c->bad->empty() || c->device->DeviceCanAccess(address, 1)) {
              return;
            }
            char text[128];
            std::snprintf(text, sizeof(text),
                          "argument %d (%p) is not device memory or mapped pinned memory", index,
                          address);
            *c->bad = text;
          },
          &check);
      if (!bad.empty()) {
        device.Fault(cudaErrorIllegalAddress, std::string(launch.name()) + ": " + bad);
        return true;
      }
      order_.resize(n_blocks);
      std::iota(order_.begin(), order_.end(), size_t{0});
      for (size_t i = n_blocks; i > 1; --i) std::swap(order_[i - 1], order_[device.rng.Below(i)]);
    }
    const size_t b = order_[next_++];
    const uint3 block{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                      static_cast<unsigned>(b / (static_cast<size_t>(grid.x) * grid.y))};
    const std::string fault = RunBlock(launch, block, device.rng);
    if (!fault.empty()) {
      device.Fault(cudaErrorLaunchFailure,
                   std::string(launch.name()) + " block (" + std::to_string(block.x) + "," +
                       std::to_string(block.y) + "," + std::to_string(block.z) + "): " + fault);
      return true;
    }
    return next_ == n_blocks;
  }

  void RunCopy(Device& device, const CopyOp& copy) {
    // Device-side ends are checked again when the copy runs (a graph may replay
    // it after the memory was freed).
    const Allocation* dst = device.FindAllocation(copy.dst);
    const Allocation* src = device.FindAllocation(copy.src);
    if ((dst != nullptr && device.FindAllocation(copy.dst, copy.bytes) == nullptr) ||
        (src != nullptr && copy.staged == nullptr &&
         device.FindAllocation(copy.src, copy.bytes) == nullptr)) {
      device.Fault(cudaErrorIllegalAddress, "a copy ran past the end of its allocation");
      return;
    }
    std::memcpy(copy.dst, copy.staged != nullptr ? copy.staged->data() : copy.src, copy.bytes);
  }

  Op op_;
  std::vector<size_t> order_;  // blocks in the order they run
  size_t next_ = 0;
};

class RecordWork final : public Work {
 public:
  explicit RecordWork(std::shared_ptr<double> time_ms) : time_ms_(std::move(time_ms)) {}
  bool Step(Device&) override {
    *time_ms_ = NowMs();
    return true;
  }

 private:
  std::shared_ptr<double> time_ms_;
};

CUevent_st* FindEvent(Device& d, cudaEvent_t handle) {
  auto it = d.events.find(handle);
  return it == d.events.end() ? nullptr : it->second.get();
}

const char* KindName(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault:
      return "cudaMemcpyDefault";
  }
  return "an unknown kind";
}

// The copy's ends against its kind: each device end lies in one device (or mapped
// pinned) allocation, each host end outside device memory, and a host end inside
// a pinned allocation within it. The copy when valid, with a pageable source of a
// host-to-device copy staged.
cudaError_t PrepareCopy(Device& d, const char* call, void* dst, const void* src, size_t bytes,
                        cudaMemcpyKind kind, CopyOp* out) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    return cudaErrorInvalidMemcpyDirection;
  }
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  auto is_device = [&](const void* p) {
    const Allocation* a = d.FindAllocation(p);
    return a != nullptr && a->kind == MemoryKind::kDevice;
  };
  if (kind == cudaMemcpyDefault) {
    const bool dst_device = is_device(dst);
    const bool src_device = is_device(src);
    kind = dst_device ? (src_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                      : (src_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool dst_on_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_on_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  auto check = [&](const void* p, bool on_device, const char* end) {
    const Allocation* a = d.FindAllocation(p);
    std::string problem;
    if (on_device && !d.DeviceCanAccess(p, bytes)) {
      problem = a == nullptr ? "is not device memory" : "runs past the end of its allocation";
    } else if (!on_device && a != nullptr && a->kind == MemoryKind::kDevice) {
      problem = "is device memory";
    } else if (!on_device && a != nullptr && d.FindAllocation(p, bytes) == nullptr) {
      problem = "runs past the end of its pinned allocation";
    }
    if (problem.empty()) return true;
    char text[256];
    std::snprintf(text, sizeof(text), "%s of %zu bytes (%s): the %s %p %s", call, bytes,
                  KindName(kind), end, p, problem.c_str());
    d.Diagnose(text);
    return false;
  };
  if (!check(dst, dst_on_device, "destination") || !check(src, src_on_device, "source")) {
    return cudaErrorInvalidValue;
  }
  out->dst = dst;
  out->src = src;
  out->bytes = bytes;
  if (kind == cudaMemcpyHostToDevice && d.FindAllocation(src) == nullptr) {
    const auto* begin = static_cast<const uint8_t*>(src);
    out->staged = std::make_shared<const std::vector<uint8_t>>(begin, begin + bytes);
  }
  return cudaSuccess;
}

cudaError_t CreateStream(cudaStream_t* out, unsigned int flags, int priority = 0) {
  MG_EMU_CALL(d);
  if (out == nullptr || (flags & ~cudaStreamNonBlocking) != 0) return Return(cudaErrorInvalidValue);
  auto stream = std::make_shared<CUstream_st>();
  stream->blocking = (flags & cudaStreamNonBlocking) == 0;
  stream->priority = std::clamp(priority, kGreatestStreamPriority, kLeastStreamPriority);
  d.streams[stream.get()] = stream;
  *out = stream.get();
  return cudaSuccess;
}

cudaError_t CreateEvent(cudaEvent_t* out, unsigned int flags) {
  MG_EMU_CALL(d);
  if (out == nullptr || (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming)) != 0) {
    return Return(cudaErrorInvalidValue);
  }
  auto event = std::make_unique<CUevent_st>();
  event->flags = flags;
  *out = event.get();
  d.events[event.get()] = std::move(event);
  return cudaSuccess;
}

}  // namespace

cudaError_t Return(cudaError_t error) {
  if (error != cudaSuccess) last_error = error;
  return error;
}

bool StreamPoint::Reached() const { return stream == nullptr || stream->completed >= seq; }

bool Work::Ready() const {
  for (const StreamPoint& point : after) {
    if (!point.Reached()) return false;
  }
  return true;
}

Device& Device::Get() {
  static Device* device = [] {
    auto* d = new Device;
    Configure(*d);
    return d;
  }();
  return *device;
}

CUstream_st* Device::FindStream(cudaStream_t handle) {
  if (handle == nullptr || handle == cudaStreamLegacy) return legacy.get();
  auto it = streams.find(handle);
  return it == streams.end() ? nullptr : it->second.get();
}

std::shared_ptr<CUstream_st> Device::Share(CUstream_st* stream) {
  if (stream == legacy.get()) return legacy;
  return streams.at(stream);
}

const Allocation* Device::FindAllocation(const void* p, size_t bytes) const {
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(address);
  if (it == allocations.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  if (address - a.begin >= a.bytes || bytes > a.bytes - (address - a.begin)) return nullptr;
  return &a;
}

bool Device::DeviceCanAccess(const void* p, size_t bytes) const {
  const Allocation* a = FindAllocation(p, bytes);
  return a != nullptr && a->kind != MemoryKind::kPinned;
}

void Device::Enqueue(CUstream_st* stream, std::unique_ptr<Work> work) {
  // The legacy stream waits for the blocking streams' earlier work, and they for its.
  if (stream->legacy) {
    auto wait_for = [&work](const std::shared_ptr<CUstream_st>& other) {
      if (other->blocking && other->enqueued > other->completed) {
        work->after.push_back({other, other->enqueued});
      }
    };
    for (const auto& [handle, other] : streams) wait_for(other);
    for (const auto& other : orphans) wait_for(other);
  } else if (stream->blocking && legacy->enqueued > legacy->completed) {
    work->after.push_back({legacy, legacy->enqueued});
  }
  stream->queue.push_back(std::move(work));
  ++stream->enqueued;
}

std::unique_ptr<Work> Device::MakeWork(const Op& op) { return std::make_unique<OpWork>(op); }

cudaError_t Device::Submit(CUstream_st* stream, Op op) {
  if (stream->legacy) {
    if (const cudaError_t err = CheckLegacyUse(); err != cudaSuccess) return err;
  }
  if (stream->capture != nullptr) {
    if (stream->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
    std::vector<Node>& nodes = stream->capture->nodes;
    nodes.push_back({std::move(op), stream->capture_deps});
    stream->capture_deps = {static_cast<int>(nodes.size()) - 1};
    return cudaSuccess;
  }
  Enqueue(stream, MakeWork(op));
  return cudaSuccess;
}

void Device::RunUntil(const std::function<bool()>& done) {
  std::vector<CUstream_st*> ready;
  while (sticky == cudaSuccess && !done()) {
    ready.clear();
    auto consider = [&](CUstream_st* s) {
      if (!s->queue.empty() && s->queue.front()->Ready()) ready.push_back(s);
    };
    consider(legacy.get());
    for (const auto& [handle, stream] : streams) consider(stream.get());
    for (const auto& stream : orphans) consider(stream.get());
    if (ready.empty()) {
      // Every wait names work enqueued before it, so some stream can always run.
      std::fprintf(stderr, "moegraph-emu: internal error: queued work cannot run\n");
      std::abort();
    }
    CUstream_st* stream = ready[rng.Below(ready.size())];
    const bool finished = stream->queue.front()->Step(*this);
    if (sticky != cudaSuccess) {
      // The context is lost, as on a device: nothing queued will run.
      legacy->queue.clear();
      for (auto& [handle, s] : streams) s->queue.clear();
      orphans.clear();
      return;
    }
    if (finished) {
      stream->queue.pop_front();
      ++stream->completed;
    }
  }
  std::erase_if(orphans, [](const auto& s) { return s->queue.empty(); });
}

void Device::RunStream(CUstream_st* stream) {
  const uint64_t target = stream->enqueued;
  RunUntil([stream, target] { return stream->completed >= target; });
}

void Device::RunAll() {
  RunUntil([this] {
    if (!legacy->queue.empty()) return false;
    for (const auto& [handle, stream] : streams) {
      if (!stream->queue.empty()) return false;
    }
    for (const auto& stream : orphans) {
      if (!stream->queue.empty()) return false;
    }
    return true;
  });
}

void Device::Fault(cudaError_t error, const std::string& message) {
  std::fprintf(stderr, "moegraph-emu: %s: %s (MOEGRAPH_EMU_SEED=%llu)\n", cudaGetErrorName(error),
               message.c_str(), static_cast<unsigned long long>(seed));
  sticky = error;
}

void Device::Diagnose(const std::string& message) const {
  std::fprintf(stderr, "moegraph-emu: %s (MOEGRAPH_EMU_SEED=%llu)\n", message.c_str(),
               static_cast<unsigned long long>(seed));
}

void ReseedForTesting(uint64_t seed) {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.seed = seed;
  d.rng = Rng(seed);
}

cudaError_t CheckLaunchConfig(const cudaLaunchConfig_t* config) {
  if (config == nullptr || (config->numAttrs > 0 && config->attrs == nullptr)) {
    return Return(cudaErrorInvalidValue);
  }
  if (config->dynamicSmemBytes != 0) return Return(cudaErrorNotSupported);
  for (unsigned int i = 0; i < config->numAttrs; ++i) {
    const cudaLaunchAttributeID id = config->attrs[i].id;
    if (id != cudaLaunchAttributeIgnore &&
        id != cudaLaunchAttributeProgrammaticStreamSerialization) {
      return Return(cudaErrorNotSupported);
    }
  }
  return cudaSuccess;
}

cudaError_t EnqueueKernel(std::shared_ptr<const KernelLaunch> launch, cudaStream_t stream) {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (const cudaError_t blocked = d.Blocked(); blocked != cudaSuccess) return Return(blocked);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  const dim3 grid = launch->grid();
  const dim3 block = launch->block();
  const unsigned long long threads = static_cast<unsigned long long>(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 ||
      block.y > 1024 || block.z > 64 || threads > 1024) {
    return Return(cudaErrorInvalidConfiguration);
  }
  const char* name = launch->name();
  const cudaError_t err = d.Submit(s, std::move(launch));
  if (err == cudaSuccess && d.recorded_launches != nullptr) {
    d.recorded_launches->push_back({name, grid, block});
  }
  return Return(err);
}

LaunchRecorder::LaunchRecorder() {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.recorded_launches != nullptr) {
    std::fputs("moegraph-emu: a LaunchRecorder while another records\n", stderr);
    std::abort();
  }
  d.recorded_launches = &launches_;
}

LaunchRecorder::~LaunchRecorder() {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.recorded_launches = nullptr;
}

std::vector<RecordedLaunch> LaunchRecorder::launches() const {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  return launches_;
}

}  // namespace moegraph_emu

using moegraph_emu::Device;
using moegraph_emu::Return;

// ---- errors and the device ----

cudaError_t cudaGetLastError(void) {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  const cudaError_t error = moegraph_emu::last_error;
  if (d.sticky == cudaSuccess) moegraph_emu::last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError(void) {
  Device& d = Device::Get();
  std::lock_guard<std::mutex> lock(d.mutex);
  return d.sticky != cudaSuccess ? d.sticky : moegraph_emu::last_error;
}

const char* cudaGetErrorString(cudaError_t error) {
  const moegraph_emu::ErrorText* e = moegraph_emu::FindError(error);
  return e != nullptr ? e->text : "unrecognized error code";
}

const char* cudaGetErrorName(cudaError_t error) {
  const moegraph_emu::ErrorText* e = moegraph_emu::FindError(error);
  return e != nullptr ? e->name : "unrecognized error code";
}

cudaError_t cudaGetDeviceCount(int* count) {
  MG_EMU_CALL(d);
  if (count == nullptr) return Return(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  MG_EMU_CALL(d);
  return device == 0 ? cudaSuccess : Return(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  MG_EMU_CALL(d);
  if (prop == nullptr) return Return(cudaErrorInvalidValue);
  if (device != 0) return Return(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name),
                "NVIDIA H200 (moegraph CPU emulator, MOEGRAPH_EMU_SEED=%llu)",
                static_cast<unsigned long long>(d.seed));
  prop->totalGlobalMem = d.memory_bytes;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = 227 * 1024;
  prop->sharedMemPerMultiprocessor = 228 * 1024;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->totalConstMem = 64 * 1024;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->l2CacheSize = 60 * 1024 * 1024;
  prop->canMapHostMemory = 1;
  prop->unifiedAddressing = 1;
  prop->concurrentKernels = 1;
  prop->asyncEngineCount = 3;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  MG_EMU_CALL(d);
  if (free == nullptr || total == nullptr) return Return(cudaErrorInvalidValue);
  *total = d.memory_bytes;
  *free = d.memory_bytes - d.device_bytes_in_use;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  MG_EMU_CALL(d);
  // The device is a broader handle than any capturing stream.
  if (!d.captures.empty()) {
    for (const auto& capture : std::vector(d.captures)) d.Invalidate(capture);
    return Return(cudaErrorStreamCaptureUnsupported);
  }
  d.RunAll();
  return Return(d.sticky);
}

// ---- memory ----

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  MG_EMU_CALL(d);
  if (devPtr == nullptr) return Return(cudaErrorInvalidValue);
  if (const cudaError_t err = d.CheckUnsafeCall(); err != cudaSuccess) return Return(err);
  if (size == 0) {
    *devPtr = nullptr;
    return cudaSuccess;
  }
  if (size > d.memory_bytes - d.device_bytes_in_use) return Return(cudaErrorMemoryAllocation);
  // One host allocation per call, so AddressSanitizer's red zones surround it.
  void* p = nullptr;
  if (posix_memalign(&p, moegraph_emu::kDeviceAlignment, size) != 0) {
    return Return(cudaErrorMemoryAllocation);
  }
  moegraph_emu::Poison(p, size);
  const auto begin = reinterpret_cast<uintptr_t>(p);
  d.allocations[begin] = {begin, size, moegraph_emu::MemoryKind::kDevice};
  d.device_bytes_in_use += size;
  *devPtr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* devPtr) {
  MG_EMU_CALL(d);
  if (const cudaError_t err = d.CheckUnsafeCall(); err != cudaSuccess) return Return(err);
  if (devPtr == nullptr) return cudaSuccess;
  auto it = d.allocations.find(reinterpret_cast<uintptr_t>(devPtr));
  if (it == d.allocations.end() || it->second.kind != moegraph_emu::MemoryKind::kDevice) {
    d.Diagnose("cudaFree of a pointer cudaMalloc did not return");
    return Return(cudaErrorInvalidValue);
  }
  // cudaFree waits for the device, so no queued work outlives the memory.
  d.RunAll();
  d.device_bytes_in_use -= it->second.bytes;
  d.allocations.erase(it);
  std::free(devPtr);
  return Return(d.sticky);
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  MG_EMU_CALL(d);
  if (pHost == nullptr ||
      (flags & ~(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined)) != 0) {
    return Return(cudaErrorInvalidValue);
  }
  if (const cudaError_t err = d.CheckUnsafeCall(); err != cudaSuccess) return Return(err);
  const size_t physical =
      static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = nullptr;
  if (size > physical ||
      posix_memalign(&p, moegraph_emu::kPinnedAlignment, std::max<size_t>(size, 1)) != 0) {
    return Return(cudaErrorMemoryAllocation);
  }
  moegraph_emu::Poison(p, size);
  const auto begin = reinterpret_cast<uintptr_t>(p);
  d.allocations[begin] = {begin, std::max<size_t>(size, 1),
                          (flags & cudaHostAllocMapped) != 0
                              ? moegraph_emu::MemoryKind::kPinnedMapped
                              : moegraph_emu::MemoryKind::kPinned};
  *pHost = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  MG_EMU_CALL(d);
  if (const cudaError_t err = d.CheckUnsafeCall(); err != cudaSuccess) return Return(err);
  if (ptr == nullptr) return cudaSuccess;
  auto it = d.allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == d.allocations.end() || it->second.kind == moegraph_emu::MemoryKind::kDevice) {
    d.Diagnose("cudaFreeHost of a pointer cudaHostAlloc did not return");
    return Return(cudaErrorInvalidValue);
  }
  d.RunAll();
  d.allocations.erase(it);
  std::free(ptr);
  return Return(d.sticky);
}

cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int flags) {
  MG_EMU_CALL(d);
  if (pDevice == nullptr || flags != 0) return Return(cudaErrorInvalidValue);
  const moegraph_emu::Allocation* a = d.FindAllocation(pHost);
  if (a == nullptr || a->kind != moegraph_emu::MemoryKind::kPinnedMapped) {
    d.Diagnose(a == nullptr ? "cudaHostGetDevicePointer of memory cudaHostAlloc did not return"
                            : "cudaHostGetDevicePointer of pinned memory allocated without "
                              "cudaHostAllocMapped");
    return Return(cudaErrorInvalidValue);
  }
  // One address space: the device sees mapped memory at its host address.
  *pDevice = pHost;
  return cudaSuccess;
}

// ---- copies ----

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  MG_EMU_CALL(d);
  if (const cudaError_t err = d.CheckUnsafeCall(); err != cudaSuccess) return Return(err);
  if (const cudaError_t err = d.CheckLegacyUse(); err != cudaSuccess) return Return(err);
  if (count == 0) return cudaSuccess;
  moegraph_emu::CopyOp copy;
  if (const cudaError_t err =
          moegraph_emu::PrepareCopy(d, "cudaMemcpy", dst, src, count, kind, &copy);
      err != cudaSuccess) {
    return Return(err);
  }
  CUstream_st* legacy = d.legacy.get();
  d.Enqueue(legacy, Device::MakeWork(copy));
  d.RunStream(legacy);
  return Return(d.sticky);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  moegraph_emu::CopyOp copy;
  if (const cudaError_t err =
          moegraph_emu::PrepareCopy(d, "cudaMemcpyAsync", dst, src, count, kind, &copy);
      err != cudaSuccess) {
    return Return(err);
  }
  const bool capturing = s->capture != nullptr;
  if (capturing) copy.staged = nullptr;  // a graph's copy node reads its source when it runs
  if (const cudaError_t err = d.Submit(s, copy); err != cudaSuccess) return Return(err);
  // A copy into pageable memory returns once it is done, as CUDA's does.
  if (!capturing && d.FindAllocation(dst) == nullptr) {
    d.RunStream(s);
    return Return(d.sticky);
  }
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  if (!d.DeviceCanAccess(devPtr, count)) {
    d.Diagnose("cudaMemsetAsync of " + std::to_string(count) +
               " bytes outside device memory (or past the end of its allocation)");
    return Return(cudaErrorInvalidValue);
  }
  return Return(d.Submit(s, moegraph_emu::MemsetOp{devPtr, value, count}));
}

// ---- streams ----

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return moegraph_emu::CreateStream(pStream, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  return moegraph_emu::CreateStream(pStream, flags);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  MG_EMU_CALL(d);
  if (leastPriority != nullptr) *leastPriority = moegraph_emu::kLeastStreamPriority;
  if (greatestPriority != nullptr) *greatestPriority = moegraph_emu::kGreatestStreamPriority;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream, unsigned int flags, int priority) {
  return moegraph_emu::CreateStream(pStream, flags, priority);
}

cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int* priority) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(hStream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (priority == nullptr) return Return(cudaErrorInvalidValue);
  *priority = s->priority;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  MG_EMU_CALL(d);
  auto it = d.streams.find(stream);
  if (it == d.streams.end()) return Return(cudaErrorInvalidResourceHandle);
  if (it->second->capture != nullptr) {
    d.Invalidate(it->second->capture);
    return Return(cudaErrorStreamCaptureUnsupported);
  }
  // Work already queued still runs, as on a device.
  if (!it->second->queue.empty()) d.orphans.push_back(it->second);
  d.streams.erase(it);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  MG_EMU_CALL(d);
  CUstream_st* s = d.FindStream(stream);
  if (s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) {
    d.Invalidate(s->capture);
    return Return(cudaErrorStreamCaptureUnsupported);
  }
  if (s->legacy) {
    if (const cudaError_t err = d.CheckLegacyUse(); err != cudaSuccess) return Return(err);
  }
  d.RunStream(s);
  return Return(d.sticky);
}

// ---- events ----

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return moegraph_emu::CreateEvent(event, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  return moegraph_emu::CreateEvent(event, flags);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  MG_EMU_CALL(d);
  return d.events.erase(event) == 1 ? cudaSuccess : Return(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  MG_EMU_CALL(d);
  CUevent_st* e = moegraph_emu::FindEvent(d, event);
  CUstream_st* s = d.FindStream(stream);
  if (e == nullptr || s == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) {
    if (s->capture->invalidated) return Return(cudaErrorStreamCaptureInvalidated);
    // A captured record stands for the nodes the stream has reached.
    e->capture = s->capture;
    e->capture_deps = s->capture_deps;
    e->point = {};
    return cudaSuccess;
  }
  if (s->legacy) {
    if (const cudaError_t err = d.CheckLegacyUse(); err != cudaSuccess) return Return(err);
  }
  e->capture = nullptr;
  e->capture_deps.clear();
  e->time_ms = std::make_shared<double>(std::nan(""));
  d.Enqueue(s, std::make_unique<moegraph_emu::RecordWork>(e->time_ms));
  e->point = {d.Share(s), s->enqueued};
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  MG_EMU_CALL(d);
  CUevent_st* e = moegraph_emu::FindEvent(d, event);
  if (e == nullptr) return Return(cudaErrorInvalidResourceHandle);
  if (e->capture != nullptr) return Return(cudaErrorCapturedEvent);
  const moegraph_emu::StreamPoint point = e->point;
  d.RunUntil([&point] { return point.Reached(); });
  return Return(d.sticky);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  MG_EMU_CALL(d);
  CUevent_st* a = moegraph_emu::FindEvent(d, start);
  CUevent_st* b = moegraph_emu::FindEvent(d, end);
  if (ms == nullptr) return Return(cudaErrorInvalidValue);
  if (a == nullptr || b == nullptr || ((a->flags | b->flags) & cudaEventDisableTiming) != 0) {
    return Return(cudaErrorInvalidResourceHandle);
  }
  if (a->capture != nullptr || b->capture != nullptr) return Return(cudaErrorCapturedEvent);
  if (a->time_ms == nullptr || b->time_ms == nullptr || !a->point.Reached() ||
      !b->point.Reached()) {
    return Return(cudaErrorNotReady);
  }
  *ms = static_cast<float>(*b->time_ms - *a->time_ms);
  return cudaSuccess;
}
