// The device side of the emulated CUDA (docs/EMULATOR.md). The emulated tree
// force-includes it into every .cu file, as nvcc force-includes the toolkit's
// cuda_runtime.h: built-in variables, barriers, warp shuffles, atomics, the math
// the kernels call, and the typed kernel launch behind kernels/launch.cuh.
//
// A block's threads are fibers on one OS thread. __syncthreads, __syncwarp and
// __shfl_xor_sync are where a thread may give way to another; between them a
// thread runs alone, so an atomic is a plain read-modify-write.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

// Built-in variables of the thread running now; the emulator sets them before it
// switches to a thread. constinit: no TLS wrapper call at each use.
extern constinit thread_local uint3 threadIdx;
extern constinit thread_local uint3 blockIdx;
extern constinit thread_local dim3 blockDim;
extern constinit thread_local dim3 gridDim;

namespace moegraph_emu {

// Where a thread waits: the threads that meet at a barrier or a warp primitive
// must wait at the same source line.
struct Site {
  const char* file;
  int line;
};

void SyncThreads(Site site);
void SyncWarp(Site site, unsigned mask = 0xffffffffu);
// Every lane of mask meets here; returns the bits of lane (this lane ^ lane_mask).
uint64_t ShuffleXor(Site site, unsigned mask, uint64_t bits, int lane_mask, int width);

template <typename T>
T ShflXorSync(Site site, unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(std::is_arithmetic_v<T> && sizeof(T) <= 8,
                "__shfl_xor_sync takes a scalar of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ShuffleXor(site, mask, bits, lane_mask, width);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

// ---- kernel launches ----

// One launch: the kernel, its geometry and its argument values, copied when the
// launch is enqueued (or captured), as CUDA copies a kernel's parameters.
class KernelLaunch {
 public:
  KernelLaunch(const char* name, dim3 grid, dim3 block) : name_(name), grid_(grid), block_(block) {}
  virtual ~KernelLaunch() = default;
  // The kernel body as the current thread, with a copy of every argument.
  virtual void RunThread() const = 0;
  // visit(context, argument index, address) for each pointer argument.
  virtual void ForEachPointer(void (*visit)(void* context, int index, const void* address),
                              void* context) const = 0;

  const char* name() const { return name_; }
  dim3 grid() const { return grid_; }
  dim3 block() const { return block_; }

 private:
  const char* name_;
  dim3 grid_;
  dim3 block_;
};

template <auto Kernel, typename... Params>
class TypedKernelLaunch final : public KernelLaunch {
 public:
  template <typename... Args>
  TypedKernelLaunch(const char* name, dim3 grid, dim3 block, Args&&... args)
      : KernelLaunch(name, grid, block), args_(std::forward<Args>(args)...) {}

  void RunThread() const override { std::apply(Kernel, args_); }

  void ForEachPointer(void (*visit)(void*, int, const void*), void* context) const override {
    std::apply(
        [&](const auto&... arg) {
          int index = 0;
          (Visit(arg, index++, visit, context), ...);
        },
        args_);
  }

 private:
  template <typename T>
  static void Visit(const T& arg, int index, void (*visit)(void*, int, const void*),
                    void* context) {
    if constexpr (std::is_pointer_v<T>) visit(context, index, static_cast<const void*>(arg));
  }

  std::tuple<Params...> args_;
};

template <typename Function>
struct KernelSignature;
template <typename... Params>
struct KernelSignature<void (*)(Params...)> {
  template <auto Kernel>
  using Launch = TypedKernelLaunch<Kernel, std::decay_t<Params>...>;
};

// Enqueues the launch on stream, or records it in the stream's capture; a bad
// configuration or stream becomes the thread's last error, as for <<<...>>>,
// and is returned.
cudaError_t EnqueueKernel(std::shared_ptr<const KernelLaunch> launch, cudaStream_t stream);

// cudaLaunchKernelEx's checks of the configuration beyond grid, block and
// stream: its attributes and dynamic shared memory.
cudaError_t CheckLaunchConfig(const cudaLaunchConfig_t* config);

// "matvec_kernel" from KernelName<matvec_kernel>'s signature.
std::string KernelNameFromSignature(const char* signature);

template <auto Kernel>
const char* KernelName() {
  static const std::string name = KernelNameFromSignature(__PRETTY_FUNCTION__);
  return name.c_str();
}

// Kernel<<<grid, block, 0, stream>>>(args...).
template <auto Kernel, typename... Args>
void Launch(dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  using LaunchType = typename KernelSignature<decltype(Kernel)>::template Launch<Kernel>;
  EnqueueKernel(std::make_shared<const LaunchType>(KernelName<Kernel>(), grid, block,
                                                   std::forward<Args>(args)...),
                stream);
}

// cudaLaunchKernelEx(config, Kernel, args...). A programmatic launch runs as
// any other: its kernel starts after the one before it in the stream has
// finished, which is what its griddepcontrol.wait would give it (the overlap
// before the wait is not emulated).
template <auto Kernel, typename... Args>
cudaError_t LaunchEx(const cudaLaunchConfig_t* config, Args&&... args) {
  if (const cudaError_t bad = CheckLaunchConfig(config); bad != cudaSuccess) return bad;
  using LaunchType = typename KernelSignature<decltype(Kernel)>::template Launch<Kernel>;
  return EnqueueKernel(
      std::make_shared<const LaunchType>(KernelName<Kernel>(), config->gridDim, config->blockDim,
                                         std::forward<Args>(args)...),
      config->stream);
}

}  // namespace moegraph_emu

// The intrinsics carry their source line, so the emulator can tell which
// barrier or shuffle each thread waits at.
#define __syncthreads() ::moegraph_emu::SyncThreads({__FILE__, __LINE__})
#define __syncwarp(...) ::moegraph_emu::SyncWarp({__FILE__, __LINE__} __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_xor_sync(...) \
  ::moegraph_emu::ShflXorSync(::moegraph_emu::Site{__FILE__, __LINE__}, __VA_ARGS__)

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  const unsigned int old = *address;
  *address = old + value;
  return old;
}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

// A kernel's blocks run one at a time over one memory, so a block sees every
// write of the blocks before it: a fence has nothing left to order, and a load
// through L2 (the last-block epilogues of kernels/epilogue.cuh) is a load.
inline void __threadfence() {}
template <typename T>
inline T __ldcg(const T* address) {
  return *address;
}

// A kernel that traps ends the process: in the emulator a trap is a test's
// failure, never something to recover from.
[[noreturn]] inline void __trap() {
  std::fputs("emulator: a kernel called __trap()\n", stderr);
  std::abort();
}

// Host arithmetic, rounded as the CPU rounds (the emulated tree compiles with
// -ffp-contract=off), not as the device's math library does.
inline float __fmul_rn(float a, float b) { return a * b; }

// __dp4a (sm_61+): the four signed bytes of a and b multiplied pairwise and
// added to c, in 32-bit integer arithmetic (cuda_conformance_test checks it
// against a device).
inline int __dp4a(int a, int b, int c) {
  // 32-bit arithmetic that wraps, as the instruction's does.
  uint32_t sum = static_cast<uint32_t>(c);
  for (int i = 0; i < 4; ++i) {
    sum += static_cast<uint32_t>(static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i)) *
                                 static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i)));
  }
  return static_cast<int>(sum);
}

inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
