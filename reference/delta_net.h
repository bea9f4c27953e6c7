// The oracle's Gated DeltaNet token mixer (qwen35moe's linear-attention
// layers, issue 41), in f64 with f32 inputs, outputs and state, as llama.cpp
// v0.5.0 computes it between the layer's projections and its output
// projection (src/models/qwen35moe.cpp build_layer_attn_linear; the ops
// ggml_ssm_conv and ggml_gated_delta_net, ggml-cpu/ops.cpp
// ggml_compute_forward_ssm_conv_f32 and
// ggml_compute_forward_gated_delta_net_one_chunk):
//
//   y      = silu(causal depthwise conv of qkv over the last d_conv tokens)
//   q, k   = y's first two key_dim channels, l2-normalised per head;  v = the rest
//   g      = softplus(alpha + dt_bias) * ssm_a      (ssm_a = -exp(A_log): g <= 0)
//   beta   = sigmoid(beta_logit)
//   per value head h (q/k head h % n_k_heads), per token in order, state M[key i][value j]:
//     M *= exp(g);  delta_j = (v_j - sum_i M_ij k_i) beta;  M_ij += k_i delta_j
//     o_j = sum_i M_ij q_i / sqrt(head_dim)
//   out    = rms_norm(o per head) * ssm_norm * silu(z)
//
// The caller projects qkv, z, alpha and beta_logit from the normed input and
// applies ssm_out to out. A sequence's state (the conv's last d_conv - 1
// inputs and each head's M) carries from one call to the next.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "loader/model_config.h"

namespace moegraph {

// One sequence's state in llama.cpp's layouts: conv[c (d_conv - 1) + t], the
// channel's inputs oldest first; delta[(h head_dim + j) head_dim + i], head h's
// M[key i][value j], kept in f64 (llama.cpp's is f32), so tokens run in one call
// or in several give the same bits. Zero for a new sequence.
struct DeltaNetState {
  std::vector<float> conv;
  std::vector<double> delta;
  explicit DeltaNetState(const DeltaNetShape& shape)
      : conv(static_cast<size_t>(shape.conv_state_floats()), 0.0f),
        delta(static_cast<size_t>(shape.delta_state_floats()), 0.0) {}
};

// A layer's mixer weights as f32: conv[c d_conv + i] (ssm_conv1d, tap
// d_conv - 1 on the current token), dt_bias and ssm_a [n_v_heads], norm
// [head_dim] (ssm_norm).
struct DeltaNetWeights {
  absl::Span<const float> conv;
  absl::Span<const float> dt_bias;
  absl::Span<const float> ssm_a;
  absl::Span<const float> norm;
};

// T tokens of one sequence: qkv [T][conv_dim], z [T][value_dim], alpha and
// beta_logit [T][n_v_heads] in, out [T][value_dim]; eps is the file's
// layer_norm_rms_epsilon (the l2 norm's and the gated norm's).
void DeltaNetMix(const DeltaNetShape& shape, const DeltaNetWeights& weights,
                 absl::Span<const float> qkv, absl::Span<const float> z,
                 absl::Span<const float> alpha, absl::Span<const float> beta_logit, float eps,
                 DeltaNetState* state, absl::Span<float> out);

// The delta rule alone (ggml_gated_delta_net): T tokens of one value head,
// q and k [T][head_dim] (normalised), v [T][head_dim], g and beta [T], the
// head's state m [value j][key i] updated, o [T][head_dim] out.
void DeltaRule(int head_dim, absl::Span<const double> q, absl::Span<const double> k,
               absl::Span<const double> v, absl::Span<const double> g,
               absl::Span<const double> beta, absl::Span<double> m, absl::Span<double> o);

}  // namespace moegraph
