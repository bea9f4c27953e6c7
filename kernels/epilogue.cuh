// The last block of a launch finishes the op: every block publishes its writes
// (__threadfence) and takes a ticket from a counter in device memory; the block
// that draws the last ticket resets the counter for the next launch and runs
// the epilogue, reading the other blocks' writes through L2 (__ldcg). The
// epilogue is serial code in a fixed order, so its bits never depend on which
// block finished last (the emulator runs blocks in a random order to prove it).
// This is how the step fuses an op with the one after it without a launch (the
// RMSNorm after a residual add, top-k after the router, a head's QK-norm, RoPE
// and KV append after q/k, the attention merge of a KV head's query heads after
// their splits).
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

namespace moegraph {

// The shared memory of the functions below, declared by the kernel (a static
// in an inline function would be one per program, not per kernel, in the emulator).
struct EpilogueShared {
  float scratch[32];
  bool last;
  int32_t chosen[kMaxTopK];     // router top-k
  float chosen_value[kMaxTopK];  // their values (weight_value)
  // The router's top-k: its threads' bests, then its candidates; the k-th of
  // the bests; how many candidates.
  union alignas(16) {
    uint64_t ranked[kRouterThreads];  // rank_word
    float exps[kRouterThreads];       // before them, the softmax's exps in passing
  };
  uint64_t bound;
  int n_ranked;
};

// Every thread of the block calls it once its writes are done. True in the block
// that takes the last of `expected` tickets of *ticket (then zeroed again).
__device__ inline bool last_block_done(unsigned int* ticket, unsigned int expected,
                                       EpilogueShared* shared) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    shared->last = atomicAdd(ticket, 1u) == expected - 1;
    if (shared->last) *ticket = 0;
  }
  __syncthreads();
  const bool last = shared->last;
  __syncthreads();  // every thread has read it before a later call writes it
  if (last) __threadfence();
  return last;
}

// A norm's reads: thread t takes x[t + j blockDim.x]. The sum of squares loads
// kNormHeld of a thread's elements together (2048 at 128 threads in one L2
// round trip: the n_embd of the models the step is sized at; four at a time
// it took four), the output kNormRounds at a time with their weights, all of a
// round's loads before their first use, its q8_1 blocks reduced side by side
// (a block's warp reductions are chains of dependent shuffles). Keeping x for
// the output, in registers or in shared memory, would save its rounds their x
// loads but cost the matvec kernels that inline this registers, and so blocks
// an SM (ptxas: 40 -> 56 for the element types, 56 -> 64 for most quant
// types); so would asking the weights into L2 at the launch's start (and a
// spill). The weights' lines are asked into L1 before the sum: they come from
// DRAM (the step has streamed a layer of experts since they were last read),
// one round trip under the sum's instead of one a round. The order of every
// sum is the one-element-at-a-time order, so the bits are too
// (tools/gpusim-epilogue: the same output bits).
inline constexpr int kNormHeld = 16;
inline constexpr int kNormRounds = 4;

// The lines of a norm's weight[0, n) into this SM's L1, a line a thread.
__device__ __forceinline__ void prefetch_norm_weight([[maybe_unused]] const float* weight,
                                                     [[maybe_unused]] int32_t n) {
#if defined(__CUDA_ARCH__)
  constexpr int32_t kLineFloats = 32;  // a 128-byte line
  for (int32_t i = threadIdx.x * kLineFloats; i < n; i += blockDim.x * kLineFloats) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + i));
  }
#endif
}

// The sum of squares of thread t's elements of x[0, n) in index order, x read
// through L2 (other blocks of the launch may have written it), kNormHeld loads
// in flight at once.
__device__ __forceinline__ float thread_sum_of_squares(const float* x, int32_t n) {
  const int32_t stride = static_cast<int32_t>(blockDim.x);
  float sum_sq = 0.0f;
  for (int32_t first = threadIdx.x; first < n; first += kNormHeld * stride) {
    float v[kNormHeld];
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j) {
      const int32_t i = first + j * stride;
      v[j] = i < n ? __ldcg(x + i) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kNormHeld; ++j) {
      if (first + j * stride < n) sum_sq += v[j] * v[j];
    }
  }
  return sum_sq;
}

// RMSNorm's factor over x[0, n) by the whole block: thread t sums its elements
// in index order, then the block sums the threads'.
__device__ inline float block_rms_scale(const float* x, int32_t n, float eps,
                                        EpilogueShared* shared) {
  return rms_scale(block_sum(thread_sum_of_squares(x, n), shared->scratch), n, eps);
}

// out = x / rms(x) * weight over x[0, n) by the whole block, and out's q8_1
// blocks when out_q is set (n a multiple of 32, blockDim.x of 32). x is read
// through L2: other blocks of the launch may have written it.
__device__ inline void block_rmsnorm(const float* x, const float* __restrict__ weight, float* out,
                                     int32_t n, float eps, block_q8_1* __restrict__ out_q,
                                     EpilogueShared* shared) {
  prefetch_norm_weight(weight, n);
  const float scale = block_rms_scale(x, n, eps, shared);
  const int32_t stride = static_cast<int32_t>(blockDim.x);
  const int32_t lane = threadIdx.x % 32;
  // Warp w's lanes hold elements [32 (w + j * warps), + 32) in round j: one q8_1
  // block; an element past n loads element n - 1, is computed as zero and not
  // stored. A round's loads are all issued before any is used (a use between
  // them would wait for the one before it).
  for (int32_t first = threadIdx.x / 32 * 32; first < n; first += kNormRounds * stride) {
    float x_part[kNormRounds], w_part[kNormRounds];
#pragma unroll
    for (int j = 0; j < kNormRounds; ++j) {
      const int32_t i = min(first + j * stride + lane, n - 1);
      x_part[j] = __ldcg(x + i);
      w_part[j] = weight[i];
    }
    float v[kNormRounds], amax[kNormRounds], sum[kNormRounds];
#pragma unroll
    for (int j = 0; j < kNormRounds; ++j) {
      v[j] = first + j * stride + lane < n ? x_part[j] * scale * w_part[j] : 0.0f;
      amax[j] = fabsf(v[j]);
      sum[j] = v[j];
    }
    if (out_q == nullptr) {
#pragma unroll
      for (int j = 0; j < kNormRounds; ++j) {
        if (first + j * stride + lane < n) out[first + j * stride + lane] = v[j];
      }
      continue;
    }
    // warp_quantize_q8_1's two butterflies, the rounds' shuffles side by side.
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
      for (int j = 0; j < kNormRounds; ++j) {
        amax[j] = fmaxf(amax[j], __shfl_xor_sync(kFullMask, amax[j], offset));
        sum[j] += __shfl_xor_sync(kFullMask, sum[j], offset);
      }
    }
#pragma unroll
    for (int j = 0; j < kNormRounds; ++j) {
      const int32_t i = first + j * stride + lane;
      if (first + j * stride >= n) break;
      out[i] = v[j];
      block_q8_1* block = out_q + i / QK8_1;
      block->qs[lane] = q8_1_quant(v[j], amax[j]);
      if (lane == 0) q8_1_scales(amax[j], sum[j], block);
    }
  }
}

// Host side: a norm epilogue of n values is none, or has its output (q8_1
// blocks need n % 32 == 0).
inline bool norm_epilogue_ok(const NormEpilogue& norm, int64_t n) {
  return norm.weight == nullptr ||
         (norm.out != nullptr && (norm.out_q == nullptr || n % QK8_1 == 0));
}

// One head by the whole block, a thread per pair: src (read through L2) times
// scale * weight when weight is set (the QK-norm), rotated by the cosines and
// sines of its position (cos_sin: that position's row of fill_rope_table) into
// dst, or as f16 into dst_f16 (the other null).
// Only the first n_rot dimensions turn (pairs of them as rope_type pairs a head of
// n_rot); the rest are copied, as ggml's rope with n_dims < ne0.
__device__ inline void rope_head(const float* src, float scale, const float* __restrict__ weight,
                                 int32_t head_dim, int32_t n_rot, const float* cos_sin,
                                 int32_t rope_type, float* __restrict__ dst,
                                 uint16_t* __restrict__ dst_f16) {
  auto store = [&](int32_t d, float v) {
    if (dst_f16 != nullptr) {
      dst_f16[d] = f32_to_f16(v);
    } else {
      dst[d] = v;
    }
  };
  for (int32_t i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
    int32_t a, b;
    rope_pair_offsets(i, n_rot, rope_type, &a, &b);
    float x0 = __ldcg(src + a), x1 = __ldcg(src + b);
    if (weight != nullptr) {
      x0 = x0 * scale * weight[a];
      x1 = x1 * scale * weight[b];
    }
    rope_rotate_cs(&x0, &x1, cos_sin[2 * i], cos_sin[2 * i + 1]);
    store(a, x0);
    store(b, x1);
  }
  for (int32_t d = n_rot + threadIdx.x; d < head_dim; d += blockDim.x) {
    const float v = __ldcg(src + d);
    store(d, weight != nullptr ? v * scale * weight[d] : v);
  }
}

// Where head h of q (j 0) or k (1) starts in its projection's row: a gated
// q's heads are [query | gate].
__device__ inline int64_t rope_source_head(const QkvRope& rope, int j, int32_t h) {
  return static_cast<int64_t>(h) * rope.head_dim * (j == 0 && rope.q_gated ? 2 : 1);
}

// Head h of one token's q (j 0) or k (j 1) row src (read through L2), times
// scale * the QK-norm weight when rope.use_norm (a full-width norm's head h
// takes weight[h head_dim, + head_dim)), rotated at position p: q into
// q_out[h head_dim, ...), k into the k cache's row p, f32 or f16. The decode
// step's qkv epilogue and the prefill's rows both run it.
__device__ inline void rope_qk_head(const QkvRope& rope, int j, const float* src, float scale,
                                    int32_t h, int32_t p, float* __restrict__ q_out) {
  const int32_t d = rope.head_dim;
  const int64_t head = static_cast<int64_t>(h) * d;
  const int64_t k_at = kv_cache_row(p, rope.kv_rows) * rope.n_head_kv * d + head;
  const float* weight = nullptr;
  if (rope.use_norm) {
    weight = (j == 0 ? rope.norm.q_weight : rope.norm.k_weight) + (rope.norm.full ? head : 0);
  }
  float* dst = j == 0         ? q_out + head
               : rope.kv_f16 ? nullptr
                             : static_cast<float*>(rope.k_cache) + k_at;
  uint16_t* dst_f16 = j == 1 && rope.kv_f16 ? static_cast<uint16_t*>(rope.k_cache) + k_at : nullptr;
  const int32_t n_rot = rope.n_rot > 0 ? rope.n_rot : d;
  const float* cos_sin = rope.cos_sin + 2 * static_cast<int64_t>(p) * (n_rot / 2);
  rope_head(src + rope_source_head(rope, j, h), scale, weight, d, n_rot, cos_sin, rope.rope_type,
            dst, dst_f16);
}

// How many of ranked[0, n) precede e in top-k order: its rank among them.
// Every thread reads the same pair at once (a broadcast), eight loads before
// their compares.
__device__ inline int32_t count_preceding(const uint64_t* ranked, int32_t n, RankedExpert e) {
  constexpr int kBatch = 8;
  const uint64_t word = rank_word(e);
  int32_t count = 0;
  int32_t u = 0;
  for (; u + kBatch <= n; u += kBatch) {
    uint64_t batch[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) batch[j] = ranked[u + j];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) count += batch[j] < word;
  }
  for (; u < n; ++u) count += ranked[u] < word;
  return count;
}

// The router's top-k by the whole block (kRouterThreads threads, every one
// calls it), in a few block-wide steps instead of k rounds: thread t takes
// experts t, t + kRouterThreads, ... (router_topk_fits(n_expert, k)). Softmax
// as router_softmax (the same bits: the max over the block, the sum by warp 0
// in the host's lane order through shared memory); the probabilities are
// written over logits[0, n_expert) (read through L2: other blocks wrote them).
// Each thread's best (by key: value + score_bias, as topk_key) is ranked
// against the block's bests by counting the ones that precede it; with one
// expert a thread, that rank is the expert's. Otherwise the k-th best of the
// bests bounds the choice (every expert after it has k before it): the
// experts at or before it, at most k a thread, are gathered and ranked the
// same way. The choice is select_topk's, bit for bit; rank r's weight
// (topk_weight) and its replay are thread r's. experts/weights: [k], rank
// order. The logits are held in registers only while no division runs: a
// division (and the sigmoid's) is a call, and values live across a call cost
// the matvec instances that inline this a stack frame (kernel_shape_test);
// from the division on, a thread's loops take its experts one at a time
// through logits, where it wrote them (its first expert from its register).
__device__ inline void block_router_topk(float* logits, int32_t n_expert, const RouterEpilogue& r,
                                         int32_t* __restrict__ experts,
                                         float* __restrict__ weights, EpilogueShared* shared) {
  constexpr int kHeld = kMaxRouterExperts / kRouterThreads;
  constexpr int kWarps = kRouterThreads / 32;
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int held = (n_expert - t + kRouterThreads - 1) / kRouterThreads;  // this thread's
  auto expert = [&](int s) { return t + s * kRouterThreads; };
  float value[kHeld];
  float local_max = -INFINITY;
#pragma unroll
  for (int s = 0; s < kHeld; ++s) {
    value[s] = 0.0f;
    if (s < held) {
      value[s] = __ldcg(logits + expert(s));
      if (r.logit_bias != nullptr) value[s] += r.logit_bias[expert(s)];
      local_max = fmaxf(local_max, value[s]);
    }
  }
  float sum = 1.0f;
  if (r.gating == RouterGating::kSoftmax) {
    const float max_logit = block_max(local_max, shared->scratch);
    // router_softmax's lane l adds experts l, l + 32, ... in order: they pass
    // through exps a block's worth at a time, for warp 0 to add.
    float lane_sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kHeld; ++s) {
      if (s * kRouterThreads >= n_expert) break;
      value[s] = router_exp(value[s], max_logit);
      shared->exps[t] = value[s];
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          if (expert(s) + 32 * w < n_expert) lane_sum += shared->exps[lane + 32 * w];
        }
      }
      __syncthreads();
    }
    if (warp == 0) {
      lane_sum = warp_sum(lane_sum);
      if (lane == 0) shared->scratch[0] = lane_sum;
    }
    __syncthreads();
    sum = shared->scratch[0];
  }
#pragma unroll
  for (int s = 1; s < kHeld; ++s) {
    if (s < held) logits[expert(s)] = value[s];
  }
  // Expert i's pair for value v: a score bias chooses (v + bias, f32) but
  // does not weigh.
  auto pair = [&](int32_t i, float v) {
    return RankedExpert{i, topk_key(r.score_bias != nullptr ? v + r.score_bias[i] : v)};
  };
  RankedExpert best{INT32_MAX, topk_key(-INFINITY)};  // none: the idle pair of topk_precedes
  float best_value = 0.0f;
#pragma unroll 1
  for (int s = 0; s < held; ++s) {
    const int32_t i = expert(s);
    float v = s == 0 ? value[0] : logits[i];
    if (r.gating == RouterGating::kSoftmax) {
      v /= sum;
    } else if (r.gating == RouterGating::kSigmoid) {
      v = router_sigmoid(v);
    }
    logits[i] = v;
    const RankedExpert e = pair(i, v);
    if (e < best) {
      best = e;
      best_value = v;
    }
  }
  auto choose = [&](int32_t rank, int32_t index, float chosen_value) {
    if (rank < r.k) {
      shared->chosen[rank] = index;
      shared->chosen_value[rank] = chosen_value;
    }
  };
  if (t == 0) shared->n_ranked = 0;
  shared->ranked[t] = rank_word(best);
  __syncthreads();
  const int32_t rank = count_preceding(shared->ranked, kRouterThreads, best);
  if (n_expert <= kRouterThreads) {
    if (held > 0) choose(rank, best.index, best_value);
  } else {
    if (rank == r.k - 1) shared->bound = rank_word(best);
    __syncthreads();
    const uint64_t bound = shared->bound;
    __syncthreads();  // every thread has ranked its best before ranked is reused
#pragma unroll 1
    for (int s = 0; s < held; ++s) {
      const uint64_t word = rank_word(pair(expert(s), logits[expert(s)]));
      if (word <= bound) shared->ranked[atomicAdd(&shared->n_ranked, 1)] = word;
    }
    __syncthreads();
    const int32_t n_ranked = shared->n_ranked;
#pragma unroll 1
    for (int s = 0; s < held; ++s) {
      const float v = logits[expert(s)];
      const RankedExpert e = pair(expert(s), v);
      if (rank_word(e) <= bound) choose(count_preceding(shared->ranked, n_ranked, e), e.index, v);
    }
  }
  __syncthreads();
  if (t < r.k) {
    experts[t] = shared->chosen[t];
    weights[t] = topk_weight(shared->chosen_value, r.k, r.gating, r.norm_topk, r.scale, t);
    if (r.replay.ids != nullptr) replay_rank(r.replay, r.k, t, experts, weights);
  }
}

// The norm an op's last block runs on the op's output (NormEpilogue, kernels.h).
__device__ inline void run_norm_epilogue(const NormEpilogue& norm, const float* x, int32_t n,
                                         EpilogueShared* shared) {
  if (norm.weight != nullptr) {
    block_rmsnorm(x, norm.weight, norm.out, n, norm.eps, norm.out_q, shared);
  }
}

}  // namespace moegraph
