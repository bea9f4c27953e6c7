// Dense decode ops: embedding, RMSNorm, RoPE with the KV append, split-K decode
// attention, SwiGLU (the matvecs are kernels/matvec.cu). Per-element
// math comes from the MG_HD headers (loader/quant.h, kernels/nn_math.h,
// kernels/mmvq_math.h); this file holds the indexing and launch geometry. The
// ops whose output a quantized matvec reads (RMSNorm, the attention merge,
// SwiGLU) write its q8_1 blocks too: a warp's lanes hold one block's 32 values.
//
// Attention runs one block per (head, split of kAttnSplit positions); the grid
// is sized by max_ctx at capture and splits past the live length (*pos + 1, read
// on the device) exit at once. A second kernel merges the splits of each head
// that ran.
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kThreads = 256;
constexpr int kAttnSplit = 128;  // positions per attention block
constexpr int kAttnThreads = 128;
constexpr int kMaxHeadDim = 256;
constexpr int32_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y (attention splits)

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

int32_t attention_splits(int32_t max_ctx) { return ceil_div(max_ctx, kAttnSplit); }

// Bytes of a row of cols elements of type (cols a multiple of its block size).
size_t packed_row_bytes(GgmlType type, int64_t cols) {
  return static_cast<size_t>(cols / quant_block_elems(type) * quant_block_bytes(type));
}

bool table_ok(const DeviceMatrix& m) {
  return m.data != nullptr && m.rows > 0 && quant_block_elems(m.type) != 0 && m.cols > 0 &&
         m.cols % quant_block_elems(m.type) == 0 &&
         m.row_bytes >= packed_row_bytes(m.type, m.cols);
}

// One thread per ggml block of the row: the same floats as the CPU's dequantize_row.
__global__ void embed_kernel(const uint8_t* __restrict__ table, GgmlType type, int32_t rows,
                             size_t row_bytes, int32_t n_blocks, const int32_t* __restrict__ token,
                             float* __restrict__ out) {
  const int32_t block = blockIdx.x * blockDim.x + threadIdx.x;
  const int32_t t = *token;
  if (block >= n_blocks || t < 0 || t >= rows) return;
  const int64_t block_elems = quant_block_elems(type);
  dequantize_block(type, table + t * row_bytes + block * quant_block_bytes(type),
                   out + block * block_elems);
}

// out_q: row_len is a multiple of 32 and blockDim.x of 32, so warp w's lanes
// hold elements [32 (w + j * warps), + 32) in round j: one q8_1 block.
__global__ void rmsnorm_kernel(const float* x, const float* __restrict__ weight, float* out,
                               int32_t row_len, float eps, block_q8_1* __restrict__ out_q) {
  __shared__ float scratch[32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * row_len;
  float* out_row = out + static_cast<int64_t>(blockIdx.x) * row_len;
  float sum_sq = 0.0f;
  for (int32_t i = threadIdx.x; i < row_len; i += blockDim.x) sum_sq += row[i] * row[i];
  const float scale = rms_scale(block_sum(sum_sq, scratch), row_len, eps);
  if (out_q == nullptr) {
    for (int32_t i = threadIdx.x; i < row_len; i += blockDim.x) {
      out_row[i] = row[i] * scale * weight[i];
    }
    return;
  }
  for (int32_t base = threadIdx.x / 32 * 32; base < row_len; base += blockDim.x) {
    const int32_t i = base + threadIdx.x % 32;
    const float v = row[i] * scale * weight[i];
    out_row[i] = v;
    warp_quantize_q8_1(v, out_q + i / QK8_1);
  }
}

// A thread per rotated pair of q, then per rotated pair of k (written to the
// cache row), then per element of v (copied to it).
__global__ void rope_kv_append_kernel(float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, float* __restrict__ k_cache,
                                      float* __restrict__ v_cache, const int32_t* __restrict__ pos,
                                      int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                                      float freq_base, int32_t rope_type) {
  const int32_t half = head_dim / 2;
  const int32_t q_pairs = n_head * half;
  const int32_t kv_len = n_head_kv * head_dim;
  const int32_t p = *pos;
  int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= q_pairs + n_head_kv * half) {
    i -= q_pairs + n_head_kv * half;
    if (i < kv_len) v_cache[static_cast<int64_t>(p) * kv_len + i] = v[i];
    return;
  }
  const bool is_q = i < q_pairs;
  const int32_t pair = is_q ? i : i - q_pairs;
  const int32_t offset = pair / half * head_dim;
  int32_t a, b;
  rope_pair_offsets(pair % half, head_dim, rope_type, &a, &b);
  const float* src = is_q ? q + offset : k + offset;
  float* dst = is_q ? q + offset : k_cache + static_cast<int64_t>(p) * kv_len + offset;
  float x0 = src[a], x1 = src[b];
  rope_rotate(&x0, &x1, rope_theta(p, pair % half, head_dim, freq_base));
  dst[a] = x0;
  dst[b] = x1;
}

// Partial of (head, split): [head_dim] acc, then max, then sum.
__global__ void attention_split_kernel(const float* __restrict__ q,
                                       const float* __restrict__ k_cache,
                                       const float* __restrict__ v_cache,
                                       const int32_t* __restrict__ pos, int32_t n_head,
                                       int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                                       float scale, float* __restrict__ partial) {
  __shared__ float q_head[kMaxHeadDim];
  __shared__ float weights[kAttnSplit];
  __shared__ float scratch[32];
  const int32_t head = blockIdx.x;
  const int32_t split = blockIdx.y;
  float* out = partial + (static_cast<int64_t>(head) * gridDim.y + split) * (head_dim + 2);
  const int32_t length = min(*pos + 1, max_ctx);
  const int32_t begin = split * kAttnSplit;
  if (begin >= length) return;  // the merge reads only the splits that ran
  const int32_t count = min(kAttnSplit, length - begin);
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t kv_offset = static_cast<int64_t>(head / (n_head / n_head_kv)) * head_dim;
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    q_head[d] = q[static_cast<int64_t>(head) * head_dim + d];
  }
  __syncthreads();

  // Scores: a warp per position, lanes over head_dim.
  const int lane = threadIdx.x % 32;
  const int n_warps = blockDim.x / 32;
  for (int32_t t = threadIdx.x / 32; t < count; t += n_warps) {
    const float* key = k_cache + (begin + t) * kv_len + kv_offset;
    float dot = 0.0f;
    for (int32_t d = lane; d < head_dim; d += 32) dot += q_head[d] * key[d];
    dot = warp_sum(dot);
    if (lane == 0) weights[t] = dot * scale;
  }
  __syncthreads();

  float local_max = -INFINITY;
  for (int32_t t = threadIdx.x; t < count; t += blockDim.x)
    local_max = fmaxf(local_max, weights[t]);
  const float max_score = block_max(local_max, scratch);
  float local_sum = 0.0f;
  for (int32_t t = threadIdx.x; t < count; t += blockDim.x) {
    weights[t] = expf(weights[t] - max_score);
    local_sum += weights[t];
  }
  const float sum = block_sum(local_sum, scratch);  // its barriers publish weights[]

  // Weighted values: a thread per dimension, positions in order (coalesced rows).
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    const float* value = v_cache + static_cast<int64_t>(begin) * kv_len + kv_offset + d;
    float acc = 0.0f;
    for (int32_t t = 0; t < count; ++t) acc += weights[t] * value[t * kv_len];
    out[d] = acc;
  }
  if (threadIdx.x == 0) {
    out[head_dim] = max_score;
    out[head_dim + 1] = sum;
  }
}

// A thread per output element (head i / head_dim, dimension i % head_dim):
// merges the head's splits in order. With out_q, n_head * head_dim is a
// multiple of 32, so each warp's 32 elements are one q8_1 block.
__global__ void attention_merge_kernel(const float* __restrict__ partial,
                                       const int32_t* __restrict__ pos, int32_t head_dim,
                                       int32_t max_ctx, int32_t n_splits, int32_t n,
                                       float* __restrict__ out, block_q8_1* __restrict__ out_q) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const int32_t live = (min(*pos + 1, max_ctx) + kAttnSplit - 1) / kAttnSplit;
  float merged = 0.0f;
  if (i < n) {
    const int32_t head = i / head_dim;
    const int32_t d = i % head_dim;
    const float* head_partial = partial + static_cast<int64_t>(head) * n_splits * (head_dim + 2);
    SoftmaxPartial state = empty_softmax();
    float acc = 0.0f;
    for (int32_t s = 0; s < live; ++s) {
      const float* p = head_partial + static_cast<int64_t>(s) * (head_dim + 2);
      float scale_state, scale_split;
      state = softmax_merge(state, {p[head_dim], p[head_dim + 1]}, &scale_state, &scale_split);
      acc = acc * scale_state + p[d] * scale_split;
    }
    merged = acc / state.sum;
    out[i] = merged;
  }
  // Whole warps only: n is a multiple of 32 and so is the grid's thread count.
  if (out_q != nullptr && i / 32 * 32 < n) warp_quantize_q8_1(merged, out_q + i / QK8_1);
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, int32_t n,
                              block_q8_1* __restrict__ out_q) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = i < n ? silu(gate[i]) * up[i] : 0.0f;
  if (i < n) out[i] = v;
  if (out_q != nullptr && i / 32 * 32 < n) warp_quantize_q8_1(v, out_q + i / QK8_1);
}

}  // namespace

cudaError_t launch_embed(const DeviceMatrix& table, const int32_t* token, float* out,
                         cudaStream_t stream) {
  if (!table_ok(table) || token == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const int32_t n_blocks = static_cast<int32_t>(table.cols / quant_block_elems(table.type));
  return launch_kernel<embed_kernel>(ceil_div(n_blocks, kThreads), kThreads, stream,
                                     static_cast<const uint8_t*>(table.data), table.type,
                                     table.rows, table.row_bytes, n_blocks, token, out);
}

cudaError_t launch_rmsnorm(const float* x, const float* weight, float* out, int32_t n_rows,
                           int32_t row_len, float eps, block_q8_1* out_q, cudaStream_t stream) {
  if (x == nullptr || weight == nullptr || out == nullptr || n_rows <= 0 || row_len <= 0 ||
      (out_q != nullptr && (n_rows != 1 || row_len % QK8_1 != 0))) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<rmsnorm_kernel>(n_rows, kThreads, stream, x, weight, out, row_len, eps,
                                       out_q);
}

cudaError_t launch_rope_kv_append(float* q, const float* k, const float* v, float* k_cache,
                                  float* v_cache, const int32_t* pos, int32_t n_head,
                                  int32_t n_head_kv, int32_t head_dim, float freq_base,
                                  int32_t rope_type, cudaStream_t stream) {
  if (q == nullptr || k == nullptr || v == nullptr || k_cache == nullptr || v_cache == nullptr ||
      pos == nullptr || n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
      (rope_type != kRopeNorm && rope_type != kRopeNeox)) {
    return cudaErrorInvalidValue;
  }
  const int64_t threads = static_cast<int64_t>(n_head + n_head_kv) * head_dim / 2 +
                          static_cast<int64_t>(n_head_kv) * head_dim;
  return launch_kernel<rope_kv_append_kernel>(ceil_div(threads, kThreads), kThreads, stream, q, k,
                                              v, k_cache, v_cache, pos, n_head, n_head_kv,
                                              head_dim, freq_base, rope_type);
}

size_t attention_partial_floats(int32_t n_head, int32_t head_dim, int32_t max_ctx) {
  return static_cast<size_t>(n_head) * attention_splits(max_ctx) * (head_dim + 2);
}

cudaError_t launch_attention_decode(const float* q, const float* k_cache, const float* v_cache,
                                    const int32_t* pos, int32_t n_head, int32_t n_head_kv,
                                    int32_t head_dim, int32_t max_ctx, float scale, float* partial,
                                    float* out, block_q8_1* out_q, cudaStream_t stream) {
  if (q == nullptr || k_cache == nullptr || v_cache == nullptr || pos == nullptr ||
      partial == nullptr || out == nullptr || n_head <= 0 || n_head_kv <= 0 ||
      n_head % n_head_kv != 0 || head_dim <= 0 || head_dim > kMaxHeadDim || max_ctx <= 0 ||
      (out_q != nullptr && n_head * head_dim % QK8_1 != 0)) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_splits = attention_splits(max_ctx);
  if (n_splits > kMaxGridY) return cudaErrorInvalidValue;
  // A merge after a failed split launch would read stale partials.
  const cudaError_t split_error = launch_kernel<attention_split_kernel>(
      dim3(n_head, n_splits), kAttnThreads, stream, q, k_cache, v_cache, pos, n_head, n_head_kv,
      head_dim, max_ctx, scale, partial);
  if (split_error != cudaSuccess) return split_error;
  const int32_t n = n_head * head_dim;
  return launch_kernel<attention_merge_kernel>(ceil_div(n, kAttnThreads), kAttnThreads, stream,
                                               partial, pos, head_dim, max_ctx, n_splits, n, out,
                                               out_q);
}

cudaError_t launch_swiglu(const float* gate, const float* up, float* out, int32_t n,
                          block_q8_1* out_q, cudaStream_t stream) {
  if (gate == nullptr || up == nullptr || out == nullptr || n < 0 ||
      (out_q != nullptr && n % QK8_1 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  return launch_kernel<swiglu_kernel>(ceil_div(n, kThreads), kThreads, stream, gate, up, out, n,
                                      out_q);
}

}  // namespace moegraph
