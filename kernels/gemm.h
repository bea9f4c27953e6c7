// The prefill's matrix products through cuBLASLt (issue 20): for T tokens,
// Y[t][r] = sum_c W[r][c] X[t][c] (or Y += it), the sum and Y in f32
// (CUBLAS_COMPUTE_32F). The operands are f16, as ggml-cuda runs a quantized or
// f16 weight (ggml_cuda_mul_mat_cublas: both converted to f16 on hardware with
// fast f16), or f32 for an f32 weight (its cublasSgemm path, no TF32).
// W, row-major rows x cols as the file stores it, is column-major cols x rows:
// A with op T; X (cols per token) is column-major cols x T; Y rows x T.
// Host code. The library is opened on first Init (libcublasLt.so.13, dlopen):
// a process that never runs a prefill never maps its 500 MB. The emulated
// tree calls emulator/include/cublasLt.h's subset instead.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace moegraph {

enum class GemmType {
  kF16,  // W and X as f16 bits
  kF32,
};

class GemmRunner {
 public:
  GemmRunner() = default;
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // The library's handle and a preference for algorithms without workspace.
  // CUBLAS_STATUS_NOT_INITIALIZED where the library cannot be opened, with
  // the loader's reason in *why.
  cublasStatus_t Init(std::string* why = nullptr);

  // cublasLtGetStatusName's words; CUBLAS_STATUS_NOT_INITIALIZED's where the
  // library could not be loaded.
  static const char* StatusName(cublasStatus_t status);

  // Y (f32, tokens x rows) = W (rows x cols) X (tokens x cols), or Y += W X
  // with accumulate, on stream; W and X of type. CUBLAS_STATUS_NOT_INITIALIZED
  // before Init, CUBLAS_STATUS_INVALID_VALUE for a null pointer or a size under
  // 1. The descriptors and the algorithm of a shape are made once and kept.
  cublasStatus_t Multiply(GemmType type, const void* w, int32_t rows, int32_t cols, const void* x,
                          int32_t tokens, float* y, bool accumulate, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo = {};
  };
  using Shape = std::tuple<GemmType, int32_t, int32_t, int32_t>;  // type, rows, cols, tokens

  cublasStatus_t MakePlan(const Shape& shape, Plan* plan) const;
  static void DestroyPlan(Plan& plan);

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
  std::map<Shape, Plan> plans_;
};

}  // namespace moegraph
