// What the harnesses that call a launcher share (chain_harness.cu,
// qkv_harness.cu; each includes kernels/matvec.cu first): gpusim's missing
// cudaLaunchKernelExC, random weights of a type, and the output hash.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/kernels.h"
#include "loader/ggml_type.h"
#include "loader/quantize.h"
#include "tools/gpusim-epilogue/transfer.h"

// gpusim's cudart has no cudaLaunchKernelExC, which launch_kernel's
// cudaLaunchKernelEx calls: the launch <<<>>> makes instead (its configuration
// pushed, then cudaLaunchKernel), without the attributes (none are set outside
// a ProgrammaticLaunchScope; sm_86 has no PDL).
extern "C" cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func,
                                           void** args) {
  __cudaPushCallConfiguration(config->gridDim, config->blockDim, config->dynamicSmemBytes,
                              config->stream);
  return cudaLaunchKernel(func, config->gridDim, config->blockDim, args,
                          config->dynamicSmemBytes, config->stream);
}

namespace moegraph {

inline std::vector<float> Gaussian(std::mt19937& rng, int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = dist(rng);
  return v;
}

// rows x cols of type, quantized from N(0, 0.5) values, on the device.
inline DeviceMatrix Matrix(std::mt19937& rng, GgmlType type, int32_t rows, int32_t cols) {
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> bytes(static_cast<size_t>(rows) * row_bytes);
  for (int32_t r = 0; r < rows; ++r) {
    const std::vector<float> values = Gaussian(rng, cols, 0.5f);
    quantize_row(type, values.data(), bytes.data() + r * row_bytes, cols);
  }
  return {Upload(bytes), type, cols, rows, row_bytes};
}

// FNV-1a over the bytes of every output mixed in.
struct OutputHash {
  uint64_t value = 14695981039346656037ull;
  template <typename T>
  void Mix(const std::vector<T>& values) {
    const uint8_t* byte = reinterpret_cast<const uint8_t*>(values.data());
    for (size_t i = 0; i < values.size() * sizeof(T); ++i) value = (value ^ byte[i]) * 1099511628211ull;
  }
};

}  // namespace moegraph
