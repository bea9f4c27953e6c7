#include "kernels/gemm.h"

#include <initializer_list>
#include <type_traits>

#ifndef MOEGRAPH_EMULATED_CUBLASLT
#include <dlfcn.h>
#endif

namespace moegraph {
namespace {

// The entry points GemmRunner calls.
struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetStatusName) status_name = nullptr;
};

// Null until a load succeeds; *why says why one failed.
const CublasLtApi* Api(std::string* why) {
#ifdef MOEGRAPH_EMULATED_CUBLASLT
  (void)why;
  static const CublasLtApi api = {cublasLtCreate,
                                  cublasLtDestroy,
                                  cublasLtMatmulPreferenceCreate,
                                  cublasLtMatmulPreferenceSetAttribute,
                                  cublasLtMatmulPreferenceDestroy,
                                  cublasLtMatmulDescCreate,
                                  cublasLtMatmulDescSetAttribute,
                                  cublasLtMatmulDescDestroy,
                                  cublasLtMatrixLayoutCreate,
                                  cublasLtMatrixLayoutDestroy,
                                  cublasLtMatmulAlgoGetHeuristic,
                                  cublasLtMatmul,
                                  cublasLtGetStatusName};
  return &api;
#else
  static const std::string library = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  static std::string error;
  static const CublasLtApi* const loaded = []() -> const CublasLtApi* {
    void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* reason = dlerror();
      error = reason != nullptr ? reason : library + " cannot be opened";
      return nullptr;
    }
    static CublasLtApi api;
    bool complete = true;
    auto bind = [&](auto& entry, const char* name) {
      entry = reinterpret_cast<std::remove_reference_t<decltype(entry)> >(dlsym(handle, name));
      if (entry == nullptr && complete) {
        complete = false;
        error = library + " has no " + name;
      }
    };
    bind(api.create, "cublasLtCreate");
    bind(api.destroy, "cublasLtDestroy");
    bind(api.preference_create, "cublasLtMatmulPreferenceCreate");
    bind(api.preference_set, "cublasLtMatmulPreferenceSetAttribute");
    bind(api.preference_destroy, "cublasLtMatmulPreferenceDestroy");
    bind(api.desc_create, "cublasLtMatmulDescCreate");
    bind(api.desc_set, "cublasLtMatmulDescSetAttribute");
    bind(api.desc_destroy, "cublasLtMatmulDescDestroy");
    bind(api.layout_create, "cublasLtMatrixLayoutCreate");
    bind(api.layout_destroy, "cublasLtMatrixLayoutDestroy");
    bind(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(api.matmul, "cublasLtMatmul");
    bind(api.status_name, "cublasLtGetStatusName");
    return complete ? &api : nullptr;
  }();
  if (loaded == nullptr && why != nullptr) *why = error;
  return loaded;
#endif
}

}  // namespace

const char* GemmRunner::StatusName(cublasStatus_t status) {
  // Every status but a failed load comes from a loaded library.
  const CublasLtApi* api = Api(nullptr);
  return api != nullptr ? api->status_name(status) : "CUBLAS_STATUS_NOT_INITIALIZED";
}

GemmRunner::~GemmRunner() {
  for (auto& [shape, plan] : plans_) DestroyPlan(plan);
  if (preference_ != nullptr) Api(nullptr)->preference_destroy(preference_);
  if (handle_ != nullptr) Api(nullptr)->destroy(handle_);
}

cublasStatus_t GemmRunner::Init(std::string* why) {
  if (handle_ != nullptr) return CUBLAS_STATUS_SUCCESS;
  const CublasLtApi* api = Api(why);
  if (api == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  cublasStatus_t status = api->create(&handle_);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  status = api->preference_create(&preference_);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const uint64_t workspace = 0;
  return api->preference_set(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                             sizeof(workspace));
}

// Only plans of an initialized runner exist: the library is loaded.
void GemmRunner::DestroyPlan(Plan& plan) {
  const CublasLtApi* api = Api(nullptr);
  for (cublasLtMatrixLayout_t layout : {plan.a, plan.b, plan.d}) {
    if (layout != nullptr) api->layout_destroy(layout);
  }
  if (plan.desc != nullptr) api->desc_destroy(plan.desc);
  plan = Plan();
}

cublasStatus_t GemmRunner::MakePlan(const Shape& shape, Plan* plan) const {
  const CublasLtApi* api = Api(nullptr);
  const auto [type, rows, cols, tokens] = shape;
  const cudaDataType operand = type == GemmType::kF16 ? CUDA_R_16F : CUDA_R_32F;
  cublasStatus_t status = api->desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const int32_t transpose = CUBLAS_OP_T;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api->layout_create(&plan->a, operand, cols, rows, cols);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api->layout_create(&plan->b, operand, cols, tokens, cols);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api->layout_create(&plan->d, CUDA_R_32F, rows, tokens, rows);
  }
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api->heuristic(handle_, plan->desc, plan->a, plan->b, plan->d, plan->d, preference_, 1,
                            &heuristic, &found);
  }
  if (status == CUBLAS_STATUS_SUCCESS && found < 1) status = CUBLAS_STATUS_NOT_SUPPORTED;
  if (status == CUBLAS_STATUS_SUCCESS) plan->algo = heuristic.algo;
  return status;
}

cublasStatus_t GemmRunner::Multiply(GemmType type, const void* w, int32_t rows, int32_t cols,
                                    const void* x, int32_t tokens, float* y, bool accumulate,
                                    cudaStream_t stream) {
  if (handle_ == nullptr || preference_ == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (w == nullptr || x == nullptr || y == nullptr || rows < 1 || cols < 1 || tokens < 1) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const Shape shape{type, rows, cols, tokens};
  auto it = plans_.find(shape);
  if (it == plans_.end()) {
    Plan plan;
    const cublasStatus_t status = MakePlan(shape, &plan);
    if (status != CUBLAS_STATUS_SUCCESS) {
      DestroyPlan(plan);
      return status;
    }
    it = plans_.emplace(shape, plan).first;
  }
  const Plan& plan = it->second;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return Api(nullptr)->matmul(handle_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, y, plan.d, y,
                              plan.d, &plan.algo, nullptr, 0, stream);
}

}  // namespace moegraph
