// Warp and block reductions for the kernels. Block versions need blockDim.x a
// multiple of 32 (at most 1024), must be reached by every thread of the block,
// and return the result to every thread. `scratch` is shared memory of 32
// elements; a block reduction ends with a barrier, so the scratch can be reused.
#pragma once

#include <cstdint>

#include "kernels/moe_math.h"

namespace moegraph {

inline constexpr unsigned kFullMask = 0xffffffffu;

namespace reduce_detail {

struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Top-k order (topk_precedes) of (value, index).
struct TopkFirst {
  __device__ bool operator()(float value, int32_t index, float other_value,
                             int32_t other_index) const {
    return topk_precedes(value, index, other_value, other_index);
  }
};

// Lexicographic order of (rank, slot).
struct LeastFirst {
  __device__ bool operator()(unsigned long long rank, int32_t slot, unsigned long long other_rank,
                             int32_t other_slot) const {
    return rank < other_rank || (rank == other_rank && slot < other_slot);
  }
};

// The butterfly: every lane ends with op over all 32 lanes.
template <typename T, typename Op>
__device__ inline T warp_reduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Each warp reduces, lane 0 of each leaves its result in scratch, then every warp
// reduces those; lanes past the last warp bring `idle`.
template <typename T, typename Op>
__device__ inline T block_reduce(T v, T idle, T* scratch, Op op) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  v = warp_reduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : idle;
  v = warp_reduce(v, op);
  __syncthreads();
  return v;
}

// The pair (key, index) that comes first in `first`'s order, which is total, so
// the butterfly leaves every lane with the same pair.
template <typename Key, typename Order>
__device__ inline void warp_first(Key* key, int32_t* index, Order first) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Key other_key = __shfl_xor_sync(kFullMask, *key, offset);
    const int32_t other_index = __shfl_xor_sync(kFullMask, *index, offset);
    if (first(other_key, other_index, *key, *index)) {
      *key = other_key;
      *index = other_index;
    }
  }
}

// block_reduce for pairs; lanes past the last warp bring (idle_key, INT32_MAX).
template <typename Key, typename Order>
__device__ inline void block_first(Key* key, int32_t* index, Key* key_scratch,
                                   int32_t* index_scratch, Key idle_key, Order first) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  warp_first(key, index, first);
  if (lane == 0) {
    key_scratch[warp] = *key;
    index_scratch[warp] = *index;
  }
  __syncthreads();
  *key = lane < n_warps ? key_scratch[lane] : idle_key;
  *index = lane < n_warps ? index_scratch[lane] : INT32_MAX;
  warp_first(key, index, first);
  __syncthreads();
}

}  // namespace reduce_detail

__device__ inline float warp_sum(float v) {
  return reduce_detail::warp_reduce(v, reduce_detail::Sum{});
}

// The butterfly within aligned groups of `width` lanes (a power of two, at most
// 32): every lane ends with its group's sum, added in butterfly_sum's order
// (kernels/mmvq_math.h). Every lane of the warp must call it.
__device__ inline float group_sum(float v, int width) {
  for (int offset = width / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ inline float warp_max(float v) {
  return reduce_detail::warp_reduce(v, reduce_detail::Max{});
}

// Least (rank, slot) pair, lexicographic.
__device__ inline void warp_argmin(unsigned long long* rank, int32_t* slot) {
  reduce_detail::warp_first(rank, slot, reduce_detail::LeastFirst{});
}

__device__ inline float block_sum(float v, float* scratch) {
  return reduce_detail::block_reduce(v, 0.0f, scratch, reduce_detail::Sum{});
}

__device__ inline int32_t block_sum(int32_t v, int32_t* scratch) {
  return reduce_detail::block_reduce(v, 0, scratch, reduce_detail::Sum{});
}

__device__ inline float block_max(float v, float* scratch) {
  return reduce_detail::block_reduce(v, -INFINITY, scratch, reduce_detail::Max{});
}

// The best (value, index) pair of the block in top-k order (topk_precedes); an
// idle thread passes (-inf, INT32_MAX).
__device__ inline void block_best(float* value, int32_t* index, float* value_scratch,
                                  int32_t* index_scratch) {
  reduce_detail::block_first(value, index, value_scratch, index_scratch, -INFINITY,
                             reduce_detail::TopkFirst{});
}

// Block-wide warp_argmin; an idle thread passes (~0, INT32_MAX).
__device__ inline void block_argmin(unsigned long long* rank, int32_t* slot,
                                    unsigned long long* rank_scratch, int32_t* slot_scratch) {
  reduce_detail::block_first(rank, slot, rank_scratch, slot_scratch, ~0ull,
                             reduce_detail::LeastFirst{});
}

}  // namespace moegraph
