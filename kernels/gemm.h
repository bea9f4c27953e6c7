// The prefill's matrix products through cuBLASLt (issue 20): for T tokens,
// Y[t][r] = sum_c W[r][c] X[t][c] (or Y += it), W and X as f16, as ggml-cuda
// runs a quantized weight (ggml_cuda_mul_mat_cublas: both operands converted to
// f16 on hardware with fast f16), the sum and Y in f32 (CUBLAS_COMPUTE_32F).
// W, row-major rows x cols as the file stores it, is column-major cols x rows:
// A with op T; X (cols per token) is column-major cols x T; Y rows x T.
// Host code; the emulated tree links emulator/include/cublasLt.h's subset.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moegraph {

class GemmRunner {
 public:
  GemmRunner() = default;
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // The library's handle and a preference for algorithms without workspace.
  cublasStatus_t Init();

  // Y (f32, tokens x rows) = W (f16, rows x cols) X (f16, tokens x cols), or
  // Y += W X with accumulate, on stream. CUBLAS_STATUS_NOT_INITIALIZED before
  // Init, CUBLAS_STATUS_INVALID_VALUE for a null pointer or a size under 1.
  cublasStatus_t F16(const uint16_t* w, int32_t rows, int32_t cols, const uint16_t* x,
                     int32_t tokens, float* y, bool accumulate, cudaStream_t stream) const;

 private:
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
};

}  // namespace moegraph
