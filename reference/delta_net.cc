#include "reference/delta_net.h"

#include <cmath>

#include "loader/check.h"

namespace moegraph {
namespace {

double Silu(double x) { return x / (1.0 + std::exp(-x)); }

// ggml-cpu's softplus (unary-ops.cpp): x itself above 20.
double Softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// x / sqrt(sum x^2 + eps): ggml_rms_norm with eps / n, scaled by 1 / sqrt(n)
// (build_gdn_l2_norm, src/models/models.h).
void L2Normalize(double* x, int n, double eps) {
  double sum_sq = 0.0;
  for (int i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const double scale = 1.0 / std::sqrt(sum_sq + eps);
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

}  // namespace

void DeltaRule(int head_dim, absl::Span<const double> q, absl::Span<const double> k,
               absl::Span<const double> v, absl::Span<const double> g,
               absl::Span<const double> beta, absl::Span<double> m, absl::Span<double> o) {
  const size_t d = static_cast<size_t>(head_dim);
  const size_t n_tokens = g.size();
  MG_CHECK(head_dim > 0 && beta.size() == n_tokens && q.size() == n_tokens * d &&
               k.size() == q.size() && v.size() == q.size() && o.size() == q.size() &&
               m.size() == d * d,
           "DeltaRule: sizes");
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> delta(d);
  for (size_t t = 0; t < n_tokens; ++t) {
    const double* qt = q.data() + t * d;
    const double* kt = k.data() + t * d;
    const double* vt = v.data() + t * d;
    const double decay = std::exp(g[t]);
    for (double& x : m) x *= decay;
    // m[j d + i] is M[key i][value j].
    for (size_t j = 0; j < d; ++j) {
      double mk = 0.0;
      for (size_t i = 0; i < d; ++i) mk += m[j * d + i] * kt[i];
      delta[j] = (vt[j] - mk) * beta[t];
    }
    for (size_t j = 0; j < d; ++j) {
      for (size_t i = 0; i < d; ++i) m[j * d + i] += kt[i] * delta[j];
    }
    for (size_t j = 0; j < d; ++j) {
      double mq = 0.0;
      for (size_t i = 0; i < d; ++i) mq += m[j * d + i] * qt[i];
      o[t * d + j] = mq * scale;
    }
  }
}

void DeltaNetMix(const DeltaNetShape& shape, const DeltaNetWeights& weights,
                 absl::Span<const float> qkv, absl::Span<const float> z,
                 absl::Span<const float> alpha, absl::Span<const float> beta_logit, float eps,
                 DeltaNetState* state, absl::Span<float> out) {
  const int d_conv = shape.d_conv, d = shape.head_dim, hk = shape.n_k_heads, hv = shape.n_v_heads;
  const size_t conv_dim = static_cast<size_t>(shape.conv_dim());
  const size_t value_dim = static_cast<size_t>(shape.value_dim());
  MG_CHECK(d_conv >= 1 && d > 0 && hk > 0 && hv > 0 && hv % hk == 0,
           "DeltaNetMix: a shape whose value heads are a multiple of its key heads");
  const size_t n_tokens = alpha.size() / static_cast<size_t>(hv);
  MG_CHECK(alpha.size() == n_tokens * hv && beta_logit.size() == alpha.size() &&
               qkv.size() == n_tokens * conv_dim && z.size() == n_tokens * value_dim &&
               out.size() == z.size(),
           "DeltaNetMix: token sizes");
  MG_CHECK(weights.conv.size() == conv_dim * d_conv && weights.dt_bias.size() == size_t(hv) &&
               weights.ssm_a.size() == size_t(hv) && weights.norm.size() == size_t(d),
           "DeltaNetMix: weight sizes");
  MG_CHECK(state->conv.size() == static_cast<size_t>(shape.conv_state_floats()) &&
               state->delta.size() == static_cast<size_t>(shape.delta_state_floats()),
           "DeltaNetMix: state sizes");

  // The causal conv over [state, tokens] per channel, then silu
  // (ggml_ssm_conv: out[c][t] = sum_i input[t + i][c] w[c][i]).
  const size_t held = static_cast<size_t>(d_conv - 1);
  std::vector<double> y(n_tokens * conv_dim);
  std::vector<float> window(held + n_tokens);
  for (size_t c = 0; c < conv_dim; ++c) {
    for (size_t t = 0; t < held; ++t) window[t] = state->conv[c * held + t];
    for (size_t t = 0; t < n_tokens; ++t) window[held + t] = qkv[t * conv_dim + c];
    for (size_t t = 0; t < n_tokens; ++t) {
      double acc = 0.0;
      for (int i = 0; i < d_conv; ++i) {
        acc += static_cast<double>(window[t + i]) * weights.conv[c * d_conv + i];
      }
      y[t * conv_dim + c] = Silu(acc);
    }
    for (size_t t = 0; t < held; ++t) state->conv[c * held + t] = window[n_tokens + t];
  }

  // Per value head: its q/k head (h % n_k_heads, llama.cpp's tiled order),
  // normalised; the delta rule over the tokens; the gated norm.
  const size_t sd = static_cast<size_t>(d);
  const size_t key_dim = static_cast<size_t>(shape.key_dim());
  std::vector<double> q(n_tokens * sd), k(q.size()), v(q.size()), o(q.size());
  std::vector<double> g(n_tokens), beta(n_tokens);
  for (int h = 0; h < hv; ++h) {
    const size_t qk_at = static_cast<size_t>(h % hk) * sd;
    const size_t v_at = 2 * key_dim + static_cast<size_t>(h) * sd;
    for (size_t t = 0; t < n_tokens; ++t) {
      for (size_t i = 0; i < sd; ++i) {
        q[t * sd + i] = y[t * conv_dim + qk_at + i];
        k[t * sd + i] = y[t * conv_dim + key_dim + qk_at + i];
        v[t * sd + i] = y[t * conv_dim + v_at + i];
      }
      L2Normalize(q.data() + t * sd, d, eps);
      L2Normalize(k.data() + t * sd, d, eps);
      const size_t at = t * hv + h;
      g[t] = Softplus(static_cast<double>(alpha[at]) + weights.dt_bias[h]) * weights.ssm_a[h];
      beta[t] = 1.0 / (1.0 + std::exp(-static_cast<double>(beta_logit[at])));
    }
    DeltaRule(d, q, k, v, g, beta,
              absl::MakeSpan(state->delta).subspan(static_cast<size_t>(h) * sd * sd, sd * sd),
              absl::MakeSpan(o));

    // rms_norm(o) * norm * silu(z) (build_norm_gated: the norm, then the gate).
    for (size_t t = 0; t < n_tokens; ++t) {
      const double* ot = o.data() + t * sd;
      double sum_sq = 0.0;
      for (size_t j = 0; j < sd; ++j) sum_sq += ot[j] * ot[j];
      const double rms = 1.0 / std::sqrt(sum_sq / d + eps);
      const size_t at = t * value_dim + static_cast<size_t>(h) * sd;
      for (size_t j = 0; j < sd; ++j) {
        out[at + j] = static_cast<float>(ot[j] * rms * weights.norm[j] * Silu(z[at + j]));
      }
    }
  }
}

}  // namespace moegraph
