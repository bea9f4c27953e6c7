#include "cpu/delta_net.h"

#include <algorithm>
#include <cmath>

#include "cpu/simd_kernels.h"
#include "kernels/delta_net_math.h"
#include "kernels/nn_math.h"

namespace moegraph {
namespace {

// Channels per conv task: a 64-byte line of each token's inputs.
constexpr int64_t kConvChannels = 16;

// sum x^2 with each square in f32 and the sum in f64 (ggml's rms_norm).
double SumOfSquares(const float* x, int n) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += static_cast<double>(x[i] * x[i]);
  return sum;
}

}  // namespace

CpuDeltaNetState::CpuDeltaNetState(const DeltaNetShape& shape)
    : conv(static_cast<size_t>(shape.conv_state_floats()), 0.0f),
      delta(static_cast<size_t>(shape.delta_state_floats()), 0.0f) {}

void CpuDeltaNetState::Clear() {
  std::fill(conv.begin(), conv.end(), 0.0f);
  std::fill(delta.begin(), delta.end(), 0.0f);
}

void CpuDeltaNetMix(const DeltaNetShape& shape, const DeltaNetWeights& weights, float eps,
                    int64_t n, float* qkv, const float* z, const float* alpha,
                    const float* beta_logit, ThreadPool& pool, CpuDeltaNetState* state,
                    float* out) {
  const int d_conv = shape.d_conv, d = shape.head_dim, hk = shape.n_k_heads, hv = shape.n_v_heads;
  const int64_t conv_dim = shape.conv_dim(), key_dim = shape.key_dim();
  const int64_t value_dim = shape.value_dim();
  const int64_t held = d_conv - 1;

  // The conv over [state, tokens] per channel, then silu, in place; the
  // channel's last d_conv - 1 inputs become its state.
  const int64_t conv_tasks = (conv_dim + kConvChannels - 1) / kConvChannels;
  pool.RunSized(conv_tasks, n * conv_dim * d_conv, [&](int64_t task) {
    thread_local std::vector<float> window;
    window.resize(static_cast<size_t>(held + n));
    const int64_t end = std::min(conv_dim, (task + 1) * kConvChannels);
    for (int64_t c = task * kConvChannels; c < end; ++c) {
      float* kept = state->conv.data() + c * held;
      std::copy_n(kept, held, window.data());
      for (int64_t t = 0; t < n; ++t) window[held + t] = qkv[t * conv_dim + c];
      const float* taps = weights.conv.data() + c * d_conv;
      for (int64_t t = 0; t < n; ++t) {
        const float* at = window.data() + t;
        qkv[t * conv_dim + c] =
            silu(delta_net_conv_tap_sum([at](int32_t i) { return at[i]; }, taps, d_conv));
      }
      std::copy_n(window.data() + n, held, kept);
    }
  });

  // q and k l2-normalised per head and token.
  pool.RunSized(n * 2 * hk, n * 2 * key_dim, [&](int64_t task) {
    const int64_t t = task / (2 * hk);
    float* x = qkv + t * conv_dim + (task % (2 * hk)) * d;
    const float scale = delta_net_l2_scale(static_cast<float>(SumOfSquares(x, d)), d, eps);
    for (int i = 0; i < d; ++i) x[i] *= scale;
  });

  // Per value head (its q and k: head h % n_k_heads, llama.cpp's tiled
  // order), the tokens in order: the delta rule, then the gated norm.
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  pool.RunSized(hv, n * hv * int64_t{d} * d, [&](int64_t h) {
    float* m = state->delta.data() + h * d * d;
    for (int64_t t = 0; t < n; ++t) {
      const float* row = qkv + t * conv_dim;
      const float* q = row + (h % hk) * d;
      const float* k = q + key_dim;
      const float* v = row + 2 * key_dim + h * d;
      const int64_t at = t * hv + h;
      const float decay = delta_net_decay(alpha[at], weights.dt_bias[h], weights.ssm_a[h]);
      float* o = out + t * value_dim + h * d;
      SimdDeltaRuleStep(d, q, k, v, decay, sigmoid(beta_logit[at]), scale, m, o);
      // rms_norm(o) * ssm_norm * silu(z) (build_norm_gated).
      const float norm = rms_scale(static_cast<float>(SumOfSquares(o, d)), d, eps);
      const float* zt = z + t * value_dim + h * d;
      for (int j = 0; j < d; ++j) o[j] = o[j] * norm * weights.norm[j] * silu(zt[j]);
    }
  });
}

}  // namespace moegraph
