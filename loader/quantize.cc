// Ports of ggml's reference quantizers (ggml/src/ggml-quants.c). The float
// expressions keep ggml's operand order and types: the output bytes depend on every
// rounding, so a "cleaner" rewrite would drift from the files ggml writes.
#include "loader/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// ggml's make_qkx2_quants with squared error (use_mad false): asymmetric quants
// L in [0, nmax], returning the scale and writing -min, searching nstep + 1 scales
// with a weighted least-squares fit of scale and min for each.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                       float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep) {
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
    diff = diff * diff;
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
        diff = diff * diff;
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
                                 rdelta, nstep);
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

}  // namespace

bool quant_supported(GgmlType type) { return quant_block_elems(type) != 0; }

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
    default:
      QuantizeCheckFailed("quant_supported(type)", type, n);
  }
}

}  // namespace moegraph
