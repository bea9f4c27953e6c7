#include "kernels/gemm.h"

#include <initializer_list>

namespace moegraph {

GemmRunner::~GemmRunner() {
  if (preference_ != nullptr) cublasLtMatmulPreferenceDestroy(preference_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

cublasStatus_t GemmRunner::Init() {
  if (handle_ != nullptr) return CUBLAS_STATUS_SUCCESS;
  cublasStatus_t status = cublasLtCreate(&handle_);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  status = cublasLtMatmulPreferenceCreate(&preference_);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const uint64_t workspace = 0;
  return cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &workspace, sizeof(workspace));
}

cublasStatus_t GemmRunner::F16(const uint16_t* w, int32_t rows, int32_t cols, const uint16_t* x,
                               int32_t tokens, float* y, bool accumulate,
                               cudaStream_t stream) const {
  if (handle_ == nullptr || preference_ == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (w == nullptr || x == nullptr || y == nullptr || rows < 1 || cols < 1 || tokens < 1) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasStatus_t status = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const int32_t transpose = CUBLAS_OP_T;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                            sizeof(transpose));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, cols, rows, cols);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, cols, tokens, cols);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, rows, tokens, rows);
  }
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle_, desc, a, b, d, d, preference_, 1, &heuristic,
                                            &found);
  }
  if (status == CUBLAS_STATUS_SUCCESS && found < 1) status = CUBLAS_STATUS_NOT_SUPPORTED;
  if (status == CUBLAS_STATUS_SUCCESS) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    status = cublasLtMatmul(handle_, desc, &alpha, w, a, x, b, &beta, y, d, y, d, &heuristic.algo,
                            nullptr, 0, stream);
  }
  for (cublasLtMatrixLayout_t layout : {a, b, d}) {
    if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  return status;
}

}  // namespace moegraph
