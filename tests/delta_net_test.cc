// The oracle's Gated DeltaNet mixer (reference/delta_net.h): the delta rule
// against cases worked by hand and against its chunked (WY) form, which is how
// a prompt will run in batches; the mixer's state carried token by token.
#include "reference/delta_net.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace moegraph {
namespace {

std::vector<double> Random(std::mt19937& rng, size_t n, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

std::vector<double> Normalized(std::vector<double> rows, int d) {
  for (size_t at = 0; at < rows.size(); at += static_cast<size_t>(d)) {
    double sum_sq = 0.0;
    for (int i = 0; i < d; ++i) sum_sq += rows[at + i] * rows[at + i];
    for (int i = 0; i < d; ++i) rows[at + i] /= std::sqrt(sum_sq);
  }
  return rows;
}

double Dot(const double* a, const double* b, int d) {
  double s = 0.0;
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// From a zero state one token writes M = k (beta v)^T and reads it with q:
// o = beta (q . k) v / sqrt(d), whatever the decay.
TEST(DeltaRuleTest, OneTokenFromZeroIsTheScaledOuterProduct) {
  std::mt19937 rng(1);
  const int d = 8;
  const std::vector<double> q = Normalized(Random(rng, d), d), k = Normalized(Random(rng, d), d);
  const std::vector<double> v = Random(rng, d), g = {-0.7}, beta = {0.6};
  std::vector<double> m(d * d, 0.0), o(d);
  DeltaRule(d, q, k, v, g, beta, absl::MakeSpan(m), absl::MakeSpan(o));
  const double qk = Dot(q.data(), k.data(), d);
  for (int j = 0; j < d; ++j) {
    EXPECT_NEAR(o[j], 0.6 * qk * v[j] / std::sqrt(8.0), 1e-15) << j;
    for (int i = 0; i < d; ++i) EXPECT_NEAR(m[j * d + i], k[i] * 0.6 * v[j], 1e-15);
  }
}

// With beta 0 nothing is written: the state only decays by exp(g) and o reads it.
TEST(DeltaRuleTest, WithoutWritesTheStateDecays) {
  std::mt19937 rng(2);
  const int d = 4;
  const std::vector<double> q = Normalized(Random(rng, d), d), k = Normalized(Random(rng, d), d);
  const std::vector<double> v = Random(rng, d), m0 = Random(rng, d * d);
  std::vector<double> m = m0, o(d);
  DeltaRule(d, q, k, v, std::vector<double>{-0.25}, std::vector<double>{0.0}, absl::MakeSpan(m),
            absl::MakeSpan(o));
  const double decay = std::exp(-0.25);
  for (int j = 0; j < d; ++j) {
    EXPECT_NEAR(o[j], decay * Dot(m0.data() + j * d, q.data(), d) / 2.0, 1e-14) << j;
    for (int i = 0; i < d; ++i) EXPECT_NEAR(m[j * d + i], decay * m0[j * d + i], 1e-15);
  }
}

// The chunked form of the delta rule over one chunk of T tokens
// (build_delta_net_chunking, src/models/delta-net-base.cpp), written out with
// M[key i][value j] from the initial state m0 [value j][key i]: with G the
// running sums of g and q scaled by 1 / sqrt(d),
//   A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i;   (I + A) U = beta V;
//   (I + A) W = beta exp(G) K;   Vnew = U - W M0;
//   O = exp(G) Q M0 + P Vnew with P[i][j] = (q_i . k_j) exp(G_i - G_j), j <= i;
//   M = exp(G_last) M0 + K^T exp(G_last - G) Vnew.
void ChunkedDeltaRule(int d, const std::vector<double>& q, const std::vector<double>& k,
                      const std::vector<double>& v, const std::vector<double>& g,
                      const std::vector<double>& beta, std::vector<double>* m,
                      std::vector<double>* o) {
  const int n = static_cast<int>(g.size());
  std::vector<double> cum(n);
  for (int t = 0; t < n; ++t) cum[t] = (t > 0 ? cum[t - 1] : 0.0) + g[t];
  auto gamma = [&](int i, int j) { return std::exp(cum[i] - cum[j]); };
  // Forward substitution of (I + A) X = B, B's rows scaled by row_scale.
  auto solve = [&](const std::vector<double>& b, auto row_scale) {
    std::vector<double> x(b.size());
    for (int i = 0; i < n; ++i) {
      for (int c = 0; c < d; ++c) x[i * d + c] = row_scale(i) * b[i * d + c];
      for (int j = 0; j < i; ++j) {
        const double a = beta[i] * Dot(&k[i * d], &k[j * d], d) * gamma(i, j);
        for (int c = 0; c < d; ++c) x[i * d + c] -= a * x[j * d + c];
      }
    }
    return x;
  };
  const std::vector<double> u = solve(v, [&](int i) { return beta[i]; });
  const std::vector<double> w = solve(k, [&](int i) { return beta[i] * std::exp(cum[i]); });
  // m0 as M0[i][j] = (*m)[j d + i].
  const std::vector<double> m0 = *m;
  auto m0_at = [&](int i, int j) { return m0[j * d + i]; };
  std::vector<double> v_new(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < d; ++j) {
      double wm = 0.0;
      for (int i = 0; i < d; ++i) wm += w[t * d + i] * m0_at(i, j);
      v_new[t * d + j] = u[t * d + j] - wm;
    }
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  o->assign(static_cast<size_t>(n) * d, 0.0);
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int i = 0; i < d; ++i) acc += std::exp(cum[t]) * scale * q[t * d + i] * m0_at(i, j);
      for (int s = 0; s <= t; ++s) {
        acc += scale * Dot(&q[t * d], &k[s * d], d) * gamma(t, s) * v_new[s * d + j];
      }
      (*o)[t * d + j] = acc;
    }
  }
  for (int j = 0; j < d; ++j) {
    for (int i = 0; i < d; ++i) {
      double acc = std::exp(cum[n - 1]) * m0_at(i, j);
      for (int s = 0; s < n; ++s) acc += k[s * d + i] * gamma(n - 1, s) * v_new[s * d + j];
      (*m)[j * d + i] = acc;
    }
  }
}

TEST(DeltaRuleTest, ChunkedFormEqualsTheRecurrence) {
  std::mt19937 rng(3);
  for (int n : {1, 2, 5, 13}) {
    const int d = 8;
    const std::vector<double> q = Normalized(Random(rng, n * d), d);
    const std::vector<double> k = Normalized(Random(rng, n * d), d);
    const std::vector<double> v = Random(rng, n * d);
    std::vector<double> g(n), beta(n);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (int t = 0; t < n; ++t) {
      g[t] = -2.0 * unit(rng);
      beta[t] = unit(rng);
    }
    const std::vector<double> m0 = Random(rng, d * d, 0.5);
    std::vector<double> m = m0, o(static_cast<size_t>(n) * d);
    DeltaRule(d, q, k, v, g, beta, absl::MakeSpan(m), absl::MakeSpan(o));
    std::vector<double> chunk_m = m0, chunk_o;
    ChunkedDeltaRule(d, q, k, v, g, beta, &chunk_m, &chunk_o);
    for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o[i], chunk_o[i], 1e-12) << "n " << n;
    for (size_t i = 0; i < m.size(); ++i) EXPECT_NEAR(m[i], chunk_m[i], 1e-12) << "n " << n;
  }
}

// A Qwen3.5-like mixer, its value heads twice its key heads.
struct MixFixture {
  DeltaNetShape shape{4, 8, 2, 4};
  std::vector<float> conv, dt_bias, ssm_a, norm;
  explicit MixFixture(std::mt19937& rng) {
    std::normal_distribution<float> dist(0.0f, 0.5f);
    auto fill = [&](std::vector<float>& w, size_t n) {
      w.resize(n);
      for (float& x : w) x = dist(rng);
    };
    fill(conv, static_cast<size_t>(shape.conv_dim()) * shape.d_conv);
    fill(dt_bias, shape.n_v_heads);
    fill(ssm_a, shape.n_v_heads);
    for (float& a : ssm_a) a = -std::exp(a);  // -exp(A_log), as the file holds it
    fill(norm, shape.head_dim);
  }
  DeltaNetWeights weights() const { return {conv, dt_bias, ssm_a, norm}; }
};

std::vector<float> RandomFloats(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// T tokens at once, or one at a time with the state carried, give the same
// bits, and the conv state holds the last d_conv - 1 inputs, oldest first.
TEST(DeltaNetMixTest, TokensAtOnceEqualTokensOneByOne) {
  std::mt19937 rng(4);
  const MixFixture f(rng);
  const DeltaNetShape& s = f.shape;
  const int n = 9;
  const std::vector<float> qkv = RandomFloats(rng, static_cast<size_t>(n) * s.conv_dim());
  const std::vector<float> z = RandomFloats(rng, static_cast<size_t>(n) * s.value_dim());
  const std::vector<float> alpha = RandomFloats(rng, static_cast<size_t>(n) * s.n_v_heads);
  const std::vector<float> beta = RandomFloats(rng, alpha.size());
  DeltaNetState all(s), one(s);
  std::vector<float> out_all(z.size()), out_one(z.size());
  DeltaNetMix(s, f.weights(), qkv, z, alpha, beta, 1e-6f, &all, absl::MakeSpan(out_all));
  for (int t = 0; t < n; ++t) {
    auto row = [&](const std::vector<float>& x, int width) {
      return absl::MakeConstSpan(x).subspan(static_cast<size_t>(t) * width, width);
    };
    DeltaNetMix(s, f.weights(), row(qkv, s.conv_dim()), row(z, s.value_dim()),
                row(alpha, s.n_v_heads), row(beta, s.n_v_heads), 1e-6f, &one,
                absl::MakeSpan(out_one).subspan(static_cast<size_t>(t) * s.value_dim(),
                                                 s.value_dim()));
  }
  EXPECT_EQ(out_all, out_one);
  EXPECT_EQ(all.delta, one.delta);
  EXPECT_EQ(all.conv, one.conv);
  const int held = s.d_conv - 1;
  for (int c = 0; c < s.conv_dim(); ++c) {
    for (int t = 0; t < held; ++t) {
      EXPECT_EQ(all.conv[c * held + t], qkv[static_cast<size_t>(n - held + t) * s.conv_dim() + c]);
    }
  }
}

// Value head h reads q/k head h % n_k_heads (llama.cpp's tiled order): value
// heads 0 and 2 share their q and k, so with the same v, z, gate and state
// they give the same output; heads 0 and 1 do not.
TEST(DeltaNetMixTest, ValueHeadsTileTheKeyHeads) {
  std::mt19937 rng(5);
  MixFixture f(rng);
  const DeltaNetShape& s = f.shape;
  const int d = s.head_dim;
  std::vector<float> qkv = RandomFloats(rng, s.conv_dim());
  // v of head 2 = v of head 0 and v of head 1 too; their conv taps alike.
  const int v0 = 2 * s.key_dim();
  for (int i = 0; i < d; ++i) {
    qkv[v0 + 2 * d + i] = qkv[v0 + i];
    qkv[v0 + d + i] = qkv[v0 + i];
    for (int tap = 0; tap < s.d_conv; ++tap) {
      f.conv[(v0 + 2 * d + i) * s.d_conv + tap] = f.conv[(v0 + i) * s.d_conv + tap];
      f.conv[(v0 + d + i) * s.d_conv + tap] = f.conv[(v0 + i) * s.d_conv + tap];
    }
  }
  for (int h : {1, 2}) {
    f.dt_bias[h] = f.dt_bias[0];
    f.ssm_a[h] = f.ssm_a[0];
  }
  std::vector<float> z = RandomFloats(rng, s.value_dim());
  for (int i = 0; i < d; ++i) z[2 * d + i] = z[d + i] = z[i];
  const std::vector<float> alpha(s.n_v_heads, 0.3f), beta(s.n_v_heads, -0.2f);
  DeltaNetState state(s);
  std::vector<float> out(s.value_dim());
  DeltaNetMix(s, f.weights(), qkv, z, alpha, beta, 1e-6f, &state, absl::MakeSpan(out));
  double differs = 0.0;
  for (int i = 0; i < d; ++i) {
    EXPECT_EQ(out[2 * d + i], out[i]) << i;
    differs += std::fabs(out[d + i] - out[i]);
  }
  EXPECT_GT(differs, 1e-3);
}

}  // namespace
}  // namespace moegraph
