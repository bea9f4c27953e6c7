// GPU dequantization of ggml blocks to f32 or f16, with the same per-block code
// as the CPU (loader/quant.h), so both produce the same floats bit for bit.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "loader/ggml_type.h"

namespace moegraph {

// Dequantizes n elements of type (f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K)
// from device memory src to device memory dst on stream. Returns
// cudaErrorInvalidValue for another type or n not a multiple of the block size,
// otherwise the launch's error.
cudaError_t launch_dequantize(GgmlType type, const void* src, float* dst, int64_t n,
                              cudaStream_t stream);

// The same, each float rounded to f16 (f32_to_f16): the prefill's GEMM weights.
cudaError_t launch_dequantize_f16(GgmlType type, const void* src, uint16_t* dst, int64_t n,
                                  cudaStream_t stream);

}  // namespace moegraph
