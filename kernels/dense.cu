// Dense decode ops: embedding with the first RMSNorm and split-K decode
// attention (the matvecs are kernels/matvec.cu; the other norms, QK-norm, RoPE
// and the KV append are epilogues of the ops before them). Per-element
// math comes from the MG_HD headers (loader/quant.h, kernels/nn_math.h,
// kernels/mmvq_math.h); this file holds the indexing and launch geometry. The
// ops whose output a quantized matvec reads (the norms, the attention merge)
// write its q8_1 blocks too: a warp's lanes hold one block's 32 values.
//
// Attention runs one block per (column of query heads, split of kAttentionSplitPositions
// positions): a column is the query heads that share a KV head (GQA's group;
// more than kAttentionGroupHeads of them take several columns), so each split of K
// and V is read once for all of them. The grid is sized by max_ctx at capture
// and splits past the live length (*pos + 1, read on the device) exit at once.
// The last split of a column to finish merges its heads' splits
// (kernels/epilogue.cuh).
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/launch_geometry.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kKeyPositions = 2;    // keys a lane loads before it uses them
constexpr int kValuePositions = 8;  // value rows a thread loads before it uses them
constexpr int kMergeAhead = 8;      // splits whose partials the merge loads before it uses them
// A thread's elements of the [heads][head_dim] output of a split.
constexpr int kOutPerThread = kAttentionGroupHeads * kMaxHeadDim / kAttentionThreads;
constexpr int32_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y (attention splits)

// The keys a query at position length - 1 sees, [first, length), in splits
// first / kAttentionSplitPositions .. (length - 1) / kAttentionSplitPositions;
// split s covers [begin, begin + count). Decode and prefill both cut them so.
struct LiveKeys {
  int32_t first, length;
  __device__ LiveKeys(int32_t len, int32_t window)
      : first(window > 0 ? max(0, len - window) : 0), length(len) {}
  __device__ int32_t first_split() const { return first / kAttentionSplitPositions; }
  __device__ int32_t end_split() const {
    return (length + kAttentionSplitPositions - 1) / kAttentionSplitPositions;
  }
  __device__ int32_t begin(int32_t s) const { return max(s * kAttentionSplitPositions, first); }
  __device__ int32_t count(int32_t s) const {
    return min((s + 1) * kAttentionSplitPositions, length) - begin(s);
  }
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
// (the same floats as the CPU's dequantize_row). A step's embed (start.step
// set) starts the step: its token from the prompt or the last sample, its
// position. (The first layer's attn_norm is its projections' launch's.)
__global__ void embed_kernel(const uint8_t* __restrict__ table, GgmlType type, int32_t rows,
                             size_t row_bytes, int32_t n_blocks, const int32_t* __restrict__ token,
                             StepStart start, float* __restrict__ out) {
  wait_for_prior_grids();
  int32_t t;
  if (start.step != nullptr) {
    const int32_t s = *start.step;
    t = s < *start.n_prompt ? start.prompt[s] : *start.sampled;
    if (threadIdx.x == 0) *start.pos = s;
  } else {
    t = token[blockIdx.x];
  }
  if (t < 0 || t >= rows) return;
  const int64_t block_elems = quant_block_elems(type);
  out += static_cast<int64_t>(blockIdx.x) * n_blocks * block_elems;
  for (int32_t block = threadIdx.x; block < n_blocks; block += blockDim.x) {
    dequantize_block(type, table + t * row_bytes + block * quant_block_bytes(type),
                     out + block * block_elems);
  }
}

// How attend_split reads a cache of T: in chunks of kElems elements, each one
// load (f16: 16 bytes, 8 halves; f32: one float); a lane of the key phase reads
// up to kKeyChunks chunks of a key, a thread of the value phase up to
// kValueChunks chunks of a value row.
template <typename T>
struct KvChunk;

template <>
struct KvChunk<uint16_t> {
  static constexpr int kElems = 8;
  static constexpr int kKeyChunks = 4;
  static constexpr int kValueChunks = 1;
  using Raw = uint4;
  __device__ static Raw load(const uint16_t* p) { return *reinterpret_cast<const uint4*>(p); }
  __device__ static void widen(Raw raw, float* out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = f16_to_f32(static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2))));
    }
  }
  // q's 8 floats of a chunk (16-byte aligned in shared memory).
  __device__ static void load_q(const float* q, float* out) {
    const float4 a = reinterpret_cast<const float4*>(q)[0];
    const float4 b = reinterpret_cast<const float4*>(q)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  }
};

template <>
struct KvChunk<float> {
  static constexpr int kElems = 1;
  static constexpr int kKeyChunks = 8;
  static constexpr int kValueChunks = 2;
  using Raw = float;
  __device__ static Raw load(const float* p) { return *p; }
  __device__ static void widen(Raw raw, float* out) { out[0] = raw; }
  __device__ static void load_q(const float* q, float* out) { out[0] = *q; }
};

// The query heads of attention block column x: the n_head / n_head_kv heads
// that read one KV head (GQA's group), cut into as few blocks of at most
// kAttentionGroupHeads heads as they need, as evenly as they go (attention_columns
// on the host counts them): heads [first, first + count) of KV head kv.
struct HeadGroup {
  int32_t kv, first, count;
  __device__ HeadGroup(int32_t x, int32_t n_head, int32_t n_head_kv) {
    const int32_t group = n_head / n_head_kv;
    const int32_t blocks = (group + kAttentionGroupHeads - 1) / kAttentionGroupHeads;
    const int32_t per_block = (group + blocks - 1) / blocks;
    kv = x / blocks;
    first = kv * group + x % blocks * per_block;
    count = min(per_block, (kv + 1) * group - first);
  }
};

// A block's shared memory for one split (declared by the kernel: see
// kernels/epilogue.cuh).
template <typename T>
struct SplitShared {
  float4 q4[kAttentionGroupHeads * kMaxHeadDim / 4];  // the heads' q, [head][head_dim]
  // Scores, then weights: [position][head].
  float4 weights4[kAttentionSplitPositions * kAttentionGroupHeads / 4];
  // The value phase's sums, [group][head][head_dim]: groups * head_dim is at most
  // 8 * kAttentionThreads for f16 (8 dimensions a thread), 2 * kAttentionThreads for f32.
  float value_sums[kAttentionGroupHeads * kAttentionThreads * KvChunk<T>::kElems *
                   KvChunk<T>::kValueChunks];
  float head_max[kAttentionGroupHeads], head_sum[kAttentionGroupHeads];
};
static_assert(kAttentionGroupHeads == 8,
              "the value phase reads a position's weights as two float4");

// The softmax partials of n_q query heads (sh->q4, written and published by the
// caller) against cache rows [begin, begin + count) of the KV head they share,
// each key and value read once for all of them: head h's max and sum into
// sh->head_max[h] and sh->head_sum[h], its weighted values into acc: element i
// of [n_q][head_dim] in acc[k] of thread i % kAttentionThreads, k = i / kAttentionThreads.
// Every sum has one order, whatever n_q and whichever lanes run first. Decode
// and prefill both run it, so a prompt row's attention has the decode step's
// bits.
template <typename T>
__device__ void attend_split(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                             int64_t kv_len, int64_t kv_offset, int32_t head_dim, int32_t n_q,
                             int32_t begin, int32_t count, int32_t kv_rows, float scale,
                             SplitShared<T>* sh, float (&acc)[kOutPerThread]) {
  using Kv = KvChunk<T>;
  constexpr int E = Kv::kElems;
  constexpr int n_warps = kAttentionThreads / 32;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const float* q = reinterpret_cast<const float*>(sh->q4);
  float* weights = reinterpret_cast<float*>(sh->weights4);
  const int32_t n_chunks = head_dim / E;

  // Scores: a key by g lanes (the least power of two whose kKeyChunks chunks
  // each cover it), lane `part` reading chunks part, part + g, ...; each lane
  // loads kKeyPositions keys before it uses them, widens each element once and
  // dots it with every head's q; each dot's lanes are summed by butterfly.
  int g = 1;
  while (g * Kv::kKeyChunks < n_chunks) g *= 2;
  const int per_warp = 32 / g;
  const int part = lane % g;
  const int32_t stride = n_warps * per_warp;  // positions between a lane's keys
  for (int32_t base = 0; base < count; base += kKeyPositions * stride) {
    typename Kv::Raw raw[kKeyPositions][Kv::kKeyChunks] = {};
    int32_t t[kKeyPositions];
#pragma unroll
    for (int u = 0; u < kKeyPositions; ++u) {
      t[u] = base + u * stride + warp * per_warp + lane / g;
      // Lanes past the split's end read its last key and drop the score.
      const T* key =
          k_cache + kv_cache_row(begin + min(t[u], count - 1), kv_rows) * kv_len + kv_offset;
#pragma unroll
      for (int j = 0; j < Kv::kKeyChunks; ++j) {
        const int32_t c = j * g + part;
        if (c < n_chunks) raw[u][j] = Kv::load(key + c * E);
      }
    }
    float dot[kAttentionGroupHeads][kKeyPositions] = {};
#pragma unroll
    for (int j = 0; j < Kv::kKeyChunks; ++j) {
      const int32_t c = j * g + part;
      if (c >= n_chunks) break;
      float k[kKeyPositions][E];
#pragma unroll
      for (int u = 0; u < kKeyPositions; ++u) Kv::widen(raw[u][j], k[u]);
#pragma unroll
      for (int h = 0; h < kAttentionGroupHeads; ++h) {
        if (h >= n_q) break;
        float qc[E];
        Kv::load_q(q + h * head_dim + c * E, qc);
#pragma unroll
        for (int e = 0; e < E; ++e) {
#pragma unroll
          for (int u = 0; u < kKeyPositions; ++u) dot[h][u] += qc[e] * k[u][e];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kAttentionGroupHeads; ++h) {
      if (h >= n_q) break;
#pragma unroll
      for (int u = 0; u < kKeyPositions; ++u) {
        const float score = group_sum(dot[h][u], g);
        if (part == 0 && t[u] < count) weights[t[u] * kAttentionGroupHeads + h] = score * scale;
      }
    }
  }
  __syncthreads();

  // Softmax: a warp per head.
  for (int32_t h = warp; h < n_q; h += n_warps) {
    float local_max = -INFINITY;
    for (int32_t t = lane; t < count; t += 32)
      local_max = fmaxf(local_max, weights[t * kAttentionGroupHeads + h]);
    const float max_score = warp_max(local_max);
    float local_sum = 0.0f;
    for (int32_t t = lane; t < count; t += 32) {
      const float w = expf(weights[t * kAttentionGroupHeads + h] - max_score);
      weights[t * kAttentionGroupHeads + h] = w;
      local_sum += w;
    }
    const float sum = warp_sum(local_sum);
    if (lane == 0) {
      sh->head_max[h] = max_score;
      sh->head_sum[h] = sum;
    }
  }
  __syncthreads();

  // Values: a row by `lanes` threads, thread `part` of them reading chunks
  // part, part + lanes, ...; the block's groups of them take every groups-th
  // position, each loading kValuePositions rows before it uses them, widening
  // each element once for every head. The groups' sums are added in group order.
  const int32_t lanes = min(n_chunks, kAttentionThreads);
  const int32_t groups = kAttentionThreads / lanes;
  const int32_t group = static_cast<int32_t>(threadIdx.x) / lanes;
  const int32_t value_part = static_cast<int32_t>(threadIdx.x) % lanes;
  const int32_t n = n_q * head_dim;
  if (group < groups) {
    float values[kAttentionGroupHeads][Kv::kValueChunks * E] = {};
    for (int32_t t0 = group; t0 < count; t0 += kValuePositions * groups) {
      typename Kv::Raw raw[kValuePositions][Kv::kValueChunks] = {};
#pragma unroll
      for (int u = 0; u < kValuePositions; ++u) {
        const int32_t t = t0 + u * groups;
        if (t >= count) break;
        const T* row = v_cache + kv_cache_row(begin + t, kv_rows) * kv_len + kv_offset;
#pragma unroll
        for (int j = 0; j < Kv::kValueChunks; ++j) {
          const int32_t c = value_part + j * lanes;
          if (c < n_chunks) raw[u][j] = Kv::load(row + c * E);
        }
      }
#pragma unroll
      for (int u = 0; u < kValuePositions; ++u) {
        const int32_t t = t0 + u * groups;
        if (t >= count) break;
        const float4 lo = sh->weights4[2 * t];
        const float4 hi = sh->weights4[2 * t + 1];
        const float w[kAttentionGroupHeads] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < Kv::kValueChunks; ++j) {
          if (value_part + j * lanes >= n_chunks) break;
          float v[E];
          Kv::widen(raw[u][j], v);
#pragma unroll
          for (int h = 0; h < kAttentionGroupHeads; ++h) {
            if (h >= n_q) break;
#pragma unroll
            for (int e = 0; e < E; ++e) values[h][j * E + e] += w[h] * v[e];
          }
        }
      }
    }
    float* sums = sh->value_sums + group * n;
#pragma unroll
    for (int h = 0; h < kAttentionGroupHeads; ++h) {
      if (h >= n_q) break;
#pragma unroll
      for (int j = 0; j < Kv::kValueChunks; ++j) {
        const int32_t c = value_part + j * lanes;
        if (c >= n_chunks) break;
#pragma unroll
        for (int e = 0; e < E; ++e) sums[h * head_dim + c * E + e] = values[h][j * E + e];
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int32_t i = static_cast<int32_t>(threadIdx.x) + k * kAttentionThreads;
    float sum = 0.0f;
    if (i < n) {
      for (int32_t gr = 0; gr < groups; ++gr) sum += sh->value_sums[gr * n + i];
    }
    acc[k] = sum;
  }
  __syncthreads();  // weights and value_sums are free for the next split
}

// The n floats of a block's heads' q into sh->q4, published to the block.
template <typename T>
__device__ void load_q_heads(const float* __restrict__ q, int32_t n, SplitShared<T>* sh) {
  float* dst = reinterpret_cast<float*>(sh->q4);
  for (int32_t i = threadIdx.x; i < n; i += kAttentionThreads) dst[i] = q[i];
  __syncthreads();
}

// A split's weighted value x into a head's running value, by the scales its
// softmax_merge gave (decode's merge and the prefill both, in split order).
__device__ __forceinline__ float merged_value(float value, float x, float scale_state,
                                              float scale_split) {
  return value * scale_state + x * scale_split;
}

// What element e of head row `head` (of a ubatch's rows of n_head: row t's
// head h is t n_head + h) is multiplied by: sigmoid of its gate (gated
// attention), else 1.
__device__ __forceinline__ float output_gate(const AttentionMask& mask, int64_t head, int32_t e,
                                             int32_t head_dim) {
  return mask.gate == nullptr ? 1.0f : sigmoid(mask.gate[(2 * head + 1) * head_dim + e]);
}

// Partials of (query head, split), each [head_dim] weighted values, then max,
// then sum; the last split of a block column to finish merges its heads.
template <typename T>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_split_kernel(const float* __restrict__ q, const T* __restrict__ k_cache,
                           const T* __restrict__ v_cache, const int32_t* __restrict__ pos,
                           int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                           float scale, AttentionMask mask, float* __restrict__ partial,
                           unsigned int* __restrict__ tickets, float* __restrict__ merged_out,
                           block_q8_1* __restrict__ out_q) {
  wait_for_prior_grids();
  __shared__ SplitShared<T> sh;
  __shared__ EpilogueShared shared;
  const HeadGroup heads(blockIdx.x, n_head, n_head_kv);
  const int32_t split = blockIdx.y;
  const LiveKeys keys(min(*pos + 1, max_ctx), mask.window);
  // The merge reads only the splits that ran.
  if (split < keys.first_split() || split >= keys.end_split()) return;
  const int32_t n = heads.count * head_dim;
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t kv_offset = static_cast<int64_t>(heads.kv) * head_dim;
  const int64_t first_at = static_cast<int64_t>(heads.first) * head_dim;
  // Head heads.first + h's partial of split s.
  auto record = [&](int32_t h, int32_t s) {
    return partial + (static_cast<int64_t>(heads.first + h) * gridDim.y + s) * (head_dim + 2);
  };
  load_q_heads(q + first_at, n, &sh);
  float acc[kOutPerThread];
  attend_split(k_cache, v_cache, kv_len, kv_offset, head_dim, heads.count, keys.begin(split),
               keys.count(split), mask.kv_rows, scale, &sh, acc);
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int32_t i = static_cast<int32_t>(threadIdx.x) + k * kAttentionThreads;
    if (i < n) record(i / head_dim, split)[i % head_dim] = acc[k];
  }
  if (static_cast<int32_t>(threadIdx.x) < heads.count) {
    float* out = record(threadIdx.x, split);
    out[head_dim] = sh.head_max[threadIdx.x];
    out[head_dim + 1] = sh.head_sum[threadIdx.x];
  }
  const int lane = threadIdx.x % 32;

  // The column's last split merges the splits that ran, in order, loading
  // kMergeAhead splits' partials before it uses them: a lane per element of
  // [count][head_dim], so when head_dim is a multiple of 32 a warp's lanes hold
  // one q8_1 block.
  const int32_t live = keys.end_split() - keys.first_split();
  if (!last_block_done(tickets + blockIdx.x, live, &shared)) return;
  for (int32_t base = threadIdx.x / 32 * 32; base < n; base += kAttentionThreads) {
    const int32_t i = base + lane;
    if (i < n) {
      const int32_t h = i / head_dim;
      const int32_t d = i % head_dim;
      SoftmaxPartial state = initial_softmax(mask.sinks, heads.first + h);
      float value = 0.0f;
      for (int32_t s0 = keys.first_split(); s0 < keys.end_split(); s0 += kMergeAhead) {
        float maxes[kMergeAhead] = {}, sums[kMergeAhead] = {}, xs[kMergeAhead] = {};
#pragma unroll
        for (int u = 0; u < kMergeAhead; ++u) {
          if (s0 + u >= keys.end_split()) break;
          const float* p = record(h, s0 + u);
          maxes[u] = __ldcg(p + head_dim);
          sums[u] = __ldcg(p + head_dim + 1);
          xs[u] = __ldcg(p + d);
        }
#pragma unroll
        for (int u = 0; u < kMergeAhead; ++u) {
          if (s0 + u >= keys.end_split()) break;
          float scale_state, scale_split;
          state = softmax_merge(state, {maxes[u], sums[u]}, &scale_state, &scale_split);
          value = merged_value(value, xs[u], scale_state, scale_split);
        }
      }
      merged_out[first_at + i] = value / state.sum * output_gate(mask, heads.first + h, d, head_dim);
    }
    if (out_q != nullptr && head_dim % QK8_1 == 0) {
      const int64_t at = first_at + i;
      warp_quantize_q8_1(merged_out[at], out_q + at / QK8_1);
    }
  }
  // Heads narrower than a q8_1 block: the last column merged quantizes them all.
  if (out_q == nullptr || head_dim % QK8_1 == 0 ||
      !last_block_done(tickets + gridDim.x, gridDim.x, &shared)) {
    return;
  }
  const int32_t n_out = n_head * head_dim;
  for (int32_t base = threadIdx.x / 32 * 32; base < n_out; base += kAttentionThreads) {
    const int32_t i = base + lane;
    warp_quantize_q8_1(__ldcg(merged_out + i), out_q + i / QK8_1);
  }
}

// Row `row` of a ubatch at position *pos0 + row against the cache rows 0..pos,
// a block per (column of heads, row), split by split as the decode step's
// attention and merged in the same order, so each row's output has the decode
// step's bits at its position.
template <typename T>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_prefill_kernel(const float* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const int32_t* __restrict__ pos0,
                             int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale,
                             AttentionMask mask, float* __restrict__ out) {
  wait_for_prior_grids();
  __shared__ SplitShared<T> sh;
  // Each head's merged state and the scales of its last merge, by thread h.
  __shared__ SoftmaxPartial state[kAttentionGroupHeads];
  __shared__ float scale_state[kAttentionGroupHeads], scale_split[kAttentionGroupHeads];
  const HeadGroup heads(blockIdx.x, n_head, n_head_kv);
  const int64_t row = blockIdx.y;
  const LiveKeys keys(*pos0 + static_cast<int32_t>(row) + 1, mask.window);
  const int32_t n = heads.count * head_dim;
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t kv_offset = static_cast<int64_t>(heads.kv) * head_dim;
  const int64_t at = (row * n_head + heads.first) * head_dim;
  const int32_t h_own = threadIdx.x;
  if (h_own < heads.count) state[h_own] = initial_softmax(mask.sinks, heads.first + h_own);
  load_q_heads(q + at, n, &sh);  // its barrier publishes state too
  float acc[kOutPerThread] = {};
  for (int32_t s = keys.first_split(); s < keys.end_split(); ++s) {
    float split_acc[kOutPerThread];
    attend_split(k_cache, v_cache, kv_len, kv_offset, head_dim, heads.count, keys.begin(s),
                 keys.count(s), mask.kv_rows, scale, &sh, split_acc);
    if (h_own < heads.count) {
      state[h_own] = softmax_merge(state[h_own], {sh.head_max[h_own], sh.head_sum[h_own]},
                                   &scale_state[h_own], &scale_split[h_own]);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kOutPerThread; ++k) {
      const int32_t i = static_cast<int32_t>(threadIdx.x) + k * kAttentionThreads;
      if (i < n) {
        const int32_t h = i / head_dim;
        acc[k] = merged_value(acc[k], split_acc[k], scale_state[h], scale_split[h]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int32_t i = static_cast<int32_t>(threadIdx.x) + k * kAttentionThreads;
    if (i < n) {
      const int32_t h = i / head_dim;
      out[at + i] = acc[k] / state[h].sum *
                    output_gate(mask, row * n_head + heads.first + h,
                                i % head_dim, head_dim);
    }
  }
}

}  // namespace

cudaError_t launch_embed_step(const DeviceMatrix& table, const StepStart& start, float* out,
                              cudaStream_t stream) {
  if (!table_ok(table) || start.prompt == nullptr || start.n_prompt == nullptr ||
      start.sampled == nullptr || start.step == nullptr || start.pos == nullptr ||
      out == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_blocks = static_cast<int32_t>(table.cols / quant_block_elems(table.type));
  const LaunchGeometry g = embed_launch_geometry();
  return launch_kernel<embed_kernel>(g.grid, g.block, stream,
                                     static_cast<const uint8_t*>(table.data), table.type,
                                     table.rows, table.row_bytes, n_blocks, nullptr, start, out);
}

cudaError_t launch_embed_rows(const DeviceMatrix& table, const int32_t* tokens, int32_t n_tokens,
                              float* out, cudaStream_t stream) {
  if (!table_ok(table) || tokens == nullptr || out == nullptr || n_tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  const int32_t n_blocks = static_cast<int32_t>(table.cols / quant_block_elems(table.type));
  return launch_kernel<embed_kernel>(n_tokens, kEmbedThreads, stream,
                                     static_cast<const uint8_t*>(table.data), table.type,
                                     table.rows, table.row_bytes, n_blocks, tokens, StepStart{},
                                     out);
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
  const LaunchGeometry g = attention_decode_launch_geometry(n_head, n_head_kv, max_ctx);
  if (g.grid.y > kMaxGridY) return cudaErrorInvalidValue;
  if (kv_f16) {
    return launch_kernel<attention_split_kernel<uint16_t>>(
        g.grid, g.block, stream, q, static_cast<const uint16_t*>(k_cache),
        static_cast<const uint16_t*>(v_cache), pos, n_head, n_head_kv, head_dim, max_ctx, scale,
        mask, partial, tickets, out, out_q);
  }
  return launch_kernel<attention_split_kernel<float>>(
      g.grid, g.block, stream, q, static_cast<const float*>(k_cache),
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
  const dim3 grid(attention_columns(n_head, n_head_kv), tokens);
  if (kv_f16) {
    return launch_kernel<attention_prefill_kernel<uint16_t>>(
        grid, kAttentionThreads, stream, q, static_cast<const uint16_t*>(k_cache),
        static_cast<const uint16_t*>(v_cache), pos0, n_head, n_head_kv, head_dim, scale, mask, out);
  }
  return launch_kernel<attention_prefill_kernel<float>>(
      grid, kAttentionThreads, stream, q, static_cast<const float*>(k_cache),
      static_cast<const float*>(v_cache), pos0, n_head, n_head_kv, head_dim, scale, mask, out);
}

}  // namespace moegraph
