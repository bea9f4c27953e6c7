// The emulator's own behaviour beyond what a GPU shows (docs/EMULATOR.md; the
// shared behaviour is tests/cuda_conformance_test.cu): seeded random orders of
// threads and streams, faults where CUDA leaves the result undefined, poisoned
// fresh memory, pointer checks, the strict capture rules, copy semantics and the
// H200 it reports. Built only in the emulated tree, with the .cu force-include.
// A test whose fault makes the device's error sticky runs in a child process (a
// death test), as the fault ends a GPU program's context.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "emulator/testing.h"
#include "kernels/launch.cuh"
#include "tests/cuda_test_util.h"
#include "tests/test_kernels.cuh"

namespace moegraph {
namespace {

using testing_util::copy_kernel;
using testing_util::fill_kernel;

constexpr unsigned kFullMask = 0xffffffffu;

// Each thread appends its index: the order the threads ran in.
__global__ void order_kernel(int* order, int* next) {
  order[atomicAdd(next, 1)] = static_cast<int>(threadIdx.x);
}

// Reads a neighbour's slot with no barrier between the write and the read.
__global__ void racy_neighbour_kernel(float* out) {
  __shared__ float slots[64];
  slots[threadIdx.x] = static_cast<float>(threadIdx.x);
  out[threadIdx.x] = slots[(threadIdx.x + 1) % 64];
}

__global__ void uninitialized_shared_kernel(float* out) {
  __shared__ float scratch[32];
  out[threadIdx.x] = scratch[threadIdx.x];
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void barrier_after_exit_kernel() {
  if (threadIdx.x == 0) return;
  __syncthreads();
}

__global__ void shuffle_after_exit_kernel(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(kFullMask, 1.0f, 1);
}

__global__ void shuffle_in_partial_warp_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(kFullMask, 1.0f, 1);
}

__global__ void store_kernel(int* p, int value) { *p = value; }

__global__ void read_past_kernel(const int* in, int n, int* out) { *out = in[n]; }

// Thread 0 of each block appends tag: the order blocks of concurrent kernels ran in.
__global__ void block_log_kernel(int* log, int* next, int tag) {
  if (threadIdx.x == 0) log[atomicAdd(next, 1)] = tag;
}

class EmulatorTest : public testing_util::CudaStreamTest {
 protected:
  void SetUp() override {
    // A child process starts afresh, so a fault there leaves this one's device usable.
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    CudaStreamTest::SetUp();
  }
  template <typename T>
  T* DeviceAlloc(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    allocations_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    CudaStreamTest::TearDown();
  }

  std::vector<int> ThreadOrder(uint64_t seed) {
    moegraph_emu::ReseedForTesting(seed);
    int* order = DeviceAlloc<int>(64);
    int* next = DeviceAlloc<int>(1);
    EXPECT_EQ(cudaMemsetAsync(next, 0, sizeof(int), stream_), cudaSuccess);
    EXPECT_EQ(launch_kernel<order_kernel>(1, 64, stream_, order, next), cudaSuccess);
    Sync();
    return Download(order, 64);
  }

 private:
  std::vector<void*> allocations_;
};

// Runs statement in a child process started afresh, which must exit 0 and print
// text on stderr.
#define EXPECT_CHILD(statement, text)                           \
  do {                                                          \
    GTEST_FLAG_SET(death_test_style, "threadsafe");             \
    EXPECT_EXIT(statement, ::testing::ExitedWithCode(0), text); \
  } while (0)

TEST_F(EmulatorTest, TheDeviceIsAnH200) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  // The seed in force is in the name (ctest sets it per test).
  const char* seed = std::getenv("MOEGRAPH_EMU_SEED");
  EXPECT_EQ(std::string(prop.name),
            std::string("NVIDIA H200 (moegraph CPU emulator, MOEGRAPH_EMU_SEED=") +
                (seed != nullptr ? seed : "1") + ")");
  EXPECT_EQ(prop.major, 9);
  EXPECT_EQ(prop.minor, 0);
  EXPECT_EQ(prop.multiProcessorCount, 132);
  EXPECT_EQ(prop.sharedMemPerMultiprocessor, 228u * 1024);
  EXPECT_EQ(prop.maxThreadsPerBlock, 1024);
  EXPECT_EQ(prop.warpSize, 32);
  EXPECT_EQ(prop.totalGlobalMem, size_t{143771} << 20);
  size_t free_before = 0, total = 0, free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  EXPECT_EQ(total, prop.totalGlobalMem);
  int* p = DeviceAlloc<int>(1 << 20);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(free_before - free_after, size_t{4} << 20);
  void* huge = nullptr;
  EXPECT_EQ(cudaMalloc(&huge, size_t{1} << 62), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(EmulatorTest, ErrorsHaveCudasNamesAndStrings) {
  EXPECT_STREQ(cudaGetErrorName(cudaErrorStreamCaptureUnjoined), "cudaErrorStreamCaptureUnjoined");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorStreamCaptureUnjoined),
               "capturing stream has unjoined work");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorInvalidValue), "invalid argument");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorStreamCaptureUnsupported),
               "operation not permitted when stream is capturing");
}

TEST_F(EmulatorTest, TheSeedDecidesTheOrderThreadsRunIn) {
  const std::vector<int> first = ThreadOrder(7);
  std::vector<int> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 64; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);
  std::vector<int> in_order(64);
  for (int i = 0; i < 64; ++i) in_order[static_cast<size_t>(i)] = i;
  EXPECT_NE(first, in_order);
  EXPECT_EQ(ThreadOrder(7), first);
  EXPECT_NE(ThreadOrder(8), first);
}

TEST_F(EmulatorTest, AReadWithoutABarrierSeesPoisonOrAStaleValue) {
  float* out = DeviceAlloc<float>(64);
  ASSERT_EQ(launch_kernel<racy_neighbour_kernel>(1, 64, stream_, out), cudaSuccess);
  Sync();
  const std::vector<float> got = Download(out, 64);
  int wrong = 0;
  for (int t = 0; t < 64; ++t)
    wrong += got[static_cast<size_t>(t)] != static_cast<float>((t + 1) % 64);
  EXPECT_GT(wrong, 0);
}

TEST_F(EmulatorTest, FreshMemoryAndEachBlocksSharedMemoryArePoisoned) {
  const uint32_t* device_words = DeviceAlloc<uint32_t>(1024);
  for (uint32_t word : Download(device_words, 1024)) ASSERT_EQ(word, 0x7fffdeadu);
  double as_double = 0;
  const std::vector<uint32_t> two = Download(device_words, 2);
  std::memcpy(&as_double, two.data(), sizeof(as_double));
  EXPECT_TRUE(std::isnan(as_double));

  uint32_t* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), 64, cudaHostAllocDefault),
            cudaSuccess);
  EXPECT_EQ(pinned[15], 0x7fffdeadu);
  cudaFreeHost(pinned);

  float* out = DeviceAlloc<float>(32);
  for (int launch = 0; launch < 2; ++launch) {
    ASSERT_EQ(launch_kernel<uninitialized_shared_kernel>(1, 32, stream_, out), cudaSuccess);
    Sync();
    for (float v : Download(out, 32)) ASSERT_TRUE(std::isnan(v)) << v;
  }
}

TEST_F(EmulatorTest, StreamsWithoutAnEventInterleaveAndRaceAtRandom) {
  const int n = 4096;
  int* a = DeviceAlloc<int>(n);
  int* b = DeviceAlloc<int>(n);
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(a, 0, n * sizeof(int), stream_), cudaSuccess);
  Sync();
  int rounds_with_a_race = 0;
  for (int round = 1; round <= 8; ++round) {
    ASSERT_EQ(launch_kernel<fill_kernel>(n / 64, 64, stream_, a, n, round), cudaSuccess);
    ASSERT_EQ(launch_kernel<copy_kernel>(n / 64, 64, side, a, b, n), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    Sync();
    const std::vector<int> got = Download(b, n);
    rounds_with_a_race += std::count(got.begin(), got.end(), round) != n;
  }
  EXPECT_GT(rounds_with_a_race, 0);

  // Blocks of two kernels on two streams interleave.
  int* log = DeviceAlloc<int>(64);
  int* next = DeviceAlloc<int>(1);
  ASSERT_EQ(cudaMemsetAsync(next, 0, sizeof(int), stream_), cudaSuccess);
  Sync();
  ASSERT_EQ(launch_kernel<block_log_kernel>(32, 32, stream_, log, next, 0), cudaSuccess);
  ASSERT_EQ(launch_kernel<block_log_kernel>(32, 32, side, log, next, 1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  Sync();
  const std::vector<int> order = Download(log, 64);
  int switches = 0;
  for (size_t i = 1; i < order.size(); ++i) switches += order[i] != order[i - 1];
  EXPECT_GT(switches, 1);
  cudaStreamDestroy(side);
}

TEST_F(EmulatorTest, PageableCopiesStageTheSourceAndWaitForTheDestination) {
  int* d = DeviceAlloc<int>(4);
  std::vector<int> source = {1, 2, 3, 4};
  ASSERT_EQ(cudaMemcpyAsync(d, source.data(), 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  source.assign(4, -1);  // the copy was staged when the call returned
  std::vector<int> back(4, 0);
  ASSERT_EQ(cudaMemcpyAsync(back.data(), d, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  EXPECT_EQ(back, (std::vector<int>{1, 2, 3, 4}));  // done when the call returned
}

TEST_F(EmulatorTest, CopiesMustMatchTheirKindAndStayInsideTheirAllocations) {
  int* d = DeviceAlloc<int>(4);
  std::vector<int> host(8, 0);
  EXPECT_EQ(cudaMemcpyAsync(d, host.data(), 32, cudaMemcpyHostToDevice, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpyAsync(host.data(), host.data() + 4, 16, cudaMemcpyHostToDevice, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpyAsync(d, d, 16, cudaMemcpyHostToDevice, stream_), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemsetAsync(d + 2, 0, 16, stream_), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpyAsync(d, host.data(), 16, static_cast<cudaMemcpyKind>(7), stream_),
            cudaErrorInvalidMemcpyDirection);
  cudaGetLastError();
}

TEST_F(EmulatorTest, OnlyMappedPinnedMemoryHasADevicePointer) {
  void* unmapped = nullptr;
  ASSERT_EQ(cudaHostAlloc(&unmapped, 64, cudaHostAllocPortable), cudaSuccess);
  void* device = nullptr;
  EXPECT_EQ(cudaHostGetDevicePointer(&device, unmapped, 0), cudaErrorInvalidValue);
  std::vector<int> pageable(16);
  EXPECT_EQ(cudaHostGetDevicePointer(&device, pageable.data(), 0), cudaErrorInvalidValue);
  cudaFreeHost(unmapped);
  cudaGetLastError();
}

// cudaLaunchKernelEx's configuration: the programmatic attribute (and Ignore
// entries) launch; another attribute or dynamic shared memory is not emulated,
// a missing configuration or attribute list is invalid. Each refusal is also
// the thread's last error, and nothing runs.
TEST_F(EmulatorTest, LaunchExTakesTheProgrammaticAttributeAndRefusesWhatItDoesNotEmulate) {
  int* d = DeviceAlloc<int>(1);
  cudaLaunchAttribute attrs[3] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeIgnore;
  attrs[2].id = cudaLaunchAttributePriority;
  cudaLaunchConfig_t config = {};
  config.gridDim = 1;
  config.blockDim = 1;
  config.stream = stream_;
  config.attrs = attrs;
  config.numAttrs = 2;
  EXPECT_EQ(moegraph_emu::LaunchEx<store_kernel>(&config, d, 7), cudaSuccess);
  config.numAttrs = 3;
  EXPECT_EQ(moegraph_emu::LaunchEx<store_kernel>(&config, d, 8), cudaErrorNotSupported);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotSupported);
  config.numAttrs = 1;
  config.dynamicSmemBytes = 16;
  EXPECT_EQ(moegraph_emu::LaunchEx<store_kernel>(&config, d, 9), cudaErrorNotSupported);
  config.dynamicSmemBytes = 0;
  config.attrs = nullptr;
  EXPECT_EQ(moegraph_emu::LaunchEx<store_kernel>(&config, d, 10), cudaErrorInvalidValue);
  EXPECT_EQ(moegraph_emu::LaunchEx<store_kernel>(nullptr, d, 11), cudaErrorInvalidValue);
  cudaGetLastError();
  int value = 0;
  ASSERT_EQ(cudaMemcpy(&value, d, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(value, 7);
}

TEST_F(EmulatorTest, CaptureRefusesSynchronousCopiesTheDeviceAndTheLegacyStream) {
  int* d = DeviceAlloc<int>(4);
  std::vector<int> host(4);
  cudaGraph_t graph = nullptr;
  // stream_ is a blocking stream: the legacy stream may not touch its capture.
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), d, 16, cudaMemcpyDeviceToHost),
            cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(launch_kernel<store_kernel>(1, 1, nullptr, d, 1), cudaErrorStreamCaptureImplicit);
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);

  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeThreadLocal),
            cudaErrorStreamCaptureUnsupported);
  cudaGetLastError();
}

TEST_F(EmulatorTest, OnlyTheCapturingThreadOnItsOriginStreamEndsACapture) {
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaError_t from_other_thread = cudaSuccess;
  std::thread([&] { from_other_thread = cudaStreamEndCapture(stream_, &graph); }).join();
  EXPECT_EQ(from_other_thread, cudaErrorStreamCaptureWrongThread);
  ASSERT_EQ(cudaEventRecord(fork, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
  EXPECT_EQ(cudaStreamEndCapture(side, &graph), cudaErrorStreamCaptureUnmatched);
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);
  cudaEventDestroy(fork);
  cudaStreamDestroy(side);
  cudaGetLastError();
}

TEST_F(EmulatorTest, ADivergentBarrierIsAFault) {
  EXPECT_CHILD(
      {
        launch_kernel<divergent_barrier_kernel>(1, 64, stream_);
        std::exit(cudaStreamSynchronize(stream_) == cudaErrorLaunchFailure &&
                          cudaGetLastError() == cudaErrorLaunchFailure
                      ? 0
                      : 1);
      },
      "cudaErrorLaunchFailure: divergent_barrier_kernel block \\(0,0,0\\): divergent "
      "__syncthreads.*MOEGRAPH_EMU_SEED=");
}

TEST_F(EmulatorTest, ABarrierAfterAThreadExitedIsAFault) {
  EXPECT_CHILD(
      {
        launch_kernel<barrier_after_exit_kernel>(1, 64, stream_);
        std::exit(cudaStreamSynchronize(stream_) == cudaErrorLaunchFailure ? 0 : 1);
      },
      "__syncthreads at .*emulator_test.cc:[0-9]+ after 1 thread\\(s\\) of the block exited");
}

TEST_F(EmulatorTest, AShuffleWhoseMaskNamesAnExitedOrMissingLaneIsAFault) {
  EXPECT_CHILD(
      {
        float* out = DeviceAlloc<float>(32);
        launch_kernel<shuffle_after_exit_kernel>(1, 32, stream_, out);
        std::exit(cudaStreamSynchronize(stream_) == cudaErrorLaunchFailure ? 0 : 1);
      },
      "lane 5|thread \\(5,0,0\\) exited");
  EXPECT_CHILD(
      {
        float* out = DeviceAlloc<float>(48);
        launch_kernel<shuffle_in_partial_warp_kernel>(1, 48, stream_, out);
        std::exit(cudaStreamSynchronize(stream_) == cudaErrorLaunchFailure ? 0 : 1);
      },
      "the mask names lane 16, but the block has 48 threads");
}

TEST_F(EmulatorTest, AKernelGivenAHostPointerFaultsWithAnIllegalAddress) {
  EXPECT_CHILD(
      {
        int host_value = 0;
        launch_kernel<store_kernel>(1, 1, stream_, &host_value, 1);
        const bool faulted = cudaStreamSynchronize(stream_) == cudaErrorIllegalAddress;
        // The error is sticky: the context is lost, as on a device.
        void* p = nullptr;
        std::exit(faulted && cudaMalloc(&p, 16) == cudaErrorIllegalAddress && host_value == 0 ? 0
                                                                                              : 1);
      },
      "store_kernel: argument 0 \\(0x[0-9a-f]+\\) is not device memory or mapped pinned memory");
}

TEST_F(EmulatorTest, AGraphReplayedAfterItsMemoryWasFreedFaults) {
  EXPECT_CHILD(
      {
        int* target = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&target), sizeof(int));
        cudaStream_t capturing = nullptr;
        cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        cudaStreamBeginCapture(capturing, cudaStreamCaptureModeThreadLocal);
        launch_kernel<store_kernel>(1, 1, capturing, target, 1);
        const bool captured = cudaStreamEndCapture(capturing, &graph) == cudaSuccess &&
                              cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
                              cudaGraphLaunch(exec, capturing) == cudaSuccess &&
                              cudaStreamSynchronize(capturing) == cudaSuccess;
        cudaFree(target);
        cudaGraphLaunch(exec, capturing);
        std::exit(captured && cudaStreamSynchronize(capturing) == cudaErrorIllegalAddress ? 0 : 1);
      },
      "cudaErrorIllegalAddress: store_kernel: argument 0 .* is not device memory");
}

TEST_F(EmulatorTest, AKernelReadingPastItsAllocationIsCaughtByAddressSanitizer) {
  int* in = DeviceAlloc<int>(10);
  int* out = DeviceAlloc<int>(1);
  EXPECT_DEATH(
      {
        launch_kernel<read_past_kernel>(1, 1, stream_, in, 10, out);
        cudaStreamSynchronize(stream_);
      },
      "heap-buffer-overflow");
}

// No fixture: the child must make its first CUDA call after setenv.
TEST(EmulatorEnvironmentTest, ABadSeedOrMemorySizeFailsEveryCallNamingTheVariable) {
  EXPECT_CHILD(
      {
        setenv("MOEGRAPH_EMU_SEED", "twelve", 1);
        int count = 0;
        std::exit(cudaGetDeviceCount(&count) == cudaErrorInitializationError ? 0 : 1);
      },
      "MOEGRAPH_EMU_SEED='twelve' is not an unsigned integer");
  EXPECT_CHILD(
      {
        setenv("MOEGRAPH_EMU_DEVICE_MEMORY", "8X", 1);
        int count = 0;
        std::exit(cudaGetDeviceCount(&count) == cudaErrorInitializationError ? 0 : 1);
      },
      "MOEGRAPH_EMU_DEVICE_MEMORY='8X' is not a size");
}

TEST(EmulatorEnvironmentTest, TheDeviceMemorySizeComesFromTheEnvironment) {
  EXPECT_CHILD(
      {
        setenv("MOEGRAPH_EMU_DEVICE_MEMORY", "64M", 1);
        size_t free = 0;
        size_t total = 0;
        void* p = nullptr;
        const bool ok = cudaMemGetInfo(&free, &total) == cudaSuccess && total == (64u << 20) &&
                        cudaMalloc(&p, 65u << 20) == cudaErrorMemoryAllocation;
        std::fprintf(stderr, "total %zu\n", total);
        std::exit(ok ? 0 : 1);
      },
      "total 67108864");
}

}  // namespace
}  // namespace moegraph
