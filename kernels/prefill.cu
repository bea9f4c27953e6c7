// The row ops of a prompt's ubatch (issue 20): T rows at a time, each row by a
// block with the decode step's per-element helpers (kernels/epilogue.cuh), so a
// row is normed and rotated as the decode step's epilogues do it.
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kRowThreads = 256;

// Row blockIdx.x of x normed (x / rms(x) * weight) into out as f16: the GEMMs'
// input.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_f16_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                            int32_t n, float eps, uint16_t* __restrict__ out) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int64_t at = static_cast<int64_t>(blockIdx.x) * n;
  const float scale = block_rms_scale(x + at, n, eps, &shared);
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    out[at + i] = f32_to_f16(x[at + i] * scale * weight[i]);
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
  const int64_t cache_row = static_cast<int64_t>(p) * kv_row_len;
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
  const float* src = (j == 0 ? q : k) + row * row_len;
  const float full_scale =
      rope.use_norm && rope.norm.full
          ? block_rms_scale(src, static_cast<int32_t>(row_len), rope.norm.eps, &shared)
          : 1.0f;
  for (int32_t h = 0; h < n_heads; ++h) {
    const float scale = rope.use_norm && !rope.norm.full
                            ? block_rms_scale(src + h * d, d, rope.norm.eps, &shared)
                            : full_scale;
    rope_qk_head(rope, j, src, scale, h, p, rope.q_out + row * row_len);
  }
}

}  // namespace

cudaError_t launch_rmsnorm_rows_f16(const float* x, const float* weight, int32_t n, int32_t tokens,
                                    float eps, uint16_t* out, cudaStream_t stream) {
  if (x == nullptr || weight == nullptr || out == nullptr || n <= 0 || tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rmsnorm_rows_f16_kernel>(tokens, kRowThreads, stream, x, weight, n, eps,
                                                out);
}

cudaError_t launch_rope_append_rows(const float* q, const float* k, const float* v, int32_t tokens,
                                    const QkvRope& rope, cudaStream_t stream) {
  if (q == nullptr || k == nullptr || v == nullptr || tokens <= 0 || rope.pos == nullptr ||
      rope.q_out == nullptr || rope.k_cache == nullptr || rope.v_cache == nullptr ||
      rope.n_head <= 0 || rope.n_head_kv <= 0 || rope.head_dim <= 0 || rope.head_dim % 2 != 0 ||
      (rope.use_norm && (rope.norm.q_weight == nullptr || rope.norm.k_weight == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rope_append_rows_kernel>(dim3(tokens, 3), kRowThreads, stream, q, k, v,
                                                rope);
}

}  // namespace moegraph
