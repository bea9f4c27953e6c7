// Arithmetic that gives the same bits on the host and on the device, for the
// decisions both backends must agree on (sampling, the router's softmax and
// weights, a warp's sum): an exp written out as a fixed polynomial, every
// fusable multiply-add an explicit fmaf, and sums of a fixed shape. Light: .cu
// files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "loader/host_device.h"
#include "loader/quant.h"

namespace moegraph {

// e^x for x <= 0: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial
// (about 1 ulp), every fusable step an explicit fmaf. Below -87 (where e^x nears
// the subnormals) it is 0; NaN stays NaN.
MG_HD_INLINE float exp_nonpositive(float x) {
  if (!(x >= -87.0f)) return x != x ? x : 0.0f;
  const float n = rintf(x * 1.44269504089f);  // x / ln 2
  float r = fmaf(-n, 0.693359375f, x);        // ln 2 in two parts, the first exact
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float r2 = r * r;
  const float y = fmaf(p, r2, r) + 1.0f;
  // 2^n as bits (n >= -126 here, so the product is a normal float, exact).
  return y * f32_from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// The butterfly sum of v[0..n) (n a power of two, at most 32): after the rounds
// for offsets n/2, ..., 1, every lane holds the same value (a + b == b + a); this
// is lane 0's, which is what a warp's __shfl_xor_sync reduction of these lanes
// leaves everywhere. v is overwritten.
MG_HD_INLINE float butterfly_sum(float* v, int n) {
  for (int offset = n / 2; offset > 0; offset >>= 1) {
    float next[32];
    for (int lane = 0; lane < n; ++lane) next[lane] = v[lane] + v[lane ^ offset];
    for (int lane = 0; lane < n; ++lane) v[lane] = next[lane];
  }
  return v[0];
}

}  // namespace moegraph
