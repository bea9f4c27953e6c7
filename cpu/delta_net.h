// The CPU backend's Gated DeltaNet mixer (qwen35moe's linear-attention layers,
// issue 41): reference/delta_net.h's computation in f32, as llama.cpp's CPU
// ops compute it (ggml_ssm_conv, the l2 norms, ggml_gated_delta_net,
// build_norm_gated), with the per-element math of kernels/delta_net_math.h.
// A batch's tokens take the fused op's algorithm: the projections around the
// mixer run batched (cpu/forward.cc), the conv runs per channel over all the
// tokens, and only the delta rule's state update walks the tokens in order,
// one task per value head. So a batch gives the bits of its tokens fed one by
// one, whatever the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/thread_pool.h"
#include "loader/model_config.h"
#include "reference/delta_net.h"

namespace moegraph {

// One sequence's state of one layer, f32 as llama.cpp's: conv[c (d_conv - 1)
// + t], channel c's last inputs oldest first; delta[(h head_dim + j)
// head_dim + i], value head h's M[key i][value j]. Zero for a new sequence.
struct CpuDeltaNetState {
  std::vector<float> conv;
  std::vector<float> delta;
  explicit CpuDeltaNetState(const DeltaNetShape& shape);
  void Clear();
};

// n tokens of one sequence: qkv [n][conv_dim] in (overwritten: the conv's
// output, q and k normalised), z [n][value_dim], alpha and beta_logit
// [n][n_v_heads]; out [n][value_dim], before ssm_out. eps: the file's
// layer_norm_rms_epsilon. Tasks run on pool.
void CpuDeltaNetMix(const DeltaNetShape& shape, const DeltaNetWeights& weights, float eps,
                    int64_t n, float* qkv, const float* z, const float* alpha,
                    const float* beta_logit, ThreadPool& pool, CpuDeltaNetState* state,
                    float* out);

}  // namespace moegraph
