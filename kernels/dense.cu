// Dense decode ops: embedding with the first RMSNorm and split-K decode
// attention (the matvecs are kernels/matvec.cu; the other norms, QK-norm, RoPE
// and the KV append are epilogues of the ops before them). Per-element
// math comes from the MG_HD headers (loader/quant.h, kernels/nn_math.h,
// kernels/mmvq_math.h); this file holds the indexing and launch geometry. The
// ops whose output a quantized matvec reads (the norms, the attention merge)
// write its q8_1 blocks too: a warp's lanes hold one block's 32 values.
//
// Attention runs one block per (head, split of kAttnSplit positions); the grid
// is sized by max_ctx at capture and splits past the live length (*pos + 1, read
// on the device) exit at once. The last split of a head to finish merges the
// head's splits (kernels/epilogue.cuh).
#include "kernels/epilogue.cuh"
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

// The keys a query at position length - 1 sees, [first, length), in splits
// first / kAttnSplit .. (length - 1) / kAttnSplit; split s covers [begin, begin
// + count). Decode and prefill both cut them so.
struct LiveKeys {
  int32_t first, length;
  __device__ LiveKeys(int32_t len, int32_t window)
      : first(window > 0 ? max(0, len - window) : 0), length(len) {}
  __device__ int32_t first_split() const { return first / kAttnSplit; }
  __device__ int32_t end_split() const { return (length + kAttnSplit - 1) / kAttnSplit; }
  __device__ int32_t begin(int32_t s) const { return max(s * kAttnSplit, first); }
  __device__ int32_t count(int32_t s) const { return min((s + 1) * kAttnSplit, length) - begin(s); }
};

// The merge's starting state: the sink's logit, exp(0) = 1 of denominator and
// no value, or nothing.
__device__ inline SoftmaxPartial initial_softmax(const float* sinks, int32_t head) {
  return sinks != nullptr ? SoftmaxPartial{sinks[head], 1.0f} : empty_softmax();
}

// A ring holds the window and a ubatch of tokens (AttentionMask).
bool mask_ok(const AttentionMask& mask, int32_t tokens) {
  return mask.window >= 0 && mask.kv_rows >= 0 &&
         (mask.kv_rows == 0 || (mask.window > 0 && mask.kv_rows >= mask.window + tokens - 1));
}

// Bytes of a row of cols elements of type (cols a multiple of its block size).
size_t packed_row_bytes(GgmlType type, int64_t cols) {
  return static_cast<size_t>(cols / quant_block_elems(type) * quant_block_bytes(type));
}

bool table_ok(const DeviceMatrix& m) {
  return m.data != nullptr && m.rows > 0 && quant_block_elems(m.type) != 0 && m.cols > 0 &&
         m.cols % quant_block_elems(m.type) == 0 &&
         m.row_bytes >= packed_row_bytes(m.type, m.cols);
}

// A block per token (row blockIdx.x of out): a thread per ggml block of the row
// (the same floats as the CPU's dequantize_row), then the norm of the row (one
// token only: the norm writes one output).
__global__ void embed_kernel(const uint8_t* __restrict__ table, GgmlType type, int32_t rows,
                             size_t row_bytes, int32_t n_blocks, const int32_t* __restrict__ token,
                             float* __restrict__ out, NormEpilogue norm) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int32_t t = token[blockIdx.x];
  if (t < 0 || t >= rows) return;
  const int64_t block_elems = quant_block_elems(type);
  out += static_cast<int64_t>(blockIdx.x) * n_blocks * block_elems;
  for (int32_t block = threadIdx.x; block < n_blocks; block += blockDim.x) {
    dequantize_block(type, table + t * row_bytes + block * quant_block_bytes(type),
                     out + block * block_elems);
  }
  __syncthreads();  // the row's writes are visible to the whole block
  run_norm_epilogue(norm, out, static_cast<int32_t>(n_blocks * block_elems), &shared);
}

// The score of one key against q_head by a group of g lanes (g a power of two
// dividing 32, head_dim a multiple of 8 g): f16 keys read 8 at a time (16-byte
// loads), q_head as float4 pairs.
__device__ __forceinline__ float key_dot_f16x8(const float* q_head, const uint16_t* key,
                                               int32_t head_dim, int t, int g) {
  float dot = 0.0f;
  for (int32_t d = 8 * t; d < head_dim; d += 8 * g) {
    const uint4 packed = *reinterpret_cast<const uint4*>(key + d);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    const float4 qa = *reinterpret_cast<const float4*>(q_head + d);
    const float4 qb = *reinterpret_cast<const float4*>(q_head + d + 4);
    const float qs[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    for (int i = 0; i < 8; ++i) {
      const uint16_t h = static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2)));
      dot += qs[i] * f16_to_f32(h);
    }
  }
  return group_sum(dot, g);
}

// A block's shared memory for one split (declared by the kernel: see
// kernels/epilogue.cuh).
template <typename T>
struct SplitShared {
  float4 q_head4[kMaxHeadDim / 4];  // the head's q, 16-byte aligned for key_dot_f16x8
  float weights[kAttnSplit];
  // The f16 values' per-group sums: at most 8 floats per thread.
  float value_sums[sizeof(T) == 2 ? 8 * kAttnThreads : 1];
  float scratch[32];
};

// The softmax partial of the head's q (sh->q_head4, written and published by
// the caller) against cache rows [begin, begin + count) of one KV head: the
// weighted values into acc_out[d] by the thread d % blockDim.x, the max and
// the sum returned on every thread. Decode and prefill both run it, so a
// prompt row's attention has the decode step's bits.
template <typename T>
__device__ SoftmaxPartial attend_split(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                       int64_t kv_len, int64_t kv_offset, int32_t head_dim,
                                       int32_t begin, int32_t count, int32_t kv_rows, float scale,
                                       SplitShared<T>* sh, float* acc_out) {
  const float* q_head = reinterpret_cast<const float*>(sh->q_head4);
  float* weights = sh->weights;
  const int lane = threadIdx.x % 32;
  const int n_warps = blockDim.x / 32;
  if constexpr (sizeof(T) == 2) {
    // f16 keys: a group of g lanes per position (the greatest power of two
    // up to head_dim / 8, so groups tile the warp), 16-byte loads.
    int g = 1;
    while (2 * g <= min(32, head_dim / 8)) g *= 2;
    const int per_warp = 32 / g;
    for (int32_t t0 = threadIdx.x / 32 * per_warp; t0 < count; t0 += n_warps * per_warp) {
      const int32_t t = t0 + lane / g;
      // Lanes past the split's end read its last key and drop the score.
      const uint16_t* key =
          k_cache + kv_cache_row(begin + min(t, count - 1), kv_rows) * kv_len + kv_offset;
      const float dot = key_dot_f16x8(q_head, key, head_dim, lane % g, g);
      if (lane % g == 0 && t < count) weights[t] = dot * scale;
    }
  } else {
    // A warp per position, lanes over head_dim.
    for (int32_t t = threadIdx.x / 32; t < count; t += n_warps) {
      const float* key = k_cache + kv_cache_row(begin + t, kv_rows) * kv_len + kv_offset;
      float dot = 0.0f;
      for (int32_t d = lane; d < head_dim; d += 32) dot += q_head[d] * key[d];
      dot = warp_sum(dot);
      if (lane == 0) weights[t] = dot * scale;
    }
  }
  __syncthreads();

  float local_max = -INFINITY;
  for (int32_t t = threadIdx.x; t < count; t += blockDim.x)
    local_max = fmaxf(local_max, weights[t]);
  const float max_score = block_max(local_max, sh->scratch);
  float local_sum = 0.0f;
  for (int32_t t = threadIdx.x; t < count; t += blockDim.x) {
    weights[t] = expf(weights[t] - max_score);
    local_sum += weights[t];
  }
  const float sum = block_sum(local_sum, sh->scratch);  // its barriers publish weights[]

  if constexpr (sizeof(T) == 2) {
    // f16 values: head_dim / 8 lanes own 8 dimensions each (16-byte loads), the
    // block's other groups of that many lanes take every groups-th position;
    // the groups' sums are added in group order.
    const int32_t lanes = head_dim / 8;
    const int32_t groups = static_cast<int32_t>(blockDim.x) / lanes;
    const int32_t group = static_cast<int32_t>(threadIdx.x) / lanes;
    const int32_t d0 = 8 * (static_cast<int32_t>(threadIdx.x) % lanes);
    if (group < groups) {
      float acc[8] = {};
      const uint16_t* value = v_cache + kv_offset + d0;
      for (int32_t t = group; t < count; t += groups) {
        const uint4 packed =
            *reinterpret_cast<const uint4*>(value + kv_cache_row(begin + t, kv_rows) * kv_len);
        const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
        for (int i = 0; i < 8; ++i) {
          acc[i] += weights[t] * f16_to_f32(static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2))));
        }
      }
      for (int i = 0; i < 8; ++i) sh->value_sums[group * head_dim + d0 + i] = acc[i];
    }
    __syncthreads();
    for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float acc = 0.0f;
      for (int32_t g = 0; g < groups; ++g) acc += sh->value_sums[g * head_dim + d];
      acc_out[d] = acc;
    }
  } else {
    // f32 values: a thread per dimension, positions in order (coalesced rows).
    for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
      const float* value = v_cache + kv_offset + d;
      float acc = 0.0f;
      for (int32_t t = 0; t < count; ++t) {
        acc += weights[t] * value[kv_cache_row(begin + t, kv_rows) * kv_len];
      }
      acc_out[d] = acc;
    }
  }
  __syncthreads();  // weights and value_sums are free for the next split
  return {max_score, sum};
}

// The head's q into sh->q_head4, published to the block.
template <typename T>
__device__ void load_q_head(const float* __restrict__ q, int32_t head_dim, SplitShared<T>* sh) {
  float* q_head = reinterpret_cast<float*>(sh->q_head4);
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) q_head[d] = q[d];
  __syncthreads();
}

// Partial of (head, split): [head_dim] acc, then max, then sum.
template <typename T>
__global__ void attention_split_kernel(const float* __restrict__ q, const T* __restrict__ k_cache,
                                       const T* __restrict__ v_cache,
                                       const int32_t* __restrict__ pos, int32_t n_head,
                                       int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                                       float scale, AttentionMask mask, float* __restrict__ partial,
                                       unsigned int* __restrict__ tickets,
                                       float* __restrict__ merged_out,
                                       block_q8_1* __restrict__ out_q) {
  wait_for_prior_grids();
  __shared__ SplitShared<T> sh;
  __shared__ EpilogueShared shared;
  const int32_t head = blockIdx.x;
  const int32_t split = blockIdx.y;
  float* out = partial + (static_cast<int64_t>(head) * gridDim.y + split) * (head_dim + 2);
  const LiveKeys keys(min(*pos + 1, max_ctx), mask.window);
  // The merge reads only the splits that ran.
  if (split < keys.first_split() || split >= keys.end_split()) return;
  const int32_t begin = keys.begin(split);
  const int32_t count = keys.count(split);
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t kv_offset = static_cast<int64_t>(head / (n_head / n_head_kv)) * head_dim;
  load_q_head(q + static_cast<int64_t>(head) * head_dim, head_dim, &sh);
  const SoftmaxPartial p = attend_split(k_cache, v_cache, kv_len, kv_offset, head_dim, begin, count,
                                        mask.kv_rows, scale, &sh, out);
  if (threadIdx.x == 0) {
    out[head_dim] = p.max;
    out[head_dim + 1] = p.sum;
  }
  const int lane = threadIdx.x % 32;

  // The head's last split merges the splits that ran, in order: a lane per
  // dimension, so when head_dim is a multiple of 32 a warp's lanes hold one
  // q8_1 block.
  const int32_t live = keys.end_split() - keys.first_split();
  if (!last_block_done(tickets + head, live, &shared)) return;
  const float* head_partial = partial + static_cast<int64_t>(head) * gridDim.y * (head_dim + 2);
  for (int32_t base = threadIdx.x / 32 * 32; base < head_dim; base += blockDim.x) {
    const int32_t d = base + lane;
    if (d < head_dim) {
      SoftmaxPartial state = initial_softmax(mask.sinks, head);
      float acc = 0.0f;
      for (int32_t s = keys.first_split(); s < keys.end_split(); ++s) {
        const float* p = head_partial + static_cast<int64_t>(s) * (head_dim + 2);
        float scale_state, scale_split;
        state = softmax_merge(state, {__ldcg(p + head_dim), __ldcg(p + head_dim + 1)},
                              &scale_state, &scale_split);
        acc = acc * scale_state + __ldcg(p + d) * scale_split;
      }
      merged_out[static_cast<int64_t>(head) * head_dim + d] = acc / state.sum;
    }
    if (out_q != nullptr && head_dim % QK8_1 == 0) {
      const int32_t i = head * head_dim + d;
      warp_quantize_q8_1(merged_out[i], out_q + i / QK8_1);
    }
  }
  // Heads narrower than a q8_1 block: the last head merged quantizes them all.
  if (out_q == nullptr || head_dim % QK8_1 == 0 ||
      !last_block_done(tickets + gridDim.x, gridDim.x, &shared)) {
    return;
  }
  const int32_t n = gridDim.x * head_dim;
  for (int32_t base = threadIdx.x / 32 * 32; base < n; base += blockDim.x) {
    const int32_t i = base + lane;
    warp_quantize_q8_1(__ldcg(merged_out + i), out_q + i / QK8_1);
  }
}

// Row `row` of a ubatch at position *pos0 + row against the cache rows 0..pos,
// split by split as the decode step's attention and merged in the same order,
// so each row's output has the decode step's bits at its position.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_prefill_kernel(const float* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const int32_t* __restrict__ pos0,
                             int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale,
                             AttentionMask mask, float* __restrict__ out) {
  wait_for_prior_grids();
  __shared__ SplitShared<T> sh;
  __shared__ float split_acc[kMaxHeadDim];
  const int32_t head = blockIdx.x;
  const int64_t row = blockIdx.y;
  const LiveKeys keys(*pos0 + static_cast<int32_t>(row) + 1, mask.window);
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t kv_offset = static_cast<int64_t>(head / (n_head / n_head_kv)) * head_dim;
  const int64_t at = (row * n_head + head) * head_dim;
  load_q_head(q + at, head_dim, &sh);
  constexpr int kDimsPerThread = kMaxHeadDim / kAttnThreads;
  float acc[kDimsPerThread] = {};
  SoftmaxPartial state = initial_softmax(mask.sinks, head);
  for (int32_t s = keys.first_split(); s < keys.end_split(); ++s) {
    const SoftmaxPartial p =
        attend_split(k_cache, v_cache, kv_len, kv_offset, head_dim, keys.begin(s), keys.count(s),
                     mask.kv_rows, scale, &sh, split_acc);
    float scale_state, scale_split;
    state = softmax_merge(state, p, &scale_state, &scale_split);
    for (int i = 0; i < kDimsPerThread; ++i) {
      const int32_t d = static_cast<int32_t>(threadIdx.x) + i * kAttnThreads;
      if (d < head_dim) acc[i] = acc[i] * scale_state + split_acc[d] * scale_split;
    }
  }
  for (int i = 0; i < kDimsPerThread; ++i) {
    const int32_t d = static_cast<int32_t>(threadIdx.x) + i * kAttnThreads;
    if (d < head_dim) out[at + d] = acc[i] / state.sum;
  }
}

}  // namespace

cudaError_t launch_embed(const DeviceMatrix& table, const int32_t* token, float* out,
                         const NormEpilogue& norm, cudaStream_t stream) {
  if (!table_ok(table) || token == nullptr || out == nullptr || !norm_epilogue_ok(norm, table.cols)) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_blocks = static_cast<int32_t>(table.cols / quant_block_elems(table.type));
  return launch_kernel<embed_kernel>(1, kThreads, stream, static_cast<const uint8_t*>(table.data),
                                     table.type, table.rows, table.row_bytes, n_blocks, token, out,
                                     norm);
}

cudaError_t launch_embed_rows(const DeviceMatrix& table, const int32_t* tokens, int32_t n_tokens,
                              float* out, cudaStream_t stream) {
  if (!table_ok(table) || tokens == nullptr || out == nullptr || n_tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_blocks = static_cast<int32_t>(table.cols / quant_block_elems(table.type));
  return launch_kernel<embed_kernel>(n_tokens, kThreads, stream,
                                     static_cast<const uint8_t*>(table.data), table.type,
                                     table.rows, table.row_bytes, n_blocks, tokens, out,
                                     NormEpilogue{});
}

size_t attention_partial_floats(int32_t n_head, int32_t head_dim, int32_t max_ctx) {
  return static_cast<size_t>(n_head) * attention_splits(max_ctx) * (head_dim + 2);
}

cudaError_t launch_attention_decode(const float* q, const void* k_cache, const void* v_cache,
                                    bool kv_f16, const int32_t* pos, int32_t n_head,
                                    int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                                    float scale, const AttentionMask& mask, float* partial,
                                    unsigned int* tickets, float* out, block_q8_1* out_q,
                                    cudaStream_t stream) {
  if (q == nullptr || !mask_ok(mask, 1) || k_cache == nullptr || v_cache == nullptr ||
      pos == nullptr || partial == nullptr || tickets == nullptr || out == nullptr || n_head <= 0 ||
      n_head_kv <= 0 || n_head % n_head_kv != 0 || head_dim <= 0 || head_dim > kMaxHeadDim ||
      max_ctx <= 0 || (out_q != nullptr && n_head * head_dim % QK8_1 != 0) ||
      (kv_f16 && (head_dim % 8 != 0 || reinterpret_cast<uintptr_t>(k_cache) % 16 != 0 ||
                  reinterpret_cast<uintptr_t>(v_cache) % 16 != 0))) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_splits = attention_splits(max_ctx);
  if (n_splits > kMaxGridY) return cudaErrorInvalidValue;
  const dim3 grid(n_head, n_splits);
  if (kv_f16) {
    return launch_kernel<attention_split_kernel<uint16_t>>(
        grid, kAttnThreads, stream, q, static_cast<const uint16_t*>(k_cache),
        static_cast<const uint16_t*>(v_cache), pos, n_head, n_head_kv, head_dim, max_ctx, scale,
        mask, partial, tickets, out, out_q);
  }
  return launch_kernel<attention_split_kernel<float>>(
      grid, kAttnThreads, stream, q, static_cast<const float*>(k_cache),
      static_cast<const float*>(v_cache), pos, n_head, n_head_kv, head_dim, max_ctx, scale, mask,
      partial, tickets, out, out_q);
}

cudaError_t launch_attention_prefill(const float* q, const void* k_cache, const void* v_cache,
                                     bool kv_f16, const int32_t* pos0, int32_t tokens,
                                     int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                                     float scale, const AttentionMask& mask, float* out,
                                     cudaStream_t stream) {
  if (q == nullptr || !mask_ok(mask, tokens) || k_cache == nullptr || v_cache == nullptr ||
      pos0 == nullptr || out == nullptr || tokens <= 0 || tokens > kMaxGridY || n_head <= 0 ||
      n_head_kv <= 0 || n_head % n_head_kv != 0 || head_dim <= 0 || head_dim > kMaxHeadDim ||
      (kv_f16 && (head_dim % 8 != 0 || reinterpret_cast<uintptr_t>(k_cache) % 16 != 0 ||
                  reinterpret_cast<uintptr_t>(v_cache) % 16 != 0))) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(n_head, tokens);
  if (kv_f16) {
    return launch_kernel<attention_prefill_kernel<uint16_t>>(
        grid, kAttnThreads, stream, q, static_cast<const uint16_t*>(k_cache),
        static_cast<const uint16_t*>(v_cache), pos0, n_head, n_head_kv, head_dim, scale, mask, out);
  }
  return launch_kernel<attention_prefill_kernel<float>>(
      grid, kAttnThreads, stream, q, static_cast<const float*>(k_cache),
      static_cast<const float*>(v_cache), pos0, n_head, n_head_kv, head_dim, scale, mask, out);
}

}  // namespace moegraph
