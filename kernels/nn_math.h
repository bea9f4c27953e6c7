// Per-element math of the dense decode ops (activations, RMSNorm, RoPE, the
// split-K softmax merge), shared by the kernels and the CPU tests. Light: .cu
// files include it.
#pragma once

#include <math.h>

#include <cstddef>
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

// Angle of pair i at pos: pos * freq_base^(-2i / head_dim), in f64 (ggml's
// theta_scale^i in closed form). Host only: the kernels read rope tables.
inline double rope_theta(int32_t pos, int32_t i, int32_t head_dim, float freq_base) {
  return static_cast<double>(pos) *
         pow(static_cast<double>(freq_base), -2.0 * i / static_cast<double>(head_dim));
}

// Rotates (*a, *b) by the angle whose cosine and sine are c and s (each times
// YaRN's magnitude scale where there is one), in f32 as ggml's rotate_pairs,
// each result one product and one fmaf so the host and the device round alike.
MG_HD inline void rope_rotate_cs(float* a, float* b, float c, float s) {
  const float x0 = *a;
  const float x1 = *b;
  *a = fmaf(x0, c, -(x1 * s));
  *b = fmaf(x0, s, x1 * c);
}

// RoPE frequency scaling as ggml's rope_yarn applies it, its per-model
// constants computed once (rope_yarn_init): the angle interpolated by
// freq_scale, mixed back towards the unscaled one by ext_factor times the ramp
// of pairs [corr_low, corr_high], cosine and sine times mscale. The default is
// no scaling.
struct RopeYarn {
  float freq_scale = 1.0f;
  float ext_factor = 0.0f;
  float corr_low = 0.0f;
  float corr_high = 0.0f;
  double mscale = 1.0;
};

// ggml_rope_yarn_corr_dims (ggml.c), in f32 as there, and rope_yarn's mscale
// (attn_factor, times 1 + 0.1 ln(1 / freq_scale) with ext_factor), for a head
// of n_rot rotated dimensions.
MG_HD inline RopeYarn rope_yarn_init(float freq_scale, float ext_factor, float attn_factor,
                                     float beta_fast, float beta_slow, int32_t n_ctx_orig,
                                     int32_t n_rot, float freq_base) {
  auto corr_dim = [&](float beta) {
    return static_cast<float>(n_rot) *
           logf(static_cast<float>(n_ctx_orig) / (beta * 2 * static_cast<float>(M_PI))) /
           (2 * logf(freq_base));
  };
  RopeYarn y;
  y.freq_scale = freq_scale;
  y.ext_factor = ext_factor;
  y.corr_low = fmaxf(0.0f, floorf(corr_dim(beta_fast)));
  y.corr_high = fminf(static_cast<float>(n_rot - 1), ceilf(corr_dim(beta_slow)));
  y.mscale = attn_factor;
  if (ext_factor != 0.0f) y.mscale *= 1.0 + 0.1 * log(1.0 / freq_scale);
  return y;
}

// Cosine and sine of pair i's angle at pos (rope_theta) as rope_yarn scales
// them, in f64 rounded once to f32: ggml_rope_cache_init's theta, interpolated,
// then ramped back. Host only (at load, and per batch on the CPU).
inline void rope_cos_sin(int32_t pos, int32_t i, int32_t n_rot, float freq_base,
                         const RopeYarn& y, float* c, float* s) {
  const double extrap = rope_theta(pos, i, n_rot, freq_base);
  double theta = y.freq_scale * extrap;
  if (y.ext_factor != 0.0f) {
    const double ramp = (i - y.corr_low) / fmax(0.001f, y.corr_high - y.corr_low);
    const double mix = (1.0 - fmin(1.0, fmax(0.0, ramp))) * y.ext_factor;
    theta = theta * (1.0 - mix) + extrap * mix;
  }
  *c = static_cast<float>(cos(theta) * y.mscale);
  *s = static_cast<float>(sin(theta) * y.mscale);
}

// RoPE's cosines and sines for positions [0, positions), made once at load on
// the host so a step's kernels read them instead of computing sin/cos
// (whose argument reduction keeps a stack frame): (c, s) of pair i at position
// p at out[2 (p n_rot / 2 + i)], as rope_cos_sin makes them.
inline size_t rope_table_floats(int32_t n_rot, int32_t positions) {
  return static_cast<size_t>(positions) * static_cast<size_t>(n_rot / 2) * 2;
}
inline void fill_rope_table(int32_t n_rot, float freq_base, const RopeYarn& yarn,
                            int32_t positions, float* out) {
  for (int32_t p = 0; p < positions; ++p) {
    for (int32_t i = 0; i < n_rot / 2; ++i) {
      float* at = out + 2 * (static_cast<size_t>(p) * (n_rot / 2) + i);
      rope_cos_sin(p, i, n_rot, freq_base, yarn, at, at + 1);
    }
  }
}

// The gated activation of an FFN's gate and up values: silu(gate) * up, or
// gpt-oss's swiglu_oai (ggml's op with alpha 1.702 and limit 7: gate clamped
// above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)).
enum class GluAct : int32_t { kSilu = 0, kSwigluOai = 1 };

MG_HD inline float swiglu_oai(float gate, float up) {
  const float x = fminf(gate, 7.0f);
  const float y = fminf(fmaxf(up, -7.0f), 7.0f);
  return x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
}

MG_HD inline float glu(GluAct act, float gate, float up) {
  return act == GluAct::kSwigluOai ? swiglu_oai(gate, up) : silu(gate) * up;
}

// The KV cache row of position p: p, or in a ring of rows rows (a windowed
// layer's cache, rows > 0) p mod rows.
MG_HD inline int64_t kv_cache_row(int32_t p, int32_t rows) { return rows > 0 ? p % rows : p; }

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
