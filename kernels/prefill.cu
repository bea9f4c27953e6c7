// The row ops of a prompt's ubatch (issue 20): T rows at a time, each row by a
// block with the decode step's per-element helpers (kernels/epilogue.cuh), so a
// row is normed and rotated as the decode step's epilogues do it.
#include <algorithm>

#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kRowThreads = 256;

// Row blockIdx.x of x normed (x / rms(x) * weight) into out (f32) and out_f16
// (f16 bits), each where not null: the GEMMs' inputs.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_kernel(const float* __restrict__ x, const float* __restrict__ weight, int32_t n,
                        float eps, float* __restrict__ out, uint16_t* __restrict__ out_f16) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int64_t at = static_cast<int64_t>(blockIdx.x) * n;
  const float scale = block_rms_scale(x + at, n, eps, &shared);
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = x[at + i] * scale * weight[i];
    if (out != nullptr) out[at + i] = v;
    if (out_f16 != nullptr) out_f16[at + i] = f32_to_f16(v);
  }
}

// One row by one block: the norm epilogue of the decode step (the last
// token's output_norm, into what lm_head reads).
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_row_kernel(const float* __restrict__ x, int32_t n, NormEpilogue norm) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  run_norm_epilogue(norm, x, n, &shared);
}

__global__ void __launch_bounds__(kRowThreads)
    to_f16_kernel(const float* __restrict__ x, int64_t n, uint16_t* __restrict__ out) {
  wait_for_prior_grids();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = f32_to_f16(x[i]);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    fill_rows_kernel(const float* __restrict__ row, int32_t n, bool add, float* __restrict__ out) {
  wait_for_prior_grids();
  const int64_t at = static_cast<int64_t>(blockIdx.x) * n;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    out[at + i] = add ? out[at + i] + row[i] : row[i];
  }
}

// Row blockIdx.x's top-k by its block: the decode router's epilogue.
__global__ void __launch_bounds__(kRouterThreads)
    router_topk_rows_kernel(float* __restrict__ logits, int32_t n_expert, RouterEpilogue router) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int64_t t = blockIdx.x;
  block_router_topk(logits + t * n_expert, n_expert, router, router.experts + t * router.k,
                    router.weights + t * router.k, &shared);
}

// Row i of out (and out_f16) is row entries[i] / k of x (and x_f16).
__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const float* __restrict__ x, const uint16_t* __restrict__ x_f16, int32_t n,
                       const int32_t* __restrict__ entries, int32_t k, float* __restrict__ out,
                       uint16_t* __restrict__ out_f16) {
  wait_for_prior_grids();
  const int64_t from = static_cast<int64_t>(entries[blockIdx.x] / k) * n;
  const int64_t to = static_cast<int64_t>(blockIdx.x) * n;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (out != nullptr) out[to + i] = x[from + i];
    if (out_f16 != nullptr) out_f16[to + i] = x_f16[from + i];
  }
}

__global__ void __launch_bounds__(kRowThreads)
    swiglu_kernel(const float* __restrict__ gate, const float* __restrict__ up, int64_t n,
                  GluAct act, float* __restrict__ out, uint16_t* __restrict__ out_f16) {
  wait_for_prior_grids();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = glu(act, gate[i], up[i]);
    if (out != nullptr) out[i] = v;
    if (out_f16 != nullptr) out_f16[i] = f32_to_f16(v);
  }
}

// Row i of y to row entries[i] of out.
__global__ void __launch_bounds__(kRowThreads)
    scatter_rows_kernel(const float* __restrict__ y, int32_t n,
                        const int32_t* __restrict__ entries, float* __restrict__ out) {
  wait_for_prior_grids();
  const int64_t from = static_cast<int64_t>(blockIdx.x) * n;
  const int64_t to = static_cast<int64_t>(entries[blockIdx.x]) * n;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) out[to + i] = y[from + i];
}

// Token blockIdx.x's combine in the decode step's order (combine_epilogue):
// the ranks' outputs by weight in rank order, then the shared expert, then
// one add into the residual.
__global__ void __launch_bounds__(kRowThreads)
    combine_rows_kernel(const float* __restrict__ expert_out, const float* __restrict__ weights,
                        int32_t k, int32_t n, const float* __restrict__ shexp_out,
                        const float* __restrict__ shexp_logit, float* __restrict__ residual) {
  wait_for_prior_grids();
  const int64_t t = blockIdx.x;
  for (int32_t row = threadIdx.x; row < n; row += blockDim.x) {
    float acc = 0.0f;
    for (int32_t r = 0; r < k; ++r) {
      acc += weights[t * k + r] * expert_out[(t * k + r) * n + row];
    }
    if (shexp_out != nullptr) {
      acc += (shexp_logit != nullptr ? sigmoid(shexp_logit[t]) : 1.0f) * shexp_out[t * n + row];
    }
    residual[t * n + row] += acc;
  }
}

// Row blockIdx.x at position *rope.pos + row: of q (blockIdx.y 0) each head
// QK-normed and rotated into q_out's row, of k (1) into the k cache's row, of
// v (2) copied into the v cache's row.
__global__ void __launch_bounds__(kRowThreads)
    rope_append_rows_kernel(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, QkvRope rope) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int64_t row = blockIdx.x;
  const int j = static_cast<int>(blockIdx.y);
  const int32_t d = rope.head_dim;
  const int32_t p = *rope.pos + static_cast<int32_t>(row);
  const int64_t kv_row_len = static_cast<int64_t>(rope.n_head_kv) * d;
  const int64_t cache_row = kv_cache_row(p, rope.kv_rows) * kv_row_len;
  if (j == 2) {
    const float* src = v + row * kv_row_len;
    for (int64_t i = threadIdx.x; i < kv_row_len; i += blockDim.x) {
      if (rope.kv_f16) {
        static_cast<uint16_t*>(rope.v_cache)[cache_row + i] = f32_to_f16(src[i]);
      } else {
        static_cast<float*>(rope.v_cache)[cache_row + i] = src[i];
      }
    }
    return;
  }
  const int32_t n_heads = j == 0 ? rope.n_head : rope.n_head_kv;
  const int64_t row_len = static_cast<int64_t>(n_heads) * d;
  // A gated q's rows hold each head's gate after its query.
  const float* src = (j == 0 ? q : k) + row * n_heads * rope_source_head(rope, j, 1);
  const float full_scale =
      rope.use_norm && rope.norm.full
          ? block_rms_scale(src, static_cast<int32_t>(row_len), rope.norm.eps, &shared)
          : 1.0f;
  for (int32_t h = 0; h < n_heads; ++h) {
    const float scale =
        rope.use_norm && !rope.norm.full
            ? block_rms_scale(src + rope_source_head(rope, j, h), d, rope.norm.eps, &shared)
            : full_scale;
    rope_qk_head(rope, j, src, scale, h, p, rope.q_out + row * row_len);
  }
}

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kRowThreads - 1) / kRowThreads, 4096));
}

}  // namespace

cudaError_t launch_rmsnorm_rows(const float* x, const float* weight, int32_t n, int32_t tokens,
                                float eps, float* out, uint16_t* out_f16, cudaStream_t stream) {
  if (x == nullptr || weight == nullptr || (out == nullptr && out_f16 == nullptr) || n <= 0 ||
      tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rmsnorm_rows_kernel>(tokens, kRowThreads, stream, x, weight, n, eps, out,
                                            out_f16);
}

cudaError_t launch_rmsnorm_row(const float* x, int32_t n, const NormEpilogue& norm,
                               cudaStream_t stream) {
  if (x == nullptr || n <= 0 || norm.weight == nullptr || !norm_epilogue_ok(norm, n)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rmsnorm_row_kernel>(1, kRowThreads, stream, x, n, norm);
}

cudaError_t launch_to_f16(const float* x, int64_t n, uint16_t* out, cudaStream_t stream) {
  if (x == nullptr || out == nullptr || n <= 0) return cudaErrorInvalidValue;
  return launch_kernel<to_f16_kernel>(elementwise_blocks(n), kRowThreads, stream, x, n, out);
}

cudaError_t launch_fill_rows(const float* row, int32_t n, int32_t tokens, float* out,
                             cudaStream_t stream) {
  if (row == nullptr || out == nullptr || n <= 0 || tokens <= 0) return cudaErrorInvalidValue;
  return launch_kernel<fill_rows_kernel>(tokens, kRowThreads, stream, row, n, false, out);
}

cudaError_t launch_add_rows(const float* row, int32_t n, int32_t tokens, float* out,
                            cudaStream_t stream) {
  if (row == nullptr || out == nullptr || n <= 0 || tokens <= 0) return cudaErrorInvalidValue;
  return launch_kernel<fill_rows_kernel>(tokens, kRowThreads, stream, row, n, true, out);
}

cudaError_t launch_router_topk_rows(float* logits, int32_t n_expert, int32_t tokens,
                                    const RouterEpilogue& router, cudaStream_t stream) {
  const int32_t k = router.k;
  if (logits == nullptr || router.experts == nullptr || router.weights == nullptr ||
      tokens <= 0 || !router_topk_fits(n_expert, k)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<router_topk_rows_kernel>(tokens, kRouterThreads, stream, logits, n_expert, router);
}

cudaError_t launch_gather_rows(const float* x, const uint16_t* x_f16, int32_t n,
                               const int32_t* entries, int32_t count, int32_t k, float* out,
                               uint16_t* out_f16, cudaStream_t stream) {
  if (entries == nullptr || n <= 0 || count <= 0 || k <= 0 ||
      (out == nullptr && out_f16 == nullptr) || (out != nullptr && x == nullptr) ||
      (out_f16 != nullptr && x_f16 == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<gather_rows_kernel>(count, kRowThreads, stream, x, x_f16, n, entries, k,
                                           out, out_f16);
}

cudaError_t launch_swiglu_rows(const float* gate, const float* up, int64_t n, GluAct act,
                               float* out, uint16_t* out_f16, cudaStream_t stream) {
  if (gate == nullptr || up == nullptr || n <= 0 || (out == nullptr && out_f16 == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<swiglu_kernel>(elementwise_blocks(n), kRowThreads, stream, gate, up, n, act,
                                      out, out_f16);
}

cudaError_t launch_scatter_rows(const float* y, int32_t n, const int32_t* entries, int32_t count,
                                float* out, cudaStream_t stream) {
  if (y == nullptr || entries == nullptr || out == nullptr || n <= 0 || count <= 0) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<scatter_rows_kernel>(count, kRowThreads, stream, y, n, entries, out);
}

cudaError_t launch_combine_rows(const float* expert_out, const float* weights, int32_t k,
                                int32_t n, int32_t tokens, const float* shexp_out,
                                const float* shexp_logit, float* residual, cudaStream_t stream) {
  if (expert_out == nullptr || weights == nullptr || residual == nullptr || k <= 0 || n <= 0 ||
      tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<combine_rows_kernel>(tokens, kRowThreads, stream, expert_out, weights, k, n,
                                            shexp_out, shexp_logit, residual);
}

cudaError_t launch_rope_append_rows(const float* q, const float* k, const float* v, int32_t tokens,
                                    const QkvRope& rope, cudaStream_t stream) {
  if (q == nullptr || k == nullptr || v == nullptr || tokens <= 0 || rope.pos == nullptr ||
      rope.cos_sin == nullptr ||
      rope.q_out == nullptr || rope.k_cache == nullptr || rope.v_cache == nullptr ||
      rope.kv_rows < 0 || (rope.kv_rows > 0 && rope.kv_rows < tokens) || rope.n_head <= 0 ||
      rope.n_head_kv <= 0 || rope.head_dim <= 0 || rope.head_dim % 2 != 0 ||
      (rope.use_norm && (rope.norm.q_weight == nullptr || rope.norm.k_weight == nullptr)) ||
      (rope.q_gated && rope.use_norm && rope.norm.full)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rope_append_rows_kernel>(dim3(tokens, 3), kRowThreads, stream, q, k, v,
                                                rope);
}

}  // namespace moegraph
