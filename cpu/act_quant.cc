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

void quantize_q8_0(const float* x, int64_t cols, block_q8_0* y) {
  for (int64_t b = 0; b < cols / QK8_0; ++b, x += QK8_0) {
    float amax = 0.0f;
    for (int j = 0; j < QK8_0; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_f16(d);
    for (int j = 0; j < QK8_0; ++j) y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
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

}  // namespace

ActType act_type_for(GgmlType w) {
  switch (w) {
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
      return ActType::kQ8_0;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return ActType::kQ8_K;
    default:
      return ActType::kF32;
  }
}

size_t act_row_bytes(ActType type, int64_t cols) {
  switch (type) {
    case ActType::kQ8_0:
      return static_cast<size_t>(cols / QK8_0) * sizeof(block_q8_0);
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
