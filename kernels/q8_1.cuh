// q8_1 activations written by the kernel that produces them (rmsnorm, the
// attention merge, SwiGLU): a warp's 32 lanes hold one q8_1 block's 32 values
// (element 32 * block + lane), as ggml-cuda's quantize_q8_1 lays them out.
#pragma once

#include <math.h>

#include "kernels/mmvq_math.h"
#include "kernels/reduce.cuh"

namespace moegraph {

// Lane l holds v = x[32 * b + l]: writes out = block b, in quantize_q8_1_block's
// arithmetic. Every lane of the warp must call it.
__device__ inline void warp_quantize_q8_1(float v, block_q8_1* out) {
  const float amax = warp_max(fabsf(v));
  const float sum = warp_sum(v);
  out->qs[threadIdx.x % 32] = q8_1_quant(v, amax);
  if (threadIdx.x % 32 == 0) q8_1_scales(amax, sum, out);
}

}  // namespace moegraph
