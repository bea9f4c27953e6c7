// Per-element math of the Gated DeltaNet mixer (qwen35moe's linear-attention
// layers) in f32, as llama.cpp's CPU ops compute it (ggml-cpu/ops.cpp
// ggml_compute_forward_ssm_conv_f32, ggml_compute_forward_rms_norm_f32 under
// build_gdn_l2_norm and build_norm_gated, unary-ops.cpp's softplus), shared by
// the CPU backend and the kernels. The oracle's f64 form is
// reference/delta_net.cc. Light: .cu files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "loader/host_device.h"

namespace moegraph {

// ggml's softplus: x itself above 20.
MG_HD inline float delta_net_softplus(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

// The state's decay for one head and token: exp(g), g = softplus(alpha +
// dt_bias) * ssm_a (ssm_a = -exp(A_log), so g <= 0 and the decay is in (0, 1]).
MG_HD inline float delta_net_decay(float alpha, float dt_bias, float ssm_a) {
  return expf(delta_net_softplus(alpha + dt_bias) * ssm_a);
}

// The causal conv's output for one channel and token: taps[i] times the
// window's input i (input_at(i), i = 0 the oldest; tap d_conv - 1 on the
// current token), summed in tap order (ggml_ssm_conv).
template <typename InputAt>
MG_HD_INLINE float delta_net_conv_tap_sum(InputAt input_at, const float* taps, int32_t d_conv) {
  float sum = 0.0f;
  for (int32_t i = 0; i < d_conv; ++i) sum += input_at(i) * taps[i];
  return sum;
}

// The l2 norm's factor for a head of n values whose squares sum to sum_sq:
// build_gdn_l2_norm's ggml_rms_norm(x, eps / n) scaled by 1 / sqrt(n), i.e.
// 1 / sqrt(sum_sq + eps).
MG_HD inline float delta_net_l2_scale(float sum_sq, int32_t n, float eps) {
  const float fn = static_cast<float>(n);
  return 1.0f / sqrtf(sum_sq / fn + eps / fn) * (1.0f / sqrtf(fn));
}

}  // namespace moegraph
