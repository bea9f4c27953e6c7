// The emulated cuBLASLt subset (include/cublasLt.h). Compiled as an emulated
// .cu file: the matmul is a kernel the emulator launches like the project's.
#include "cublasLt.h"

#include <cstring>

#include "loader/quant.h"

namespace {

struct Layout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};

struct MatmulDesc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
};

struct Preference {
  uint64_t max_workspace = 0;
};

struct Context {};

Layout* AsLayout(cublasLtMatrixLayout_t l) { return reinterpret_cast<Layout*>(l); }
MatmulDesc* AsDesc(cublasLtMatmulDesc_t d) { return reinterpret_cast<MatmulDesc*>(d); }
Preference* AsPreference(cublasLtMatmulPreference_t p) { return reinterpret_cast<Preference*>(p); }

size_t ElementBytes(cudaDataType type) { return type == CUDA_R_32F ? 4 : 2; }

bool KnownType(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16F || type == CUDA_R_16BF;
}

// D = alpha op(A) op(B) + beta C: op(A) m x k, op(B) k x n, C and D m x n.
struct Shape {
  int64_t m, n, k;
  bool trans_a, trans_b;
  int64_t lda, ldb, ldc, ldd;
  cudaDataType ab, cd;
  float alpha, beta;
};

float Load(const void* p, cudaDataType type, int64_t i) {
  if (type == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return type == CUDA_R_16F ? moegraph::f16_to_f32(h) : moegraph::bf16_to_f32(h);
}

void Store(void* p, cudaDataType type, int64_t i, float v) {
  if (type == CUDA_R_32F) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] =
        type == CUDA_R_16F ? moegraph::f32_to_f16(v) : moegraph::f32_to_bf16(v);
  }
}

// A thread per element of D (i down a column, j across), k in order.
__global__ void matmul_kernel(const void* a, const void* b, const void* c, void* d, Shape s) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= s.m * s.n) return;
  const int64_t i = e % s.m, j = e / s.m;
  float acc = 0.0f;
  for (int64_t p = 0; p < s.k; ++p) {
    const float av = Load(a, s.ab, s.trans_a ? i * s.lda + p : p * s.lda + i);
    const float bv = Load(b, s.ab, s.trans_b ? p * s.ldb + j : j * s.ldb + p);
    acc += av * bv;
  }
  float out = s.alpha * acc;
  if (s.beta != 0.0f) out += s.beta * Load(c, s.cd, j * s.ldc + i);
  Store(d, s.cd, j * s.ldd + i, out);
}

// The checks cublasLtMatmulAlgoGetHeuristic and cublasLtMatmul share.
cublasStatus_t CheckProblem(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                            cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                            cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d, Shape* shape) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const MatmulDesc& op = *AsDesc(desc);
  const Layout &la = *AsLayout(a), &lb = *AsLayout(b), &lc = *AsLayout(c), &ld = *AsLayout(d);
  Shape s{};
  s.trans_a = op.trans_a == CUBLAS_OP_T;
  s.trans_b = op.trans_b == CUBLAS_OP_T;
  s.m = static_cast<int64_t>(s.trans_a ? la.cols : la.rows);
  s.k = static_cast<int64_t>(s.trans_a ? la.rows : la.cols);
  const int64_t kb = static_cast<int64_t>(s.trans_b ? lb.cols : lb.rows);
  s.n = static_cast<int64_t>(s.trans_b ? lb.rows : lb.cols);
  if (kb != s.k || static_cast<int64_t>(lc.rows) != s.m || static_cast<int64_t>(lc.cols) != s.n ||
      lc.rows != ld.rows || lc.cols != ld.cols) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (const Layout* l : {&la, &lb, &lc, &ld}) {
    if (l->ld < static_cast<int64_t>(l->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F || la.type != lb.type ||
      lc.type != ld.type || (lc.type != CUDA_R_32F && lc.type != la.type)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  s.lda = la.ld;
  s.ldb = lb.ld;
  s.ldc = lc.ld;
  s.ldd = ld.ld;
  s.ab = la.type;
  s.cd = lc.type;
  *shape = s;
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = reinterpret_cast<cublasLtHandle_t>(new Context);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete reinterpret_cast<Context*>(lightHandle);
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (matLayout == nullptr || !KnownType(type)) return CUBLAS_STATUS_INVALID_VALUE;
  *matLayout = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete AsLayout(matLayout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc,
                                        cublasComputeType_t computeType, cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *matmulDesc = reinterpret_cast<cublasLtMatmulDesc_t>(new MatmulDesc{computeType, scaleType});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete AsDesc(matmulDesc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t sizeInBytes) {
  if (matmulDesc == nullptr || buf == nullptr || sizeInBytes != sizeof(int32_t)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  int32_t value = 0;
  std::memcpy(&value, buf, sizeof(value));
  MatmulDesc& d = *AsDesc(matmulDesc);
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (value != CUBLAS_OP_N && value != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d.trans_a : d.trans_b) = value;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      return value == CUBLASLT_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS
                                                 : CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete AsPreference(pref);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t sizeInBytes) {
  if (pref == nullptr || buf == nullptr || attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES ||
      sizeInBytes != sizeof(uint64_t)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  std::memcpy(&AsPreference(pref)->max_workspace, buf, sizeof(uint64_t));
  return CUBLAS_STATUS_SUCCESS;
}

// One algorithm: the emulated kernel, needing no workspace.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  if (preference == nullptr || requestedAlgoCount < 1 || heuristicResultsArray == nullptr ||
      returnAlgoCount == nullptr) {
    return lightHandle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : CUBLAS_STATUS_INVALID_VALUE;
  }
  Shape shape;
  *returnAlgoCount = 0;
  const cublasStatus_t status =
      CheckProblem(lightHandle, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &shape);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  heuristicResultsArray[0] = cublasLtMatmulHeuristicResult_t{};
  heuristicResultsArray[0].state = CUBLAS_STATUS_SUCCESS;
  heuristicResultsArray[0].wavesCount = 1.0f;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                              const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                              const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                              const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* /*algo*/,
                              void* workspace, size_t workspaceSizeInBytes, cudaStream_t stream) {
  Shape s;
  const cublasStatus_t status =
      CheckProblem(lightHandle, computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &s);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (alpha == nullptr || beta == nullptr || A == nullptr || B == nullptr || C == nullptr ||
      D == nullptr || (workspace == nullptr && workspaceSizeInBytes != 0)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  std::memcpy(&s.alpha, alpha, sizeof(float));
  std::memcpy(&s.beta, beta, sizeof(float));
  if (s.m == 0 || s.n == 0) return CUBLAS_STATUS_SUCCESS;
  constexpr int kThreads = 256;
  const int64_t blocks = (s.m * s.n + kThreads - 1) / kThreads;
  moegraph_emu::Launch<matmul_kernel>(static_cast<unsigned int>(blocks), kThreads, stream, A, B, C,
                                      D, s);
  return cudaGetLastError() == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
