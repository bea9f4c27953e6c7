// Ports of ggml's reference quantizers (ggml/src/ggml-quants.c). The float
// expressions keep ggml's operand order and types: the output bytes depend on every
// rounding, so a "cleaner" rewrite would drift from the files ggml writes.
#include "loader/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "loader/quant.h"

namespace moegraph {
namespace {

// ggml's threshold below which a group counts as all zeros.
constexpr float kGroupMaxEps = 1e-15f;

[[noreturn]] void QuantizeCheckFailed(const char* condition, GgmlType type, int64_t n) {
  std::fprintf(stderr, "quantize_row: CHECK failed: %s (type %u, n %lld)\n", condition,
               static_cast<unsigned>(type), static_cast<long long>(n));
  std::abort();
}

// Round to nearest (ties to even) through the float adder: ggml's nearest_int,
// valid for |fval| <= 4194303.
int nearest_int(float fval) {
  const float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights (weights x^2):
// symmetric quants L in [0, 2 nmax) and the scale that best fits them, trying 18
// scales around nmax / max.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = -nmax / max;
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = static_cast<int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// ggml's make_qkx2_quants: asymmetric quants L in [0, nmax], returning the scale
// and writing -min, searching nstep + 1 scales with a weighted least-squares fit of
// scale and min for each; the error is squared, or absolute with use_mad (q2_K).
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                       float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep,
                       bool use_mad) {
  float min = x[0];
  float max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    const float w = weights[i];
    best_error += w * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<uint8_t>(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        const float w = weights[i];
        cur_error += w * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

void quantize_row_q8_0_ref(const float* x, block_q8_0* y, int64_t k) {
  const int64_t nb = k / QK8_0;
  for (int64_t i = 0; i < nb; i++) {
    float amax = 0.0f;
    for (int j = 0; j < QK8_0; j++) amax = std::max(amax, std::fabs(x[i * QK8_0 + j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    for (int j = 0; j < QK8_0; ++j) {
      const float x0 = x[i * QK8_0 + j] * id;
      y[i].qs[j] = static_cast<int8_t>(std::round(x0));
    }
  }
}

void quantize_row_q4_0_ref(const float* x, block_q4_0* y, int64_t k) {
  constexpr int qk = QK4_0;
  const int64_t nb = k / qk;
  for (int64_t i = 0; i < nb; i++) {
    float amax = 0.0f;  // absolute max
    float max = 0.0f;   // the value holding it, sign included
    for (int j = 0; j < qk; j++) {
      const float v = x[i * qk + j];
      if (amax < std::fabs(v)) {
        amax = std::fabs(v);
        max = v;
      }
    }
    const float d = max / -8;
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    for (int j = 0; j < qk / 2; ++j) {
      const float x0 = x[i * qk + 0 + j] * id;
      const float x1 = x[i * qk + qk / 2 + j] * id;
      // x0 + 8.5 lies in [0.5, 16.5]: truncation toward zero, as ggml's (int8_t) cast.
      const uint8_t xi0 = static_cast<uint8_t>(std::min(15, static_cast<int>(x0 + 8.5f)));
      const uint8_t xi1 = static_cast<uint8_t>(std::min(15, static_cast<int>(x1 + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

// Shared by q4_K and q5_K: packs 8 scales and 8 mins (6 bits each) into 12 bytes.
void pack_scales_mins_k4(const float* scales, const float* mins, float max_scale, float max_min,
                         uint8_t* packed) {
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t ls = static_cast<uint8_t>(nearest_int(inv_scale * scales[j]));
    uint8_t lm = static_cast<uint8_t>(nearest_int(inv_min * mins[j]));
    ls = std::min<uint8_t>(63, ls);
    lm = std::min<uint8_t>(63, lm);
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = static_cast<uint8_t>((ls & 0xf) | ((lm & 0xf) << 4));
      packed[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      packed[j - 0] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
}

// Shared by q4_K and q5_K: the first pass of quantize_row_q{4,5}_K_ref, per 32
// elements a make_qkx2_quants fit; then the packed scales and the block's d/dmin.
void fit_scales_mins_k4(const float* x, int nmax, float rmin, float rdelta, int nstep,
                        uint8_t* L, uint8_t* packed, uint16_t* d, uint16_t* dmin) {
  uint8_t Laux[32];
  float weights[32];
  float mins[QK_K / 32];
  float scales[QK_K / 32];
  float max_scale = 0;  // as we are deducting the min, scales are always positive
  float max_min = 0;
  for (int j = 0; j < QK_K / 32; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin,
                                 rdelta, nstep, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  pack_scales_mins_k4(scales, mins, max_scale, max_min, packed);
  *d = f32_to_f16(max_scale / 63.f);
  *dmin = f32_to_f16(max_min / 63.f);
}

// Second pass of q4_K / q5_K: requantizes against the rounded scales and mins.
void requantize_k4(const float* x, int nmax, const uint8_t* packed, uint16_t d16, uint16_t dmin16,
                   uint8_t* L) {
  uint8_t sc, m;
  for (int j = 0; j < QK_K / 32; ++j) {
    get_scale_min_k4(j, packed, &sc, &m);
    const float d = f16_to_f32(d16) * sc;
    if (!d) continue;
    const float dm = f16_to_f32(dmin16) * m;
    for (int ii = 0; ii < 32; ++ii) {
      const int l = nearest_int((x[32 * j + ii] + dm) / d);
      L[32 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    }
  }
}

void quantize_row_q4_K_ref(const float* x, block_q4_K* y, int64_t k) {
  const int64_t nb = k / QK_K;
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; i++) {
    fit_scales_mins_k4(x, 15, -1.f, 0.1f, 20, L, y[i].scales, &y[i].d, &y[i].dmin);
    requantize_k4(x, 15, y[i].scales, y[i].d, y[i].dmin, L);
    uint8_t* q = y[i].qs;
    for (int j = 0; j < QK_K; j += 64) {
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
      q += 32;
    }
    x += QK_K;
  }
}

void quantize_row_q5_K_ref(const float* x, block_q5_K* y, int64_t k) {
  const int64_t nb = k / QK_K;
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; i++) {
    fit_scales_mins_k4(x, 31, -0.5f, 0.1f, 15, L, y[i].scales, &y[i].d, &y[i].dmin);
    requantize_k4(x, 31, y[i].scales, y[i].d, y[i].dmin, L);
    uint8_t* qh = y[i].qh;
    uint8_t* ql = y[i].qs;
    std::memset(qh, 0, QK_K / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
      for (int j = 0; j < 32; ++j) {
        int l1 = L[n + j];
        if (l1 > 15) {
          l1 -= 16;
          qh[j] |= m1;
        }
        int l2 = L[n + j + 32];
        if (l2 > 15) {
          l2 -= 16;
          qh[j] |= m2;
        }
        ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
      }
      m1 <<= 2;
      m2 <<= 2;
      ql += 32;
    }
    x += QK_K;
  }
}

void quantize_row_q6_K_ref(const float* x, block_q6_K* y, int64_t k) {
  const int64_t nb = k / QK_K;
  int8_t L[QK_K];
  float scales[QK_K / 16];
  for (int64_t i = 0; i < nb; i++) {
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
      const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
      scales[ib] = scale;
      const float abs_scale = std::fabs(scale);
      if (abs_scale > max_abs_scale) {
        max_abs_scale = abs_scale;
        max_scale = scale;
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(&y[i], 0, sizeof(block_q6_K));
      y[i].d = f32_to_f16(0.f);
      x += QK_K;
      continue;
    }
    const float iscale = -128.f / max_scale;
    y[i].d = f32_to_f16(1 / iscale);
    for (int ib = 0; ib < QK_K / 16; ++ib) {
      y[i].scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    }
    for (int j = 0; j < QK_K / 16; ++j) {
      const float d = f16_to_f32(y[i].d) * y[i].scales[j];
      if (!d) continue;
      for (int ii = 0; ii < 16; ++ii) {
        int l = nearest_int(x[16 * j + ii] / d);
        l = std::max(-32, std::min(31, l));
        L[16 * j + ii] = static_cast<int8_t>(l + 32);
      }
    }
    uint8_t* ql = y[i].ql;
    uint8_t* qh = y[i].qh;
    for (int j = 0; j < QK_K; j += 128) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t q1 = L[j + l + 0] & 0xf;
        const uint8_t q2 = L[j + l + 32] & 0xf;
        const uint8_t q3 = L[j + l + 64] & 0xf;
        const uint8_t q4 = L[j + l + 96] & 0xf;
        ql[l + 0] = static_cast<uint8_t>(q1 | (q3 << 4));
        ql[l + 32] = static_cast<uint8_t>(q2 | (q4 << 4));
        qh[l] = static_cast<uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                     ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
      }
      ql += 64;
      qh += 32;
    }
    x += QK_K;
  }
}

// ggml's make_q3_quants with do_rmse: symmetric quants L in [0, 2 nmax), refined
// by up to 5 passes that move one quant at a time while the weighted fit improves.
float make_q3_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float iscale = -nmax / max;
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int itry = 0; itry < 5; ++itry) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (slx > 0) {
        float sl2 = suml2 - w * L[i] * L[i];
        int new_l = nearest_int(x[i] * sl2 / slx);
        new_l = std::max(-nmax, std::min(nmax - 1, new_l));
        if (new_l != L[i]) {
          slx += w * x[i] * new_l;
          sl2 += w * new_l * new_l;
          if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = static_cast<int8_t>(new_l);
            sumlx = slx;
            suml2 = sl2;
            ++n_changed;
          }
        }
      }
    }
    if (!n_changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// The block's min and step for q4_1/q5_1 (levels = 2^bits - 1), as their _ref quantizers.
struct MinStep {
  float min;
  float d;
};
MinStep block_min_step(const float* x, int levels) {
  float min = std::numeric_limits<float>::max();
  float max = -std::numeric_limits<float>::max();
  for (int j = 0; j < 32; j++) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  return {min, (max - min) / levels};
}

void quantize_row_q4_1_ref(const float* x, block_q4_1* y, int64_t k) {
  constexpr int qk = 32;
  const int64_t nb = k / qk;
  for (int64_t i = 0; i < nb; i++) {
    const auto [min, d] = block_min_step(x + i * qk, (1 << 4) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    y[i].m = f32_to_f16(min);
    for (int j = 0; j < qk / 2; ++j) {
      const float x0 = (x[i * qk + 0 + j] - min) * id;
      const float x1 = (x[i * qk + qk / 2 + j] - min) * id;
      const uint8_t xi0 = static_cast<uint8_t>(std::min(15, static_cast<int>(x0 + 0.5f)));
      const uint8_t xi1 = static_cast<uint8_t>(std::min(15, static_cast<int>(x1 + 0.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

// q5_0 and q5_1 share the packing: low nibbles as q4_0, fifth bits into qh.
template <typename Block>
void pack_q5(const uint8_t* q, Block* y) {
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    y->qs[j] = static_cast<uint8_t>((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
    qh |= ((q[j] & 0x10u) >> 4) << (j + 0);
    qh |= ((q[j + 16] & 0x10u) >> 4) << (j + 16);
  }
  std::memcpy(y->qh, &qh, sizeof(qh));
}

void quantize_row_q5_0_ref(const float* x, block_q5_0* y, int64_t k) {
  constexpr int qk = 32;
  const int64_t nb = k / qk;
  for (int64_t i = 0; i < nb; i++) {
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < qk; j++) {
      const float v = x[i * qk + j];
      if (amax < std::fabs(v)) {
        amax = std::fabs(v);
        max = v;
      }
    }
    const float d = max / -16;
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    uint8_t q[qk];
    for (int j = 0; j < qk; ++j) {
      q[j] = static_cast<uint8_t>(std::min(31, static_cast<int>(x[i * qk + j] * id + 16.5f)));
    }
    pack_q5(q, &y[i]);
  }
}

void quantize_row_q5_1_ref(const float* x, block_q5_1* y, int64_t k) {
  constexpr int qk = 32;
  const int64_t nb = k / qk;
  for (int64_t i = 0; i < nb; i++) {
    const auto [min, d] = block_min_step(x + i * qk, (1 << 5) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    y[i].m = f32_to_f16(min);
    uint8_t q[qk];
    for (int j = 0; j < qk; ++j) q[j] = static_cast<uint8_t>((x[i * qk + j] - min) * id + 0.5f);
    pack_q5(q, &y[i]);
  }
}

// Packs 2-bit quants L[0..256) into q2_K / q3_K's qs: four per byte, 32 apart.
void pack_2bit(const int8_t* L, uint8_t* qs) {
  for (int j = 0; j < QK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      qs[j / 4 + l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                           (L[j + l + 96] << 6));
    }
  }
}

void quantize_row_q2_K_ref(const float* x, block_q2_K* y, int64_t k) {
  const int64_t nb = k / QK_K;
  uint8_t L[QK_K];
  uint8_t Laux[16];
  float weights[16];
  float mins[QK_K / 16];
  float scales[QK_K / 16];
  const float q4scale = 15.f;
  for (int64_t i = 0; i < nb; i++) {
    float max_scale = 0;  // as the min is subtracted, scales are never negative
    float max_min = 0;
    for (int j = 0; j < QK_K / 16; ++j) {
      for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
      scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f,
                                   0.1f, 15, true);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    if (max_scale > 0) {
      const float iscale = q4scale / max_scale;
      for (int j = 0; j < QK_K / 16; ++j) {
        y[i].scales[j] = static_cast<uint8_t>(nearest_int(iscale * scales[j]));
      }
      y[i].d = f32_to_f16(max_scale / q4scale);
    } else {
      for (int j = 0; j < QK_K / 16; ++j) y[i].scales[j] = 0;
      y[i].d = f32_to_f16(0.f);
    }
    if (max_min > 0) {
      const float iscale = q4scale / max_min;
      for (int j = 0; j < QK_K / 16; ++j) {
        y[i].scales[j] |= static_cast<uint8_t>(nearest_int(iscale * mins[j]) << 4);
      }
      y[i].dmin = f32_to_f16(max_min / q4scale);
    } else {
      y[i].dmin = f32_to_f16(0.f);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
      const float d = f16_to_f32(y[i].d) * (y[i].scales[j] & 0xF);
      if (!d) continue;
      const float dm = f16_to_f32(y[i].dmin) * (y[i].scales[j] >> 4);
      for (int ii = 0; ii < 16; ++ii) {
        const int l = nearest_int((x[16 * j + ii] + dm) / d);
        L[16 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(3, l)));
      }
    }
    pack_2bit(reinterpret_cast<const int8_t*>(L), y[i].qs);
    x += QK_K;
  }
}

void quantize_row_q3_K_ref(const float* x, block_q3_K* y, int64_t k) {
  const int64_t nb = k / QK_K;
  int8_t L[QK_K];
  float scales[QK_K / 16];
  for (int64_t i = 0; i < nb; i++) {
    float max_scale = 0;
    float amax = 0;
    for (int j = 0; j < QK_K / 16; ++j) {
      scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
      const float scale = std::fabs(scales[j]);
      if (scale > amax) {
        amax = scale;
        max_scale = scales[j];
      }
    }
    std::memset(y[i].scales, 0, 12);
    if (max_scale) {
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < QK_K / 16; ++j) {
        int l = nearest_int(iscale * scales[j]);
        l = std::max(-32, std::min(31, l)) + 32;
        if (j < 8) {
          y[i].scales[j] = static_cast<uint8_t>(l & 0xF);
        } else {
          y[i].scales[j - 8] |= static_cast<uint8_t>((l & 0xF) << 4);
        }
        l >>= 4;
        y[i].scales[j % 4 + 8] |= static_cast<uint8_t>(l << (2 * (j / 4)));
      }
      y[i].d = f32_to_f16(1 / iscale);
    } else {
      y[i].d = f32_to_f16(0.f);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
      const float d = f16_to_f32(y[i].d) * q3_K_scale(y[i].scales, j);
      if (!d) continue;
      for (int ii = 0; ii < 16; ++ii) {
        int l = nearest_int(x[16 * j + ii] / d);
        l = std::max(-4, std::min(3, l));
        L[16 * j + ii] = static_cast<int8_t>(l + 4);
      }
    }
    // The high bit of quants 0-31 goes to bit 0 of hmask[0..32), of 32-63 to bit 1, ...
    std::memset(y[i].hmask, 0, QK_K / 8);
    for (int j = 0; j < QK_K; ++j) {
      if (L[j] > 3) {
        y[i].hmask[j % (QK_K / 8)] |= static_cast<uint8_t>(1u << (j / (QK_K / 8)));
        L[j] = static_cast<int8_t>(L[j] - 4);
      }
    }
    pack_2bit(L, y[i].qs);
    x += QK_K;
  }
}

// ggml's best_index_int8 over kvalues_iq4nl: the nearest of the 16 values to x,
// the lower one on a tie.
int best_index_iq4nl(float x) {
  if (x <= kvalue_iq4nl(0)) return 0;
  if (x >= kvalue_iq4nl(15)) return 15;
  int ml = 0, mu = 15;
  while (mu - ml > 1) {
    const int mav = (ml + mu) / 2;
    if (x < kvalue_iq4nl(mav)) {
      mu = mav;
    } else {
      ml = mav;
    }
  }
  return x - kvalue_iq4nl(mu - 1) < kvalue_iq4nl(mu) - x ? mu - 1 : mu;
}

// ggml's quantize_row_iq4_nl_impl as ggml_quantize_chunk runs it (no importance
// weights, so weights x^2; ntry 7) for one super-block of n elements in sub-blocks
// of 32: n = 32 is iq4_nl (one f16 scale), n = 256 iq4_xs (6-bit sub-block scales
// under an f16 one, written to scales_h / scales_l).
void quantize_iq4_superblock(int n, const float* x, uint16_t* dh, uint8_t* q4, uint16_t* scales_h,
                             uint8_t* scales_l) {
  constexpr int kBlock = 32;
  constexpr int ntry = 7;
  const float values0 = static_cast<float>(kvalue_iq4nl(0));
  uint8_t L[QK_K];
  float scales[QK_K / kBlock];
  float weight[kBlock];
  std::memset(q4, 0, n / 2);
  *dh = f32_to_f16(0.f);
  float max_scale = 0, amax_scale = 0;
  for (int ib = 0; ib < n / kBlock; ++ib) {
    const float* xb = x + ib * kBlock;
    uint8_t* Lb = L + ib * kBlock;
    for (int j = 0; j < kBlock; ++j) weight[j] = xb[j] * xb[j];
    float amax = 0, max = 0;
    for (int j = 0; j < kBlock; ++j) {
      const float ax = std::fabs(xb[j]);
      if (ax > amax) {
        amax = ax;
        max = xb[j];
      }
    }
    if (amax < kGroupMaxEps) {
      scales[ib] = 0;
      continue;
    }
    float d = -max / values0;
    float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int l = best_index_iq4nl(id * xb[j]);
      Lb[j] = static_cast<uint8_t>(l);
      const float q = static_cast<float>(kvalue_iq4nl(l));
      const float w = weight[j];
      sumqx += w * q * xb[j];
      sumq2 += w * q * q;
    }
    d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    float best = d * sumqx;
    for (int itry = -ntry; itry <= ntry; ++itry) {
      id = (itry + values0) / max;
      sumqx = sumq2 = 0;
      for (int j = 0; j < kBlock; ++j) {
        const float q = static_cast<float>(kvalue_iq4nl(best_index_iq4nl(id * xb[j])));
        const float w = weight[j];
        sumqx += w * q * xb[j];
        sumq2 += w * q * q;
      }
      if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
        d = sumqx / sumq2;
        best = d * sumqx;
      }
    }
    scales[ib] = d;
    const float abs_d = std::fabs(d);
    if (abs_d > amax_scale) {
      amax_scale = abs_d;
      max_scale = d;
    }
  }
  if (n > kBlock) {
    *scales_h = 0;
    const float d = -max_scale / 32;
    *dh = f32_to_f16(d);
    const float id = d ? 1 / d : 0.f;
    for (int ib = 0; ib < n / kBlock; ++ib) {
      int l = nearest_int(id * scales[ib]);
      l = std::max(-32, std::min(31, l));
      const float dl = d * l;
      const float idl = dl ? 1 / dl : 0.f;
      for (int j = 0; j < kBlock; ++j) {
        L[ib * kBlock + j] = static_cast<uint8_t>(best_index_iq4nl(idl * x[ib * kBlock + j]));
      }
      l += 32;
      const uint8_t l_l = static_cast<uint8_t>(l & 0xf);
      const uint8_t l_h = static_cast<uint8_t>(l >> 4);
      if (ib % 2 == 0) {
        scales_l[ib / 2] = l_l;
      } else {
        scales_l[ib / 2] |= static_cast<uint8_t>(l_l << 4);
      }
      *scales_h |= static_cast<uint16_t>(l_h << 2 * (ib % 8));
    }
  } else {
    *dh = f32_to_f16(scales[0]);
    const float id = scales[0] ? 1 / scales[0] : 0;
    for (int j = 0; j < n; ++j) L[j] = static_cast<uint8_t>(best_index_iq4nl(id * x[j]));
  }
  for (int i = 0; i < n / 32; ++i) {
    for (int j = 0; j < 16; ++j) {
      q4[16 * i + j] = static_cast<uint8_t>(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
    }
  }
}

void quantize_row_iq4_nl(const float* x, block_iq4_nl* y, int64_t k) {
  for (int64_t i = 0; i < k / 32; ++i) {
    quantize_iq4_superblock(32, x + 32 * i, &y[i].d, y[i].qs, nullptr, nullptr);
  }
}

void quantize_row_iq4_xs(const float* x, block_iq4_xs* y, int64_t k) {
  for (int64_t i = 0; i < k / QK_K; ++i) {
    quantize_iq4_superblock(QK_K, x + QK_K * i, &y[i].d, y[i].qs, &y[i].scales_h, y[i].scales_l);
  }
}

// ggml's best_index_mxfp4: the code whose value (times e) is nearest x, the first
// on a tie.
int best_index_mxfp4(float x, float e) {
  int best_index = 0;
  float best_err = std::fabs(kvalue_mxfp4(0) * e - x);
  for (int i = 1; i < 16; i++) {
    const float err = std::fabs(kvalue_mxfp4(i) * e - x);
    if (err < best_err) {
      best_index = i;
      best_err = err;
    }
  }
  return best_index;
}

void quantize_row_mxfp4_ref(const float* x, block_mxfp4* y, int64_t k) {
  constexpr int qk = 32;
  const int64_t nb = k / qk;
  for (int64_t i = 0; i < nb; i++) {
    float amax = 0.0f;
    for (int j = 0; j < qk; j++) amax = std::max(amax, std::fabs(x[i * qk + j]));
    const uint8_t e = amax > 0.0f ? static_cast<uint8_t>(std::floor(std::log2(amax)) - 2 + 127) : 0;
    const float d = e8m0_to_f32_half(e);
    y[i].e = e;
    for (int j = 0; j < qk / 2; ++j) {
      const int x0 = best_index_mxfp4(x[i * qk + 0 + j], d);
      const int x1 = best_index_mxfp4(x[i * qk + qk / 2 + j], d);
      y[i].qs[j] = static_cast<uint8_t>(x0 | (x1 << 4));
    }
  }
}

}  // namespace

bool quant_supported(GgmlType type) { return quant_block_elems(type) != 0; }

std::string quant_supported_names() {
  std::string names;
  for (uint32_t id = 0; id < 64; ++id) {
    if (ggml_type_info(id) == nullptr || !quant_supported(static_cast<GgmlType>(id))) continue;
    if (!names.empty()) names += ", ";
    names += ggml_type_name(id);
  }
  return names;
}

void quantize_row(GgmlType type, const float* x, void* dst, int64_t n) {
  if (!quant_supported(type)) QuantizeCheckFailed("quant_supported(type)", type, n);
  if (n < 0 || n % quant_block_elems(type) != 0) {
    QuantizeCheckFailed("n is a non-negative multiple of the block size", type, n);
  }
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_f16(x[i]);
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(x[i]);
      break;
    case GgmlType::kQ8_0:
      quantize_row_q8_0_ref(x, static_cast<block_q8_0*>(dst), n);
      break;
    case GgmlType::kQ4_0:
      quantize_row_q4_0_ref(x, static_cast<block_q4_0*>(dst), n);
      break;
    case GgmlType::kQ4_K:
      quantize_row_q4_K_ref(x, static_cast<block_q4_K*>(dst), n);
      break;
    case GgmlType::kQ5_K:
      quantize_row_q5_K_ref(x, static_cast<block_q5_K*>(dst), n);
      break;
    case GgmlType::kQ6_K:
      quantize_row_q6_K_ref(x, static_cast<block_q6_K*>(dst), n);
      break;
    case GgmlType::kQ4_1:
      quantize_row_q4_1_ref(x, static_cast<block_q4_1*>(dst), n);
      break;
    case GgmlType::kQ5_0:
      quantize_row_q5_0_ref(x, static_cast<block_q5_0*>(dst), n);
      break;
    case GgmlType::kQ5_1:
      quantize_row_q5_1_ref(x, static_cast<block_q5_1*>(dst), n);
      break;
    case GgmlType::kQ2_K:
      quantize_row_q2_K_ref(x, static_cast<block_q2_K*>(dst), n);
      break;
    case GgmlType::kQ3_K:
      quantize_row_q3_K_ref(x, static_cast<block_q3_K*>(dst), n);
      break;
    case GgmlType::kIQ4_NL:
      quantize_row_iq4_nl(x, static_cast<block_iq4_nl*>(dst), n);
      break;
    case GgmlType::kIQ4_XS:
      quantize_row_iq4_xs(x, static_cast<block_iq4_xs*>(dst), n);
      break;
    case GgmlType::kMXFP4:
      quantize_row_mxfp4_ref(x, static_cast<block_mxfp4*>(dst), n);
      break;
    default:
      QuantizeCheckFailed("quant_supported(type)", type, n);
  }
}

}  // namespace moegraph
