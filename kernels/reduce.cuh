// Warp and block reductions for the kernels. Block versions need blockDim.x a
// multiple of 32 (at most 1024), must be reached by every thread of the block,
// and return the result to every thread. `scratch` is shared memory of 32
// elements; a block reduction ends with a barrier, so the scratch can be reused.
#pragma once

#include <cstdint>

#include "kernels/moe_math.h"

namespace moegraph {

inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ inline double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Top-k order (topk_precedes) of (value, index): the butterfly leaves every lane
// with the same best pair, since the order is total.
__device__ inline void warp_best(float* value, int32_t* index) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_value = __shfl_xor_sync(kFullMask, *value, offset);
    const int32_t other_index = __shfl_xor_sync(kFullMask, *index, offset);
    if (topk_precedes(other_value, other_index, *value, *index)) {
      *value = other_value;
      *index = other_index;
    }
  }
}

// Least (rank, slot) pair, lexicographic.
__device__ inline void warp_argmin(unsigned long long* rank, int32_t* slot) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other_rank = __shfl_xor_sync(kFullMask, *rank, offset);
    const int32_t other_slot = __shfl_xor_sync(kFullMask, *slot, offset);
    if (other_rank < *rank || (other_rank == *rank && other_slot < *slot)) {
      *rank = other_rank;
      *slot = other_slot;
    }
  }
}

__device__ inline float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

__device__ inline double block_sum(double v, double* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

__device__ inline float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  v = warp_max(v);
  __syncthreads();
  return v;
}

// Block-wide warp_best; an idle thread passes (-inf, INT32_MAX).
__device__ inline void block_best(float* value, int32_t* index, float* value_scratch,
                                  int32_t* index_scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  warp_best(value, index);
  if (lane == 0) {
    value_scratch[warp] = *value;
    index_scratch[warp] = *index;
  }
  __syncthreads();
  *value = lane < n_warps ? value_scratch[lane] : -INFINITY;
  *index = lane < n_warps ? index_scratch[lane] : INT32_MAX;
  warp_best(value, index);
  __syncthreads();
}

// Block-wide warp_argmin; an idle thread passes (~0, INT32_MAX).
__device__ inline void block_argmin(unsigned long long* rank, int32_t* slot,
                                    unsigned long long* rank_scratch, int32_t* slot_scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  warp_argmin(rank, slot);
  if (lane == 0) {
    rank_scratch[warp] = *rank;
    slot_scratch[warp] = *slot;
  }
  __syncthreads();
  *rank = lane < n_warps ? rank_scratch[lane] : ~0ull;
  *slot = lane < n_warps ? slot_scratch[lane] : INT32_MAX;
  warp_argmin(rank, slot);
  __syncthreads();
}

}  // namespace moegraph
