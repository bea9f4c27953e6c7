#include "cpu/act_quant.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace moegraph {
namespace {

// ggml's nearest_int: round to nearest, ties to even, for |x| < 2^22.
int nearest_int(float x) {
  const float v = x + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, sizeof(i));
  return (i & 0x007fffff) - 0x00400000;
}

// One 32-value block of quantize_row_q8_0_ref: returns d, writes qs.
float quantize_block_q8(const float* x, int8_t* qs) {
  float amax = 0.0f;
  for (int j = 0; j < QK8_0; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < QK8_0; ++j) qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  return d;
}

void quantize_q8_0(const float* x, int64_t cols, block_q8_0* y) {
  for (int64_t b = 0; b < cols / QK8_0; ++b, x += QK8_0) {
    y[b].d = f32_to_f16(quantize_block_q8(x, y[b].qs));
  }
}

// quantize_row_q8_1_ref: q8_0's rounding, and s from the integer sum.
void quantize_q8_1(const float* x, int64_t cols, block_q8_1* y) {
  for (int64_t b = 0; b < cols / QK8_0; ++b, x += QK8_0) {
    const float d = quantize_block_q8(x, y[b].qs);
    int sum = 0;
    for (int j = 0; j < QK8_0; ++j) sum += y[b].qs[j];
    y[b].d = f32_to_f16(d);
    y[b].s = f32_to_f16(static_cast<float>(sum) * d);
  }
}

void quantize_q8_K(const float* x, int64_t cols, block_q8_K* y) {
  for (int64_t b = 0; b < cols / QK_K; ++b, x += QK_K) {
    float max = 0.0f;
    float amax = 0.0f;
    for (int j = 0; j < QK_K; ++j) {
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; ++j) {
      const int v = nearest_int(iscale * x[j]);
      y[b].qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += y[b].qs[j * 16 + i];
      y[b].bsums[j] = static_cast<int16_t>(sum);
    }
    y[b].d = 1.0f / iscale;
  }
}

float dot_q8_0(const block_q8_0* x, const block_q8_0* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < QK8_0; ++j) sumi += x[b].qs[j] * y[b].qs[j];
    sum += static_cast<float>(sumi) * (f16_to_f32(x[b].d) * f16_to_f32(y[b].d));
  }
  return sum;
}

float dot_q4_0(const block_q4_0* x, const block_q8_0* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < QK4_0 / 2; ++j) {
      sumi += ((x[b].qs[j] & 0x0F) - 8) * y[b].qs[j];
      sumi += ((x[b].qs[j] >> 4) - 8) * y[b].qs[j + QK4_0 / 2];
    }
    sum += static_cast<float>(sumi) * (f16_to_f32(x[b].d) * f16_to_f32(y[b].d));
  }
  return sum;
}

// q4_K and q5_K: 8 groups of 32 with a 6-bit scale and min each; q5_K's qh
// holds the fifth bit of element l of 64-element chunk c at bits 2c and 2c + 1.
template <typename Block>
float dot_k45(const Block* x, const block_q8_K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) get_scale_min_k4(j, x[b].scales, &sc[j], &mn[j]);
    int summ = 0;
    for (int j = 0; j < QK_K / 16; ++j) summ += y[b].bsums[j] * mn[j / 2];
    int sumi = 0;
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = x[b].qs + 32 * c;
      const int8_t* a = y[b].qs + 64 * c;
      int lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        int wl = q[l] & 0x0F;
        int wh = q[l] >> 4;
        if constexpr (std::is_same_v<Block, block_q5_K>) {
          wl += ((x[b].qh[l] >> (2 * c)) & 1) << 4;
          wh += ((x[b].qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        lo += wl * a[l];
        hi += wh * a[l + 32];
      }
      sumi += sc[2 * c] * lo + sc[2 * c + 1] * hi;
    }
    sum += f16_to_f32(x[b].d) * y[b].d * static_cast<float>(sumi) -
           f16_to_f32(x[b].dmin) * y[b].d * static_cast<float>(summ);
  }
  return sum;
}

float dot_q6_K(const block_q6_K* x, const block_q8_K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t w[QK_K];
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x[b].ql + 64 * half;
      const uint8_t* qh = x[b].qh + 32 * half;
      int8_t* a = w + 128 * half;
      for (int l = 0; l < 32; ++l) {
        a[l + 0] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        a[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        a[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        a[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
    int sumi = 0;
    for (int g = 0; g < QK_K / 16; ++g) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += w[16 * g + l] * y[b].qs[16 * g + l];
      sumi += x[b].scales[g] * s;
    }
    sum += f16_to_f32(x[b].d) * y[b].d * static_cast<float>(sumi);
  }
  return sum;
}

// The dots below follow ggml-cpu/quants.c's ggml_vec_dot_*_generic, operand
// order included.

// q4_1 and q5_1 with q8_1: d_w d_a sum(q_w q_a) + m_w s_a.
template <typename Block>
float dot_min_q8_1(const Block* x, const block_q8_1* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < QK8_0; ++j) {
      int q;
      if constexpr (std::is_same_v<Block, block_q5_1>) {
        q = q5_quant(x[b].qs, x[b].qh, j);
      } else {
        q = j < 16 ? x[b].qs[j] & 0x0F : x[b].qs[j - 16] >> 4;
      }
      sumi += q * y[b].qs[j];
    }
    sum += (f16_to_f32(x[b].d) * f16_to_f32(y[b].d)) * static_cast<float>(sumi) +
           f16_to_f32(x[b].m) * f16_to_f32(y[b].s);
  }
  return sum;
}

float dot_q5_0(const block_q5_0* x, const block_q8_0* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < QK8_0; ++j) sumi += (q5_quant(x[b].qs, x[b].qh, j) - 16) * y[b].qs[j];
    sum += (f16_to_f32(x[b].d) * f16_to_f32(y[b].d)) * static_cast<float>(sumi);
  }
  return sum;
}

// iq4_nl and mxfp4: a 16-value table per nibble, one scale per 32.
template <typename Block>
float dot_table_q8_0(const Block* x, const block_q8_0* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float d;
    int sumi = 0;
    for (int j = 0; j < QK8_0 / 2; ++j) {
      if constexpr (std::is_same_v<Block, block_mxfp4>) {
        sumi += y[b].qs[j] * kvalue_mxfp4(x[b].qs[j] & 0xf) +
                y[b].qs[j + 16] * kvalue_mxfp4(x[b].qs[j] >> 4);
      } else {
        sumi += y[b].qs[j] * kvalue_iq4nl(x[b].qs[j] & 0xf) +
                y[b].qs[j + 16] * kvalue_iq4nl(x[b].qs[j] >> 4);
      }
    }
    if constexpr (std::is_same_v<Block, block_mxfp4>) {
      d = f16_to_f32(y[b].d) * e8m0_to_f32_half(x[b].e);
    } else {
      d = f16_to_f32(y[b].d) * f16_to_f32(x[b].d);
    }
    sum += d * static_cast<float>(sumi);
  }
  return sum;
}

float dot_q2_K(const block_q2_K* x, const block_q8_K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sc = x[b].scales;
    int summs = 0;
    for (int j = 0; j < 16; ++j) summs += y[b].bsums[j] * (sc[j] >> 4);
    const float dall = y[b].d * f16_to_f32(x[b].d);
    const float dmin = y[b].d * f16_to_f32(x[b].dmin);
    int isum = 0;
    for (int g = 0; g < 16; ++g) {
      // Group g: 16 quants of byte run 32 (g / 8) + 16 (g % 2), bits 2 ((g / 2) % 4).
      const uint8_t* q2 = x[b].qs + 32 * (g / 8) + 16 * (g % 2);
      const int shift = 2 * ((g / 2) % 4);
      const int8_t* q8 = y[b].qs + 16 * g;
      int isuml = 0;
      for (int l = 0; l < 16; ++l) isuml += q8[l] * ((q2[l] >> shift) & 3);
      isum += (sc[g] & 0xF) * isuml;
    }
    sum += dall * static_cast<float>(isum) - dmin * static_cast<float>(summs);
  }
  return sum;
}

// ggml sums q3_K in 8 float lanes (lane l takes elements 8i + l) across blocks,
// then adds the lanes.
float dot_q3_K(const block_q3_K* x, const block_q8_K* y, int64_t nb) {
  float sums[8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t aux32[8] = {};
    for (int g = 0; g < 16; ++g) {
      const int scale = q3_K_scale(x[b].scales, g);
      for (int l = 0; l < 16; ++l) {
        const int i = 16 * g + l;  // element: chunk i / 128, bits 2 ((i / 32) % 4)
        const int low = (x[b].qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
        const int q = low - ((x[b].hmask[i % 32] >> (i / 32)) & 1 ? 0 : 4);
        aux32[l % 8] += scale * static_cast<int16_t>(y[b].qs[i] * q);
      }
    }
    const float d = f16_to_f32(x[b].d) * y[b].d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(aux32[l]);
  }
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += sums[l];
  return sum;
}

float dot_iq4_xs(const block_iq4_xs* x, const block_q8_K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float d4d8 = f16_to_f32(x[b].d) * y[b].d;
    for (int ib = 0; ib < QK_K / 32; ++ib) {
      const float dl = d4d8 * static_cast<float>(iq4_xs_scale(&x[b], ib));
      const uint8_t* qs = x[b].qs + 16 * ib;
      const int8_t* q8 = y[b].qs + 32 * ib;
      int sumi1 = 0, sumi2 = 0;
      for (int j = 0; j < 16; ++j) {
        sumi1 += q8[j] * kvalue_iq4nl(qs[j] & 0xf);
        sumi2 += q8[j + 16] * kvalue_iq4nl(qs[j] >> 4);
      }
      sum += dl * static_cast<float>(sumi1 + sumi2);
    }
  }
  return sum;
}

}  // namespace

ActType act_type_for(GgmlType w) {
  switch (w) {
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0:
    case GgmlType::kIQ4_NL:
    case GgmlType::kMXFP4:
      return ActType::kQ8_0;
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1:
      return ActType::kQ8_1;
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_XS:
      return ActType::kQ8_K;
    default:
      return ActType::kF32;
  }
}

size_t act_row_bytes(ActType type, int64_t cols) {
  switch (type) {
    case ActType::kQ8_0:
      return static_cast<size_t>(cols / QK8_0) * sizeof(block_q8_0);
    case ActType::kQ8_1:
      return static_cast<size_t>(cols / QK8_0) * sizeof(block_q8_1);
    case ActType::kQ8_K:
      return static_cast<size_t>(cols / QK_K) * sizeof(block_q8_K);
    case ActType::kF32:
      break;
  }
  return static_cast<size_t>(cols) * sizeof(float);
}

void quantize_act_row(ActType type, const float* x, int64_t cols, uint8_t* dst) {
  switch (type) {
    case ActType::kQ8_0:
      quantize_q8_0(x, cols, reinterpret_cast<block_q8_0*>(dst));
      return;
    case ActType::kQ8_1:
      quantize_q8_1(x, cols, reinterpret_cast<block_q8_1*>(dst));
      return;
    case ActType::kQ8_K:
      quantize_q8_K(x, cols, reinterpret_cast<block_q8_K*>(dst));
      return;
    case ActType::kF32:
      std::memcpy(dst, x, static_cast<size_t>(cols) * sizeof(float));
      return;
  }
}

float dot_row_ref(GgmlType w, const uint8_t* w_row, const uint8_t* act_row, int64_t cols) {
  const auto* q8_0 = reinterpret_cast<const block_q8_0*>(act_row);
  const auto* q8_1 = reinterpret_cast<const block_q8_1*>(act_row);
  const auto* q8_K = reinterpret_cast<const block_q8_K*>(act_row);
  switch (w) {
    case GgmlType::kQ8_0:
      return dot_q8_0(reinterpret_cast<const block_q8_0*>(w_row), q8_0, cols / QK8_0);
    case GgmlType::kQ4_0:
      return dot_q4_0(reinterpret_cast<const block_q4_0*>(w_row), q8_0, cols / QK4_0);
    case GgmlType::kQ4_K:
      return dot_k45(reinterpret_cast<const block_q4_K*>(w_row), q8_K, cols / QK_K);
    case GgmlType::kQ5_K:
      return dot_k45(reinterpret_cast<const block_q5_K*>(w_row), q8_K, cols / QK_K);
    case GgmlType::kQ6_K:
      return dot_q6_K(reinterpret_cast<const block_q6_K*>(w_row), q8_K, cols / QK_K);
    case GgmlType::kQ4_1:
      return dot_min_q8_1(reinterpret_cast<const block_q4_1*>(w_row), q8_1, cols / QK8_0);
    case GgmlType::kQ5_1:
      return dot_min_q8_1(reinterpret_cast<const block_q5_1*>(w_row), q8_1, cols / QK8_0);
    case GgmlType::kQ5_0:
      return dot_q5_0(reinterpret_cast<const block_q5_0*>(w_row), q8_0, cols / QK8_0);
    case GgmlType::kIQ4_NL:
      return dot_table_q8_0(reinterpret_cast<const block_iq4_nl*>(w_row), q8_0, cols / QK8_0);
    case GgmlType::kMXFP4:
      return dot_table_q8_0(reinterpret_cast<const block_mxfp4*>(w_row), q8_0, cols / QK8_0);
    case GgmlType::kQ2_K:
      return dot_q2_K(reinterpret_cast<const block_q2_K*>(w_row), q8_K, cols / QK_K);
    case GgmlType::kQ3_K:
      return dot_q3_K(reinterpret_cast<const block_q3_K*>(w_row), q8_K, cols / QK_K);
    case GgmlType::kIQ4_XS:
      return dot_iq4_xs(reinterpret_cast<const block_iq4_xs*>(w_row), q8_K, cols / QK_K);
    default:
      break;
  }
  const auto* a = reinterpret_cast<const float*>(act_row);
  float sum = 0.0f;
  for (int64_t i = 0; i < cols; ++i) {
    float v;
    if (w == GgmlType::kF16) {
      v = f16_to_f32(reinterpret_cast<const uint16_t*>(w_row)[i]);
    } else if (w == GgmlType::kBF16) {
      v = bf16_to_f32(reinterpret_cast<const uint16_t*>(w_row)[i]);
    } else {
      v = reinterpret_cast<const float*>(w_row)[i];
    }
    sum += v * a[i];
  }
  return sum;
}

}  // namespace moegraph
