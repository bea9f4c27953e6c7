// The block formats ggml stores in GGUF files (ggml/src/ggml-common.h) and their
// dequantization, computed as ggml's dequantize_row_* reference code does
// (ggml/src/ggml-quants.c), in the same order, so every float matches ggml's bit
// for bit on the CPU and on the GPU. Light on purpose: .cu files include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "loader/ggml_type.h"
#include "loader/host_device.h"

namespace moegraph {

// ggml's names, so the code reads side by side with ggml-quants.c.
inline constexpr int QK8_0 = 32;
inline constexpr int QK4_0 = 32;
inline constexpr int QK_K = 256;
inline constexpr int K_SCALE_SIZE = 12;

// Half-precision values travel as raw bits (ggml_half).
struct block_q8_0 {
  uint16_t d;         // scale, f16
  int8_t qs[QK8_0];   // quants
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must match ggml");

// ggml's block_q8_1: q8_0 with s = d * sum(qs), the activations of the weight
// types with a min (CPU) and of every quant type (CUDA, ggml-cuda's mmvq).
inline constexpr int QK8_1 = 32;
struct block_q8_1 {
  uint16_t d;        // scale, f16
  uint16_t s;        // d * the sum of the quants, f16
  int8_t qs[QK8_1];  // quants
};
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 must match ggml");

struct block_q4_0 {
  uint16_t d;            // scale, f16
  uint8_t qs[QK4_0 / 2]; // nibbles: element j low, element j + 16 high
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must match ggml");

struct block_q4_K {
  uint16_t d;                     // super-block scale for the 6-bit scales, f16
  uint16_t dmin;                  // super-block scale for the 6-bit mins, f16
  uint8_t scales[K_SCALE_SIZE];   // 8 scales and 8 mins, 6 bits each
  uint8_t qs[QK_K / 2];           // 4-bit quants
};
static_assert(sizeof(block_q4_K) == 144, "block_q4_K must match ggml");

struct block_q5_K {
  uint16_t d;                     // super-block scale for the 6-bit scales, f16
  uint16_t dmin;                  // super-block scale for the 6-bit mins, f16
  uint8_t scales[K_SCALE_SIZE];   // 8 scales and 8 mins, 6 bits each
  uint8_t qh[QK_K / 8];           // quants, high bit
  uint8_t qs[QK_K / 2];           // quants, low 4 bits
};
static_assert(sizeof(block_q5_K) == 176, "block_q5_K must match ggml");

struct block_q6_K {
  uint8_t ql[QK_K / 2];      // quants, low 4 bits
  uint8_t qh[QK_K / 4];      // quants, high 2 bits
  int8_t scales[QK_K / 16];  // 16 scales, 8 bits each
  uint16_t d;                // super-block scale, f16
};
static_assert(sizeof(block_q6_K) == 210, "block_q6_K must match ggml");

struct block_q4_1 {
  uint16_t d;             // scale, f16
  uint16_t m;             // min, f16
  uint8_t qs[QK4_0 / 2];  // nibbles: element j low, element j + 16 high
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must match ggml");

struct block_q5_0 {
  uint16_t d;             // scale, f16
  uint8_t qh[4];          // fifth bit of each quant, element j at bit j
  uint8_t qs[QK4_0 / 2];  // low nibbles, as q4_0
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must match ggml");

struct block_q5_1 {
  uint16_t d;             // scale, f16
  uint16_t m;             // min, f16
  uint8_t qh[4];          // fifth bit of each quant, element j at bit j
  uint8_t qs[QK4_0 / 2];  // low nibbles, as q4_0
};
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must match ggml");

struct block_q2_K {
  uint8_t scales[QK_K / 16];  // 16 scales (low nibble) and mins (high nibble)
  uint8_t qs[QK_K / 4];       // 2-bit quants
  uint16_t d;                 // super-block scale for the scales, f16
  uint16_t dmin;              // super-block scale for the mins, f16
};
static_assert(sizeof(block_q2_K) == 84, "block_q2_K must match ggml");

struct block_q3_K {
  uint8_t hmask[QK_K / 8];  // quants, high bit
  uint8_t qs[QK_K / 4];     // quants, low 2 bits
  uint8_t scales[12];       // 16 scales, 6 bits each
  uint16_t d;               // super-block scale, f16
};
static_assert(sizeof(block_q3_K) == 110, "block_q3_K must match ggml");

struct block_iq4_nl {
  uint16_t d;             // scale, f16
  uint8_t qs[QK4_0 / 2];  // indices into kvalues_iq4nl, laid out as q4_0's nibbles
};
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl must match ggml");

struct block_iq4_xs {
  uint16_t d;                   // super-block scale, f16
  uint16_t scales_h;            // high 2 bits of the 8 sub-block scales
  uint8_t scales_l[QK_K / 64];  // low 4 bits of the 8 sub-block scales
  uint8_t qs[QK_K / 2];         // indices into kvalues_iq4nl, per 32 as iq4_nl's
};
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs must match ggml");

struct block_mxfp4 {
  uint8_t e;              // shared exponent, E8M0
  uint8_t qs[QK4_0 / 2];  // E2M1 codes, laid out as q4_0's nibbles
};
static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4 must match ggml");

// ---- f16 / bf16 <-> f32, in integer code so host and device agree exactly ----

MG_HD inline uint32_t f32_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

MG_HD inline float f32_from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

// Exact widening. A NaN keeps its payload with the quiet bit set, which is what
// ggml's float-arithmetic version produces on x86.
MG_HD inline float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  // One instruction on the device; exact, as every f16 is an f32.
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {
    const uint32_t quiet = mantissa != 0 ? 0x400000u : 0u;
    return f32_from_bits(sign | 0x7f800000u | quiet | (mantissa << 13));
  }
  if (exponent != 0) return f32_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return f32_from_bits(sign);
  // Subnormal: shift the leading one into the implicit bit.
  uint32_t f32_exponent = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --f32_exponent;
  }
  return f32_from_bits(sign | (f32_exponent << 23) | ((mantissa & 0x3ffu) << 13));
#endif
}

// Round to nearest even, subnormals kept, overflow to inf; every NaN becomes
// 0x7e00 with its sign, as ggml's GGML_FP32_TO_FP16 does.
MG_HD inline uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  // Round to nearest even, as below (a NaN's payload aside).
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const uint32_t bits = f32_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520
  if (magnitude >= 0x38800000u) {  // a normal f16 (>= 2^-14)
    // Rebias the exponent (-112 << 23) and round at bit 13; a carry bumps the exponent.
    const uint32_t odd = (magnitude >> 13) & 1u;
    magnitude += 0xc8000fffu + odd;
    return static_cast<uint16_t>(sign | (magnitude >> 13));
  }
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
  // Units of 2^-24: value = significand * 2^(exponent - 150).
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t units = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (units & 1u))) ++units;
  return static_cast<uint16_t>(sign | units);
#endif
}

MG_HD inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// ggml's GGML_FP32_TO_BF16: round to nearest even; a NaN is truncated and made quiet.
MG_HD inline uint16_t f32_to_bf16(float f) {
  const uint32_t bits = f32_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 64u);
  return static_cast<uint16_t>((bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16);
}

// a * b, never fused with a following add: nvcc contracts a * b - c into an FMA by
// default, which would round differently from ggml's CPU code.
MG_HD inline float mul_unfused(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// ggml-common.h's kvalues_iq4nl and kvalues_mxfp4 (E2M1 values, doubled) as
// little-endian bytes of two words each (entries 0-7, 8-15): immediates on the
// device, no table in memory.
// -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
inline constexpr uint64_t kIq4nlLow = 0xf6eaddcfbfad9881ull, kIq4nlHigh = 0x7159453526190d01ull;
// 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
inline constexpr uint64_t kMxfp4Low = 0x0c08060403020100ull, kMxfp4High = 0xf4f8fafcfdfeff00ull;

MG_HD inline int kvalue_iq4nl(int i) {
  return static_cast<int8_t>((i < 8 ? kIq4nlLow : kIq4nlHigh) >> (8 * (i & 7)));
}

MG_HD inline int kvalue_mxfp4(int i) {
  return static_cast<int8_t>((i < 8 ? kMxfp4Low : kMxfp4High) >> (8 * (i & 7)));
}

// ggml-impl.h's ggml_e8m0_to_fp32_half: 2^(e - 128), the MXFP4 block scale halved
// because kvalues_mxfp4 holds doubled values.
MG_HD inline float e8m0_to_f32_half(uint8_t e) {
  return f32_from_bits(e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23);
}

// ---- per-block dequantization, as ggml's dequantize_row_* ----

MG_HD inline void dequantize_block_q8_0(const block_q8_0* x, float* y) {
  const float d = f16_to_f32(x->d);
  for (int j = 0; j < QK8_0; ++j) y[j] = x->qs[j] * d;
}

MG_HD inline void dequantize_block_q4_0(const block_q4_0* x, float* y) {
  const float d = f16_to_f32(x->d);
  for (int j = 0; j < QK4_0 / 2; ++j) {
    const int x0 = (x->qs[j] & 0x0f) - 8;
    const int x1 = (x->qs[j] >> 4) - 8;
    y[j] = static_cast<float>(x0) * d;
    y[j + QK4_0 / 2] = static_cast<float>(x1) * d;
  }
}

// Scale j and min j of a q4_K / q5_K block, 6 bits each, packed in 12 bytes.
MG_HD inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

MG_HD inline void dequantize_block_q4_K(const block_q4_K* x, float* y) {
  const uint8_t* q = x->qs;
  const float d = f16_to_f32(x->d);
  const float min = f16_to_f32(x->dmin);
  int is = 0;
  uint8_t sc, m;
  for (int j = 0; j < QK_K; j += 64) {
    get_scale_min_k4(is + 0, x->scales, &sc, &m);
    const float d1 = d * sc;
    const float m1 = min * m;
    get_scale_min_k4(is + 1, x->scales, &sc, &m);
    const float d2 = d * sc;
    const float m2 = min * m;
    for (int l = 0; l < 32; ++l) *y++ = mul_unfused(d1, q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) *y++ = mul_unfused(d2, q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

MG_HD inline void dequantize_block_q5_K(const block_q5_K* x, float* y) {
  const uint8_t* ql = x->qs;
  const uint8_t* qh = x->qh;
  const float d = f16_to_f32(x->d);
  const float min = f16_to_f32(x->dmin);
  int is = 0;
  uint8_t sc, m;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < QK_K; j += 64) {
    get_scale_min_k4(is + 0, x->scales, &sc, &m);
    const float d1 = d * sc;
    const float m1 = min * m;
    get_scale_min_k4(is + 1, x->scales, &sc, &m);
    const float d2 = d * sc;
    const float m2 = min * m;
    for (int l = 0; l < 32; ++l) {
      *y++ = mul_unfused(d1, static_cast<float>((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0))) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = mul_unfused(d2, static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0))) - m2;
    }
    ql += 32;
    is += 2;
    u1 <<= 2;
    u2 <<= 2;
  }
}

MG_HD inline void dequantize_block_q6_K(const block_q6_K* x, float* y) {
  const float d = f16_to_f32(x->d);
  const uint8_t* ql = x->ql;
  const uint8_t* qh = x->qh;
  const int8_t* sc = x->scales;
  for (int n = 0; n < QK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int8_t q1 = static_cast<int8_t>((ql[l + 0] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int8_t q2 = static_cast<int8_t>((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int8_t q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int8_t q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * sc[is + 0] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

MG_HD inline void dequantize_block_q4_1(const block_q4_1* x, float* y) {
  const float d = f16_to_f32(x->d);
  const float m = f16_to_f32(x->m);
  for (int j = 0; j < QK4_0 / 2; ++j) {
    y[j] = mul_unfused(static_cast<float>(x->qs[j] & 0x0f), d) + m;
    y[j + QK4_0 / 2] = mul_unfused(static_cast<float>(x->qs[j] >> 4), d) + m;
  }
}

// Quant j of a q5_0 / q5_1 block: its nibble with the fifth bit from qh.
MG_HD inline int q5_quant(const uint8_t* qs, const uint8_t* qh, int j) {
  uint32_t h;
  memcpy(&h, qh, sizeof(h));
  const int nibble = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
  return nibble | static_cast<int>(((h >> j) & 1u) << 4);
}

MG_HD inline void dequantize_block_q5_0(const block_q5_0* x, float* y) {
  const float d = f16_to_f32(x->d);
  for (int j = 0; j < QK4_0; ++j) y[j] = static_cast<float>(q5_quant(x->qs, x->qh, j) - 16) * d;
}

MG_HD inline void dequantize_block_q5_1(const block_q5_1* x, float* y) {
  const float d = f16_to_f32(x->d);
  const float m = f16_to_f32(x->m);
  for (int j = 0; j < QK4_0; ++j) {
    y[j] = mul_unfused(static_cast<float>(q5_quant(x->qs, x->qh, j)), d) + m;
  }
}

MG_HD inline void dequantize_block_q2_K(const block_q2_K* x, float* y) {
  const float d = f16_to_f32(x->d);
  const float min = f16_to_f32(x->dmin);
  const uint8_t* q = x->qs;
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = x->scales[is++];
        const float dl = d * (sc & 0xf);
        const float ml = min * (sc >> 4);
        for (int l = 0; l < 16; ++l) {
          *y++ = mul_unfused(dl, static_cast<float>((q[l + 16 * half] >> shift) & 3)) - ml;
        }
      }
    }
    q += 32;
  }
}

// Scale j (0..15) of a q3_K block, 6 bits, minus 32: ggml's kmask unpacking of the
// 12 scale bytes (low nibbles in bytes 0-7, high 2-bit pairs in bytes 8-11).
MG_HD inline int q3_K_scale(const uint8_t* scales, int j) {
  const int low = j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4;
  const int high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

MG_HD inline void dequantize_block_q3_K(const block_q3_K* x, float* y) {
  const float d_all = f16_to_f32(x->d);
  const uint8_t* q = x->qs;
  uint8_t m = 1;
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * q3_K_scale(x->scales, is++);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int low = (q[l] >> shift) & 3;
          *y++ = dl * static_cast<float>(low - ((x->hmask[l] & m) ? 0 : 4));
        }
      }
      m <<= 1;
    }
    q += 32;
  }
}

MG_HD inline void dequantize_block_iq4_nl(const block_iq4_nl* x, float* y) {
  const float d = f16_to_f32(x->d);
  for (int j = 0; j < QK4_0 / 2; ++j) {
    y[j] = d * static_cast<float>(kvalue_iq4nl(x->qs[j] & 0xf));
    y[j + QK4_0 / 2] = d * static_cast<float>(kvalue_iq4nl(x->qs[j] >> 4));
  }
}

// Sub-block scale ib (0..7) of an iq4_xs block, 6 bits, minus 32.
MG_HD inline int iq4_xs_scale(const block_iq4_xs* x, int ib) {
  const int low = (x->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf;
  const int high = (x->scales_h >> (2 * ib)) & 3;
  return (low | (high << 4)) - 32;
}

MG_HD inline void dequantize_block_iq4_xs(const block_iq4_xs* x, float* y) {
  const float d = f16_to_f32(x->d);
  const uint8_t* qs = x->qs;
  for (int ib = 0; ib < QK_K / 32; ++ib) {
    const float dl = d * iq4_xs_scale(x, ib);
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * static_cast<float>(kvalue_iq4nl(qs[j] & 0xf));
      y[j + 16] = dl * static_cast<float>(kvalue_iq4nl(qs[j] >> 4));
    }
    y += 32;
    qs += 16;
  }
}

MG_HD inline void dequantize_block_mxfp4(const block_mxfp4* x, float* y) {
  const float d = e8m0_to_f32_half(x->e);
  for (int j = 0; j < QK4_0 / 2; ++j) {
    y[j] = static_cast<float>(kvalue_mxfp4(x->qs[j] & 0xf)) * d;
    y[j + QK4_0 / 2] = static_cast<float>(kvalue_mxfp4(x->qs[j] >> 4)) * d;
  }
}

// ---- dispatch over the types moegraph reads ----

// Elements per block (1 for f32/f16/bf16); 0 for a type moegraph does not read.
MG_HD constexpr int64_t quant_block_elems(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return 1;
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kIQ4_NL:
    case GgmlType::kMXFP4:
      return 32;
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_XS:
      return QK_K;
    default:
      return 0;
  }
}

// Bytes per block; 0 for a type moegraph does not read.
MG_HD constexpr int64_t quant_block_bytes(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return 4;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return 2;
    case GgmlType::kQ8_0:
      return sizeof(block_q8_0);
    case GgmlType::kQ4_0:
      return sizeof(block_q4_0);
    case GgmlType::kQ4_K:
      return sizeof(block_q4_K);
    case GgmlType::kQ5_K:
      return sizeof(block_q5_K);
    case GgmlType::kQ6_K:
      return sizeof(block_q6_K);
    case GgmlType::kQ4_1:
      return sizeof(block_q4_1);
    case GgmlType::kQ5_0:
      return sizeof(block_q5_0);
    case GgmlType::kQ5_1:
      return sizeof(block_q5_1);
    case GgmlType::kQ2_K:
      return sizeof(block_q2_K);
    case GgmlType::kQ3_K:
      return sizeof(block_q3_K);
    case GgmlType::kIQ4_NL:
      return sizeof(block_iq4_nl);
    case GgmlType::kIQ4_XS:
      return sizeof(block_iq4_xs);
    case GgmlType::kMXFP4:
      return sizeof(block_mxfp4);
    default:
      return 0;
  }
}

// Dequantizes one block (quant_block_elems(type) floats). type must be one
// quant_block_elems accepts; others write nothing.
MG_HD inline void dequantize_block(GgmlType type, const void* block, float* y) {
  switch (type) {
    case GgmlType::kF32:
      *y = *static_cast<const float*>(block);
      break;
    case GgmlType::kF16:
      *y = f16_to_f32(*static_cast<const uint16_t*>(block));
      break;
    case GgmlType::kBF16:
      *y = bf16_to_f32(*static_cast<const uint16_t*>(block));
      break;
    case GgmlType::kQ8_0:
      dequantize_block_q8_0(static_cast<const block_q8_0*>(block), y);
      break;
    case GgmlType::kQ4_0:
      dequantize_block_q4_0(static_cast<const block_q4_0*>(block), y);
      break;
    case GgmlType::kQ4_K:
      dequantize_block_q4_K(static_cast<const block_q4_K*>(block), y);
      break;
    case GgmlType::kQ5_K:
      dequantize_block_q5_K(static_cast<const block_q5_K*>(block), y);
      break;
    case GgmlType::kQ6_K:
      dequantize_block_q6_K(static_cast<const block_q6_K*>(block), y);
      break;
    case GgmlType::kQ4_1:
      dequantize_block_q4_1(static_cast<const block_q4_1*>(block), y);
      break;
    case GgmlType::kQ5_0:
      dequantize_block_q5_0(static_cast<const block_q5_0*>(block), y);
      break;
    case GgmlType::kQ5_1:
      dequantize_block_q5_1(static_cast<const block_q5_1*>(block), y);
      break;
    case GgmlType::kQ2_K:
      dequantize_block_q2_K(static_cast<const block_q2_K*>(block), y);
      break;
    case GgmlType::kQ3_K:
      dequantize_block_q3_K(static_cast<const block_q3_K*>(block), y);
      break;
    case GgmlType::kIQ4_NL:
      dequantize_block_iq4_nl(static_cast<const block_iq4_nl*>(block), y);
      break;
    case GgmlType::kIQ4_XS:
      dequantize_block_iq4_xs(static_cast<const block_iq4_xs*>(block), y);
      break;
    case GgmlType::kMXFP4:
      dequantize_block_mxfp4(static_cast<const block_mxfp4*>(block), y);
      break;
    default:
      break;
  }
}

// Dequantizes n elements stored as back-to-back blocks. Returns false, writing
// nothing, for a type moegraph does not read or n not a multiple of its block size.
MG_HD inline bool dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  const int64_t block_elems = quant_block_elems(type);
  if (block_elems == 0 || n < 0 || n % block_elems != 0) return false;
  const int64_t block_bytes = quant_block_bytes(type);
  const uint8_t* block = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; i += block_elems) {
    dequantize_block(type, block, dst + i);
    block += block_bytes;
  }
  return true;
}

}  // namespace moegraph
