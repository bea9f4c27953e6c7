// What a GPU and the CPU emulator (docs/EMULATOR.md) must both do with the CUDA
// features the engine uses: warp shuffles, barriers, atomics, mapped pinned
// memory, streams ordered by events, a capture with a fork and a join replayed
// as a graph, capture's refusals, and launch limits, with CUDA's error codes.
// The Release tree compiles it with nvcc (without a device every test skips);
// the emulated tree compiles the same file against the emulator, so a device run
// checks the emulator against the hardware.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "loader/quant.h"

#include "kernels/launch.cuh"
#include "tests/cuda_test_util.h"
#include "tests/test_kernels.cuh"

namespace moegraph {
namespace {

using testing_util::copy_kernel;
using testing_util::fill_kernel;

constexpr unsigned kFullMask = 0xffffffffu;

__global__ void warp_sum_kernel(const float* in, float* out) {
  float v = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  out[threadIdx.x] = v;
}

__global__ void dp4a_kernel(const int* a, const int* b, const int* c, int* out) {
  out[threadIdx.x] = __dp4a(a[threadIdx.x], b[threadIdx.x], c[threadIdx.x]);
}

// Each thread writes its slot; after the barrier each reads its mirror's.
__global__ void mirror_kernel(int* out) {
  __shared__ int slots[256];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x * 3 + blockIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slots[blockDim.x - 1 - threadIdx.x];
}

__global__ void add_kernel(unsigned long long* counter, unsigned long long value) {
  atomicAdd(counter, value);
}

__global__ void sum_kernel(const int* values, int n, unsigned long long* out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) atomicAdd(out, static_cast<unsigned long long>(values[i]));
}

// Launched programmatically after a producer: waits for it (griddepcontrol.wait)
// before reading what it wrote.
__global__ void dependent_copy_kernel(const int* in, int* out, int n) {
  wait_for_prior_grids();
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i] + 1;
}

class CudaConformanceTest : public testing_util::CudaStreamTest {
 protected:
  void SetUp() override {
    CudaStreamTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(unsigned long long)),
              cudaSuccess);
  }
  void TearDown() override {
    if (counter_ != nullptr) cudaFree(counter_);
    if (fork_ != nullptr) cudaEventDestroy(fork_);
    if (join_ != nullptr) cudaEventDestroy(join_);
    if (side_ != nullptr) cudaStreamDestroy(side_);
    CudaStreamTest::TearDown();
  }

  unsigned long long Counter() {
    unsigned long long value = 0;
    EXPECT_EQ(cudaMemcpy(&value, counter_, sizeof(value), cudaMemcpyDeviceToHost), cudaSuccess);
    return value;
  }

  // A capture of stream_ that forks side_ and, when joined, joins it back.
  cudaError_t CaptureForkJoin(bool joined, cudaGraph_t* graph) {
    EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_EQ(launch_kernel<add_kernel>(1, 1, stream_, counter_, 1ull), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(fork_, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamWaitEvent(side_, fork_, 0), cudaSuccess);
    EXPECT_EQ(launch_kernel<add_kernel>(1, 32, side_, counter_, 10ull), cudaSuccess);
    if (joined) {
      EXPECT_EQ(cudaEventRecord(join_, side_), cudaSuccess);
      EXPECT_EQ(cudaStreamWaitEvent(stream_, join_, 0), cudaSuccess);
    }
    EXPECT_EQ(launch_kernel<add_kernel>(2, 64, stream_, counter_, 100ull), cudaSuccess);
    return cudaStreamEndCapture(stream_, graph);
  }

  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
  unsigned long long* counter_ = nullptr;
};

TEST_F(CudaConformanceTest, AWarpShuffleButterflySumsAll32Lanes) {
  std::vector<float> in(64);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 32 + 1 + (i / 32) * 100);
  float* d_in = nullptr;
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_in), 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_out), 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_in, in.data(), 64 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(launch_kernel<warp_sum_kernel>(1, 64, stream_, d_in, d_out), cudaSuccess);
  Sync();
  std::vector<float> out(64);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, 64 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(out[static_cast<size_t>(i)], i < 32 ? 528.0f : 3728.0f) << "lane " << i;
  }
  cudaFree(d_in);
  cudaFree(d_out);
}

// The signed byte products of __dp4a (the quantized matvecs' inner step), at
// the extremes of a signed byte and with an accumulator that wraps.
TEST_F(CudaConformanceTest, Dp4aAddsTheProductsOfSignedBytes) {
  const std::vector<int> a = {0x01FF7F80, static_cast<int>(0x80808080u), 0x7F7F7F7F, 0x01020304,
                              -1,         0x0F0F0F0F, 0x00000000, static_cast<int>(0x807F01FFu)};
  const std::vector<int> b = {0x02030405, static_cast<int>(0x80808080u), 0x7F7F7F7F, 0x01010101,
                              -1,         0x10203040, 0x12345678, static_cast<int>(0xFF01807Fu)};
  const std::vector<int> c = {10, 0, -5, 7, 0, 2147483000, -1, 100};
  std::vector<int> expected(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t sum = c[i];
    for (int byte = 0; byte < 4; ++byte) {
      sum += static_cast<int8_t>(static_cast<uint32_t>(a[i]) >> (8 * byte)) *
             static_cast<int8_t>(static_cast<uint32_t>(b[i]) >> (8 * byte));
    }
    expected[i] = static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(sum)));
  }
  int *d_a, *d_b, *d_c, *d_out;
  for (int** p : {&d_a, &d_b, &d_c, &d_out}) {
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(p), a.size() * sizeof(int)), cudaSuccess);
  }
  ASSERT_EQ(cudaMemcpy(d_a, a.data(), a.size() * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_b, b.data(), b.size() * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_c, c.data(), c.size() * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(launch_kernel<dp4a_kernel>(1, static_cast<int>(a.size()), stream_, d_a, d_b, d_c,
                                       d_out),
            cudaSuccess);
  Sync();
  std::vector<int> out(a.size());
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(out, expected);
  for (int* p : {d_a, d_b, d_c, d_out}) cudaFree(p);
}

TEST_F(CudaConformanceTest, ABarrierPublishesSharedMemoryToTheBlock) {
  const int blocks = 4, threads = 256;
  int* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_out), blocks * threads * sizeof(int)),
            cudaSuccess);
  ASSERT_EQ(launch_kernel<mirror_kernel>(blocks, threads, stream_, d_out), cudaSuccess);
  Sync();
  std::vector<int> out(blocks * threads);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      ASSERT_EQ(out[static_cast<size_t>(b * threads + t)], (threads - 1 - t) * 3 + b)
          << "block " << b << " thread " << t;
    }
  }
  cudaFree(d_out);
}

TEST_F(CudaConformanceTest, EveryThreadsAtomicAddCounts) {
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), stream_), cudaSuccess);
  ASSERT_EQ(launch_kernel<add_kernel>(dim3(4, 2), dim3(32, 4), stream_, counter_, 3ull),
            cudaSuccess);
  Sync();
  EXPECT_EQ(Counter(), 8ull * 128 * 3);
}

TEST_F(CudaConformanceTest, AKernelReadsMappedPinnedMemoryThroughItsDevicePointer) {
  const int n = 1000;
  int* host = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), n * sizeof(int),
                          cudaHostAllocMapped | cudaHostAllocPortable),
            cudaSuccess);
  unsigned long long want = 0;
  for (int i = 0; i < n; ++i) {
    host[i] = i * 7 - 3;
    want += static_cast<unsigned long long>(host[i]);
  }
  int* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), host, 0), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), stream_), cudaSuccess);
  ASSERT_EQ(launch_kernel<sum_kernel>((n + 255) / 256, 256, stream_, mapped, n, counter_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(Counter(), want);
  cudaFreeHost(host);
}

// side_ copies what stream_ wrote, ordered only by the event.
TEST_F(CudaConformanceTest, AStreamThatWaitsOnAnEventSeesTheWorkBeforeIt) {
  const int n = 3000;
  int* d_a = nullptr;
  int* d_b = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_a), n * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_b), n * sizeof(int)), cudaSuccess);
  for (int round = 0; round < 6; ++round) {
    ASSERT_EQ(launch_kernel<fill_kernel>((n + 255) / 256, 256, stream_, d_a, n, round + 1),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork_, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side_, fork_, 0), cudaSuccess);
    ASSERT_EQ(launch_kernel<copy_kernel>((n + 127) / 128, 128, side_, d_a, d_b, n), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
    std::vector<int> out(n);
    ASSERT_EQ(cudaMemcpy(out.data(), d_b, n * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < n; ++i) ASSERT_EQ(out[static_cast<size_t>(i)], round + 1) << i;
  }
  cudaFree(d_a);
  cudaFree(d_b);
}

TEST_F(CudaConformanceTest, ACaptureWithAForkAndAJoinReplaysItsLaunchesEachTime) {
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(CaptureForkJoin(true, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Capture only recorded: the counter is still what the memset leaves.
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), stream_), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  Sync();
  EXPECT_EQ(Counter(), 3ull * (1 + 32 * 10 + 128 * 100));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// The engine's copy stream takes the greatest priority and its graphs launch
// with the priorities captured from their streams.
TEST_F(CudaConformanceTest, AStreamKeepsItsClampedPriorityAndAGraphUsesNodePriorities) {
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  EXPECT_LT(greatest, least);  // a smaller number is a higher priority
  cudaStream_t high = nullptr, past = nullptr;
  ASSERT_EQ(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, greatest), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithPriority(&past, cudaStreamNonBlocking, greatest - 10),
            cudaSuccess);
  int priority = 0;
  ASSERT_EQ(cudaStreamGetPriority(high, &priority), cudaSuccess);
  EXPECT_EQ(priority, greatest);
  ASSERT_EQ(cudaStreamGetPriority(past, &priority), cudaSuccess);
  EXPECT_EQ(priority, greatest);  // clamped to the range
  EXPECT_EQ(cudaStreamDestroy(past), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(high), cudaSuccess);

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(CaptureForkJoin(true, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), stream_), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  Sync();
  EXPECT_EQ(Counter(), 1ull + 32 * 10 + 128 * 100);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// A chain of programmatic launches (MOEGRAPH_PDL), each waiting for the one
// before it: in a stream and in a captured graph every kernel sees its
// predecessor's writes, and the scope counts the launches it made so.
TEST_F(CudaConformanceTest, AProgrammaticLaunchSeesTheWritesOfTheKernelBeforeIt) {
  constexpr int n = 1 << 16;
  int *a = nullptr, *b = nullptr, *c = nullptr;
  for (int** p : {&a, &b, &c}) {
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(p), n * sizeof(int)), cudaSuccess);
  }
  auto chain = [&](int round) {
    EXPECT_EQ(launch_kernel<fill_kernel>(n / 256, 256, stream_, a, n, round), cudaSuccess);
    EXPECT_EQ(launch_kernel<dependent_copy_kernel>(n / 256, 256, stream_, a, b, n), cudaSuccess);
    EXPECT_EQ(launch_kernel<dependent_copy_kernel>(n / 256, 256, stream_, b, c, n), cudaSuccess);
  };
  auto download = [&] {
    std::vector<int> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), c, n * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  };
  uint64_t programmatic = 0;
  {
    const ProgrammaticLaunchScope scope(&programmatic);
    for (int round = 0; round < 3; ++round) {
      chain(round * 10);
      Sync();
      EXPECT_EQ(download(), std::vector<int>(n, round * 10 + 2));
    }
    EXPECT_EQ(launch_kernel<add_kernel>(1, 1025, stream_, counter_, 1ull),
              cudaErrorInvalidConfiguration);  // refused, not counted
  }
  EXPECT_EQ(programmatic, 9u);

  cudaGraph_t graph = nullptr;
  {
    const ProgrammaticLaunchScope scope(&programmatic);
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    chain(100);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  }
  EXPECT_EQ(programmatic, 12u);  // captured launches count once, replays do not
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority),
            cudaSuccess);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(launch_kernel<fill_kernel>(n / 256, 256, stream_, c, n, -1), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    Sync();
    EXPECT_EQ(download(), std::vector<int>(n, 102));
  }
  EXPECT_EQ(programmatic, 12u);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  for (int* p : {a, b, c}) cudaFree(p);
}

TEST_F(CudaConformanceTest, EndingACaptureWhoseForkNeverJoinedFails) {
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(CaptureForkJoin(false, &graph), cudaErrorStreamCaptureUnjoined);
  EXPECT_EQ(graph, nullptr);
  cudaGetLastError();
  // Both streams left capture mode and run work again.
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), side_), cudaSuccess);
  ASSERT_EQ(launch_kernel<add_kernel>(1, 1, side_, counter_, 5ull), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
  EXPECT_EQ(Counter(), 5ull);
}

TEST_F(CudaConformanceTest, SynchronizingACapturingStreamInvalidatesTheCapture) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(launch_kernel<add_kernel>(1, 1, stream_, counter_, 1ull), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorStreamCaptureUnsupported);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  cudaGetLastError();
}

TEST_F(CudaConformanceTest, AllocatingDuringAThreadLocalCaptureInvalidatesIt) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 256), cudaErrorStreamCaptureUnsupported);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  cudaGetLastError();
}

TEST_F(CudaConformanceTest, ACapturingStreamCannotWaitOnUncapturedWork) {
  ASSERT_EQ(launch_kernel<add_kernel>(1, 1, side_, counter_, 1ull), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(join_, side_), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(stream_, join_, 0), cudaErrorStreamCaptureIsolation);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
  cudaGetLastError();
}

TEST_F(CudaConformanceTest, AnEventRecordedInACaptureCannotBeWaitedOnByTheHost) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(launch_kernel<add_kernel>(1, 1, stream_, counter_, 1ull), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(fork_, stream_), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(fork_), cudaErrorCapturedEvent);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
}

TEST_F(CudaConformanceTest, LaunchesBeyondTheLimitsAreInvalidConfigurations) {
  EXPECT_EQ(launch_kernel<add_kernel>(1, 1025, stream_, counter_, 1ull),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(launch_kernel<add_kernel>(1, dim3(32, 32, 2), stream_, counter_, 1ull),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(launch_kernel<add_kernel>(1, dim3(1, 1, 65), stream_, counter_, 1ull),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(launch_kernel<add_kernel>(dim3(1, 65536), 32, stream_, counter_, 1ull),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(launch_kernel<add_kernel>(dim3(0), 32, stream_, counter_, 1ull),
            cudaErrorInvalidConfiguration);
  // The limits themselves launch, and the errors above are not left behind.
  ASSERT_EQ(cudaMemsetAsync(counter_, 0, sizeof(unsigned long long), stream_), cudaSuccess);
  EXPECT_EQ(launch_kernel<add_kernel>(dim3(1, 65535), 1, stream_, counter_, 1ull), cudaSuccess);
  EXPECT_EQ(launch_kernel<add_kernel>(1, 1024, stream_, counter_, 1ull), cudaSuccess);
  Sync();
  EXPECT_EQ(Counter(), 65535ull + 1024);
}

// ---- cuBLASLt: the prefill's GEMMs ----

// D (m x n, column-major: a token per column) = alpha op(A) B + beta C, with A
// the weights as the file stores them (m rows of k, so column-major k x m,
// op T) and B the tokens' activations (k per token). Values are multiples of
// 1/8 in [-2, 2], so every product and sum is exact in f32 and any order of
// summation gives the same bits.
class CublasLtTest : public CudaConformanceTest {
 protected:
  static constexpr int m = 64, n = 8, k = 256;

  void SetUp() override {
    CudaConformanceTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cublasLtCreate(&handle_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref_), CUBLAS_STATUS_SUCCESS);
    const uint64_t workspace = 0;
    ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &workspace, sizeof(workspace)),
              CUBLAS_STATUS_SUCCESS);
    for (int i = 0; i < m * k; ++i) weights_.push_back(static_cast<float>(i * 7 % 33 - 16) / 8);
    for (int i = 0; i < k * n; ++i) tokens_.push_back(static_cast<float>(i * 5 % 29 - 14) / 8);
  }
  void TearDown() override {
    if (pref_ != nullptr) cublasLtMatmulPreferenceDestroy(pref_);
    if (handle_ != nullptr) cublasLtDestroy(handle_);
    for (void* p : allocations_) cudaFree(p);
    CudaConformanceTest::TearDown();
  }

  // values on the device as type (exact: they are multiples of 1/8 under 2).
  void* Upload(const std::vector<float>& values, cudaDataType type) {
    const size_t bytes = values.size() * (type == CUDA_R_32F ? 4 : 2);
    std::vector<uint8_t> host(bytes);
    for (size_t i = 0; i < values.size(); ++i) {
      if (type == CUDA_R_32F) {
        std::memcpy(host.data() + 4 * i, &values[i], 4);
      } else {
        const uint16_t h = type == CUDA_R_16F ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
        std::memcpy(host.data() + 2 * i, &h, 2);
      }
    }
    void* device = nullptr;
    EXPECT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
    allocations_.push_back(device);
    EXPECT_EQ(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return device;
  }

  // W x for every token, in double (exact here).
  std::vector<float> Expected() const {
    std::vector<float> out(m * n);
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double acc = 0;
        for (int p = 0; p < k; ++p) acc += double{weights_[i * k + p]} * tokens_[j * k + p];
        out[j * m + i] = static_cast<float>(acc);
      }
    }
    return out;
  }

  // The matmul's descriptors, the heuristic's first algorithm, then the matmul.
  cublasStatus_t Matmul(cudaDataType ab, cudaDataType cd, const void* a, const void* b, void* d,
                        float beta, int64_t ldd = m, int b_type = -1, int* algos = nullptr) {
    // b_type -1: B of A's type.
    const cudaDataType bt = b_type < 0 ? ab : static_cast<cudaDataType>(b_type);
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasStatus_t status = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const int32_t trans = CUBLAS_OP_T;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans,
                                              sizeof(trans));
    }
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&la, ab, k, m, k);
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&lb, bt, k, n, k);
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&lc, cd, m, n, ldd);
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulAlgoGetHeuristic(handle_, desc, la, lb, lc, lc, pref_, 1, &result,
                                              &found);
    }
    if (algos != nullptr) *algos = found;
    const float alpha = 1.0f;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmul(handle_, desc, &alpha, a, la, b, lb, &beta, d, lc, d, lc,
                              found > 0 ? &result.algo : nullptr, nullptr, 0, stream_);
    }
    for (cublasLtMatrixLayout_t l : {la, lb, lc}) {
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    }
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    return status;
  }

  std::vector<float> Download(const void* d, cudaDataType cd) {
    std::vector<float> out(m * n);
    if (cd == CUDA_R_32F) {
      EXPECT_EQ(cudaMemcpy(out.data(), d, out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      return out;
    }
    std::vector<uint16_t> half(m * n);
    EXPECT_EQ(cudaMemcpy(half.data(), d, half.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < half.size(); ++i) {
      out[i] = cd == CUDA_R_16F ? f16_to_f32(half[i]) : bf16_to_f32(half[i]);
    }
    return out;
  }

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  std::vector<float> weights_, tokens_;
  std::vector<void*> allocations_;
};

TEST_F(CublasLtTest, TheWeightsTimesEveryTokenEqualTheHostProductInEveryType) {
  const std::vector<float> expected = Expected();
  for (cudaDataType ab : {CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F}) {
    for (cudaDataType cd : {CUDA_R_32F, ab}) {
      SCOPED_TRACE("types " + std::to_string(ab) + " -> " + std::to_string(cd));
      const void* a = Upload(weights_, ab);
      const void* b = Upload(tokens_, ab);
      void* d = Upload(std::vector<float>(m * n, 0.0f), cd);
      int algos = 0;
      ASSERT_EQ(Matmul(ab, cd, a, b, d, 0.0f, m, -1, &algos), CUBLAS_STATUS_SUCCESS);
      EXPECT_GE(algos, 1);
      Sync();
      std::vector<float> want = expected;
      if (cd == CUDA_R_16F) {
        for (float& v : want) v = f16_to_f32(f32_to_f16(v));
      } else if (cd == CUDA_R_16BF) {
        for (float& v : want) v = bf16_to_f32(f32_to_bf16(v));
      }
      EXPECT_EQ(Download(d, cd), want);
    }
  }
}

// beta 1 with C = D: the product added to what D held; captured in a graph,
// each replay adds it again.
TEST_F(CublasLtTest, BetaOneAccumulatesAndACapturedMatmulReplays) {
  const void* a = Upload(weights_, CUDA_R_16F);
  const void* b = Upload(tokens_, CUDA_R_16F);
  std::vector<float> start(m * n);
  for (int i = 0; i < m * n; ++i) start[i] = static_cast<float>(i % 5);
  void* d = Upload(start, CUDA_R_32F);
  ASSERT_EQ(Matmul(CUDA_R_16F, CUDA_R_32F, a, b, d, 1.0f), CUBLAS_STATUS_SUCCESS);
  Sync();
  const std::vector<float> product = Expected();
  std::vector<float> want = start;
  for (int i = 0; i < m * n; ++i) want[i] += product[i];
  EXPECT_EQ(Download(d, CUDA_R_32F), want);

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(Matmul(CUDA_R_16F, CUDA_R_32F, a, b, d, 1.0f), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    Sync();
    for (int i = 0; i < m * n; ++i) want[i] += product[i];
    EXPECT_EQ(Download(d, CUDA_R_32F), want);
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// A and B of different types have no algorithm; D's leading dimension under
// its rows is invalid; a null handle is not initialized.
TEST_F(CublasLtTest, MixedTypesAShortLeadingDimensionAndNoHandleAreRefused) {
  const void* a = Upload(weights_, CUDA_R_16F);
  const void* b = Upload(tokens_, CUDA_R_32F);
  void* d = Upload(std::vector<float>(m * n, 0.0f), CUDA_R_32F);
  int algos = -1;
  EXPECT_EQ(Matmul(CUDA_R_16F, CUDA_R_32F, a, b, d, 0.0f, m, CUDA_R_32F, &algos),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(algos, 0);
  b = Upload(tokens_, CUDA_R_16F);
  EXPECT_EQ(Matmul(CUDA_R_16F, CUDA_R_32F, a, b, d, 0.0f, m - 1), CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatmulDesc_t desc = nullptr;
  ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayout_t l = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 4, 4, 4), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(nullptr, desc, l, l, l, l, pref_, 1, &result, &found),
            CUBLAS_STATUS_NOT_INITIALIZED);
  cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(desc);
}

}  // namespace
}  // namespace moegraph
