// The miss path's copy on the GPU, two ways, for the same bytes: k expert blocks
// of one layer, from pinned mapped host memory (as the CUDA engine allocates its
// expert store) into k device slots.
// - BM_Copy/stage_copy_kernel: launch_stage_copy (kernels/moe.cu), the SM-driven
//   copy of the graph and stage arms: CTAs load 16-byte chunks over PCIe and
//   store them into the slots.
// - BM_Copy/cuda_memcpy_async: one cudaMemcpyAsync H2D per block on the copy
//   engines, as the host-readback arm issues them.
// Arguments: blocks, bytes per block.
// Each iteration is timed with CUDA events around the copy alone, so
// bytes_per_second is bytes / event time (tools/device-check.sh prints it as
// 1e9 bytes per second; the console shows GiB/s). Sizes: 8 blocks of a
// Qwen3-30B-A3B q4_K expert (a top-8 layer that misses everything, 20.25 MiB)
// and 8 blocks of 8 MiB (64 MiB). Without a device every benchmark is skipped
// with "no CUDA device" and the program exits 0.
#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace moegraph {
namespace {

// One Qwen3-30B-A3B expert in q4_K: gate and up are 768 rows of 2048 values,
// down 2048 rows of 768; a q4_K block holds 256 values in 144 bytes.
constexpr int64_t kQwen3ExpertBytes = 3 * 768 * (2048 / 256) * 144;
constexpr int64_t kEightMib = 8 << 20;
constexpr int64_t kTopK = 8;

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// The buffers of one benchmark: k blocks of pinned mapped host memory (filled
// with a pattern), k device slots, and the stage copy's device-side arguments
// (rank r is expert r, missed, and goes to slot r).
class CopyBuffers {
 public:
  CopyBuffers() = default;
  CopyBuffers(const CopyBuffers&) = delete;
  CopyBuffers& operator=(const CopyBuffers&) = delete;
  ~CopyBuffers() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaFree(slots_);
    cudaFree(ranks_);
    cudaFree(missed_);
    cudaFree(tickets_);
    cudaFree(counters_);
    if (host_ != nullptr) cudaFreeHost(host_);
  }

  // Empty on success, else the call that failed and its error.
  std::string Init(int32_t k, size_t block_bytes) {
    k_ = k;
    layout_.block_bytes = block_bytes;
    bytes_ = static_cast<size_t>(k) * block_bytes;
    std::string error;
    auto ok = [&error](cudaError_t err, const char* what) {
      error = Check(err, what);
      return error.empty();
    };
    void* mapped = nullptr;
    if (!ok(cudaHostAlloc(reinterpret_cast<void**>(&host_), bytes_,
                          cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc") ||
        !ok(cudaHostGetDevicePointer(&mapped, host_, 0), "cudaHostGetDevicePointer") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&slots_), bytes_), "cudaMalloc of the slots") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&ranks_), 2 * k * sizeof(int32_t)),
            "cudaMalloc of the ranks") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&missed_), k), "cudaMalloc of the miss flags") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&tickets_), k * sizeof(unsigned int)),
            "cudaMalloc of the copy's tickets") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&counters_), sizeof(DeviceCounters)),
            "cudaMalloc of the counters") ||
        !ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate") ||
        !ok(cudaEventCreate(&start_), "cudaEventCreate") ||
        !ok(cudaEventCreate(&stop_), "cudaEventCreate")) {
      return error;
    }
    host_mapped_ = static_cast<const uint8_t*>(mapped);
    for (size_t i = 0; i < bytes_; ++i) host_[i] = static_cast<uint8_t>(i * 131 + i / 4096);
    std::vector<int32_t> ranks(2 * static_cast<size_t>(k));
    for (int32_t r = 0; r < k; ++r) {
      ranks[r] = r;      // experts
      ranks[k + r] = r;  // slot_of_rank
    }
    const std::vector<uint8_t> missed(static_cast<size_t>(k), 1);
    // On the benchmark's stream and waited for: a non-blocking stream is not
    // ordered after work on the legacy default stream. The slots start as zeros,
    // so the first copy's check cannot pass on bytes a previous run left.
    if (!ok(cudaMemcpyAsync(ranks_, ranks.data(), ranks.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice, stream_),
            "uploading the ranks") ||
        !ok(cudaMemcpyAsync(missed_, missed.data(), missed.size(), cudaMemcpyHostToDevice, stream_),
            "uploading the miss flags") ||
        !ok(cudaMemsetAsync(tickets_, 0, k * sizeof(unsigned int), stream_),
            "clearing the copy's tickets") ||
        !ok(cudaMemsetAsync(counters_, 0, sizeof(DeviceCounters), stream_),
            "clearing the counters") ||
        !ok(cudaMemsetAsync(slots_, 0, bytes_, stream_), "clearing the slots")) {
      return error;
    }
    return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  cudaError_t StageCopy() {
    return launch_stage_copy(host_mapped_, layout_, ranks_, ranks_ + k_, missed_, k_, slots_,
                             tickets_, counters_, stream_);
  }

  cudaError_t MemcpyAsync() {
    for (int32_t r = 0; r < k_; ++r) {
      const size_t offset = static_cast<size_t>(r) * layout_.block_bytes;
      const cudaError_t err = cudaMemcpyAsync(slots_ + offset, host_ + offset, layout_.block_bytes,
                                              cudaMemcpyHostToDevice, stream_);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }

  // Empty when the slots hold the host bytes.
  std::string Verify() {
    std::vector<uint8_t> back(bytes_);
    if (std::string e = Check(cudaMemcpy(back.data(), slots_, bytes_, cudaMemcpyDeviceToHost),
                              "reading the slots back");
        !e.empty()) {
      return e;
    }
    if (std::memcmp(back.data(), host_, bytes_) != 0) return "the slots differ from the host bytes";
    return "";
  }

  // Runs copy between two events; its time in seconds, or a negative value
  // and *error set.
  template <typename Copy>
  double Timed(Copy copy, std::string* error) {
    cudaError_t err = cudaEventRecord(start_, stream_);
    if (err == cudaSuccess) err = copy();
    if (err == cudaSuccess) err = cudaEventRecord(stop_, stream_);
    if (err == cudaSuccess) err = cudaEventSynchronize(stop_);
    float ms = 0;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start_, stop_);
    *error = Check(err, "the timed copy");
    return error->empty() ? ms * 1e-3 : -1.0;
  }

  size_t bytes() const { return bytes_; }

 private:
  static std::string Check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return "";
    return std::string(what) + ": " + cudaGetErrorString(err);
  }

  int32_t k_ = 0;
  size_t bytes_ = 0;
  DeviceBlockLayout layout_{};
  uint8_t* host_ = nullptr;
  const uint8_t* host_mapped_ = nullptr;
  uint8_t* slots_ = nullptr;
  int32_t* ranks_ = nullptr;  // experts[k], then slot_of_rank[k]
  uint8_t* missed_ = nullptr;
  unsigned int* tickets_ = nullptr;  // the stage copy's, [k]
  DeviceCounters* counters_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

enum class CopyPath { kStageCopyKernel, kCudaMemcpyAsync };

// state.range(0) blocks of state.range(1) bytes.
void BM_Copy(benchmark::State& state, CopyPath path) {
  if (!HaveDevice()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  CopyBuffers buffers;
  if (std::string e = buffers.Init(static_cast<int32_t>(state.range(0)), state.range(1));
      !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  auto copy = [&] {
    return path == CopyPath::kStageCopyKernel ? buffers.StageCopy() : buffers.MemcpyAsync();
  };
  // An untimed first copy, checked byte for byte.
  std::string error;
  if (buffers.Timed(copy, &error) < 0 || !(error = buffers.Verify()).empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  for (auto _ : state) {
    const double seconds = buffers.Timed(copy, &error);
    if (seconds < 0) {
      state.SkipWithError(error.c_str());
      break;
    }
    state.SetIterationTime(seconds);
  }
  if (!error.empty()) return;
  // Divided by the manual (event) time: bytes_per_second is the copy's rate.
  state.SetBytesProcessed(static_cast<int64_t>(buffers.bytes()) * state.iterations());
}

void CopySizes(benchmark::internal::Benchmark* b) {
  b->Args({kTopK, kQwen3ExpertBytes})->Args({kTopK, kEightMib})->UseManualTime();
}

BENCHMARK_CAPTURE(BM_Copy, stage_copy_kernel, CopyPath::kStageCopyKernel)->Apply(CopySizes);
BENCHMARK_CAPTURE(BM_Copy, cuda_memcpy_async, CopyPath::kCudaMemcpyAsync)->Apply(CopySizes);

}  // namespace
}  // namespace moegraph
