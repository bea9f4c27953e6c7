// Per-element math of the dense decode ops (activations, RMSNorm, RoPE, the
// split-K softmax merge), shared by the kernels and the CPU tests. Light: .cu
// files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "loader/host_device.h"

namespace moegraph {

MG_HD inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// x * sigmoid(x).
MG_HD inline float silu(float x) { return x / (1.0f + expf(-x)); }

// RMSNorm's factor for a row of n values whose squares sum to sum_sq.
MG_HD inline float rms_scale(float sum_sq, int32_t n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}

// RoPE rotation types, as ggml numbers them for the kernels' rope_type.
inline constexpr int32_t kRopeNorm = 0;  // pairs (x[2i], x[2i + 1])
inline constexpr int32_t kRopeNeox = 1;  // pairs (x[i], x[i + head_dim / 2])

// Offsets inside a head of the two elements of pair i.
MG_HD inline void rope_pair_offsets(int32_t i, int32_t head_dim, int32_t rope_type, int32_t* a,
                                    int32_t* b) {
  if (rope_type == kRopeNorm) {
    *a = 2 * i;
    *b = 2 * i + 1;
  } else {
    *a = i;
    *b = i + head_dim / 2;
  }
}

// Angle of pair i at pos: pos * freq_base^(-2i / head_dim), in f64 as the
// oracle computes it (ggml's theta_scale^i in closed form).
MG_HD inline double rope_theta(int32_t pos, int32_t i, int32_t head_dim, float freq_base) {
  return static_cast<double>(pos) *
         pow(static_cast<double>(freq_base), -2.0 * i / static_cast<double>(head_dim));
}

// Rotates (*a, *b) by theta, in f64, rounded once to f32.
MG_HD inline void rope_rotate(float* a, float* b, double theta) {
  const double c = cos(theta);
  const double s = sin(theta);
  const double x0 = *a;
  const double x1 = *b;
  *a = static_cast<float>(x0 * c - x1 * s);
  *b = static_cast<float>(x0 * s + x1 * c);
}

// Softmax state of a set of scores: their max and sum(exp(score - max)). The
// weighted values travel separately as acc = sum(exp(score - max) * v). An empty
// set is {-inf, 0} with acc 0, and merging it changes nothing.
struct SoftmaxPartial {
  float max;
  float sum;
};

MG_HD inline SoftmaxPartial empty_softmax() { return {-INFINITY, 0.0f}; }

// exp(from_max - to_max), 0 for an empty state (whose max is -inf).
MG_HD inline float softmax_rescale(float from_max, float to_max) {
  return from_max == -INFINITY ? 0.0f : expf(from_max - to_max);
}

// Merges two states; the merged acc is acc_a * *scale_a + acc_b * *scale_b.
MG_HD inline SoftmaxPartial softmax_merge(SoftmaxPartial a, SoftmaxPartial b, float* scale_a,
                                          float* scale_b) {
  const float max = fmaxf(a.max, b.max);
  *scale_a = softmax_rescale(a.max, max);
  *scale_b = softmax_rescale(b.max, max);
  return {max, a.sum * *scale_a + b.sum * *scale_b};
}

}  // namespace moegraph
