// Matrix-vector products as ggml-cuda's mmvq computes them (llama.cpp v0.5.0,
// ggml/src/ggml-cuda): the activation vector quantized to q8_1 blocks of 32
// (quantize.cu, quantize_q8_1), each weight type's dot with it in integer
// arithmetic (vecdotq.cuh, vec_dot_<type>_q8_1 and their _impl functions),
// weights read as whole 16- or 32-bit words (get_int_b2, get_int_b4), and a
// row's work split over a group of G threads (mmvq.cu, mul_mat_vec_q: thread t
// takes quant word group t % (qi / vdr) of blocks t / (qi / vdr), stepping
// vdr * G / qi blocks). Element types (f32, f16, bf16) are read 16 bytes at a
// time against the f32 activations instead.
//
// The kernels call these functions per thread and reduce the group's partials
// with a butterfly (lane ^ G/2, ..., lane ^ 1); matvec_row_reference below runs
// the same arithmetic in the same order on the host, so the emulator's results
// equal it bit for bit (a GPU may fuse multiply-adds). Light: .cu files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "loader/ggml_type.h"
#include "loader/host_device.h"
#include "loader/quant.h"

// The per-thread functions are inlined into the kernels (a call would spill).
#if defined(__CUDACC__)
#define MG_HD_INLINE __host__ __device__ __forceinline__
#else
#define MG_HD_INLINE inline
#endif

namespace moegraph {

// Threads of a row's group: a power of two from 2 to 32.
inline constexpr int kMaxRowGroup = 32;

// ---- integer helpers ----

// The four signed bytes of a and b multiplied pairwise and added to c: __dp4a
// on the device, the same integers elsewhere (the emulator included, so one
// inline function has one definition in every translation unit of a tree).
MG_HD_INLINE int dp4a(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(a, b, c);
#else
  // 32-bit arithmetic that wraps, as the instruction's does.
  uint32_t sum = static_cast<uint32_t>(c);
  for (int i = 0; i < 4; ++i) {
    sum += static_cast<uint32_t>(static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i)) *
                                 static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i)));
  }
  return static_cast<int>(sum);
#endif
}

// Word i32 of x from two 16-bit loads (x 2-byte aligned), as get_int_b2.
MG_HD_INLINE int get_int_b2(const void* x, int i32) {
  const uint16_t* x16 = static_cast<const uint16_t*>(x);
  return static_cast<int>(static_cast<uint32_t>(x16[2 * i32]) |
                          (static_cast<uint32_t>(x16[2 * i32 + 1]) << 16));
}

// Word i32 of x from one 32-bit load (x 4-byte aligned), as get_int_b4.
MG_HD_INLINE int get_int_b4(const void* x, int i32) { return static_cast<const int*>(x)[i32]; }

// Word i32 of x at any alignment (mxfp4's 17-byte blocks keep none), where
// ggml's get_int_b1 makes four byte loads: on the device the two aligned 32-bit
// words holding its first and its last byte (one word where it is aligned),
// joined by a funnel shift, so no load reaches a word without one of its bytes;
// on the host its four bytes, the same value.
MG_HD_INLINE int get_int_unaligned(const void* x, int i32) {
  const uint8_t* x8 = static_cast<const uint8_t*>(x) + 4 * i32;
#if defined(__CUDA_ARCH__)
  const uintptr_t at = reinterpret_cast<uintptr_t>(x8);
  const uint32_t low = *reinterpret_cast<const uint32_t*>(at & ~uintptr_t{3});
  const uint32_t high = *reinterpret_cast<const uint32_t*>((at + 3) & ~uintptr_t{3});
  return static_cast<int>(__funnelshift_r(low, high, static_cast<uint32_t>(at & 3) * 8));
#else
  return static_cast<int>(static_cast<uint32_t>(x8[0]) | (static_cast<uint32_t>(x8[1]) << 8) |
                          (static_cast<uint32_t>(x8[2]) << 16) |
                          (static_cast<uint32_t>(x8[3]) << 24));
#endif
}

// __byte_perm: result byte n is byte (s >> 4n) & 7 of the eight bytes y:x.
MG_HD_INLINE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t bytes = static_cast<uint64_t>(y) << 32 | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n)
    r |= static_cast<uint32_t>((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return r;
#endif
}

// The bytes of a 16-entry table (two words, entries 0-7 and 8-15) at the eight
// 4-bit indices of q4: even nibbles (low halves of the bytes) into first, odd ones
// into second, as get_int_from_table_16 does it with __byte_perm.
struct IntPair {
  int first, second;
};
MG_HD_INLINE IntPair int_from_table_16(int q4, uint64_t low, uint64_t high) {
  const uint32_t q = static_cast<uint32_t>(q4);
  const uint32_t t0 = static_cast<uint32_t>(low), t1 = static_cast<uint32_t>(low >> 32);
  const uint32_t t2 = static_cast<uint32_t>(high), t3 = static_cast<uint32_t>(high >> 32);
  // Index bit 3 picks the high table: selector 4-7 (the second operand) in the last perm.
  const uint32_t pick = 0x32103210u | ((q & 0x88888888u) >> 1);
  uint32_t tmp[2];
  for (int i = 0; i < 2; ++i) {
    const uint32_t shift = 16 * i;
    const uint32_t lo = byte_perm(t0, t1, q >> shift);
    const uint32_t hi = byte_perm(t2, t3, q >> shift);
    tmp[i] = byte_perm(lo, hi, pick >> shift);
  }
  return {static_cast<int>(byte_perm(tmp[0], tmp[1], 0x6420)),
          static_cast<int>(byte_perm(tmp[0], tmp[1], 0x7531))};
}

// An f16 product rounded to f16, as __hmul2 (ggml's FAST_FP16_AVAILABLE path,
// taken on the sm_90 this project builds for): the f32 product of two halves is
// exact, so one rounding.
MG_HD_INLINE float f16_product(uint16_t a, uint16_t b) {
  return f16_to_f32(f32_to_f16(f16_to_f32(a) * f16_to_f32(b)));
}

// ---- activations: q8_1 ----

// The butterfly sum of v[0..n) (n a power of two): after the rounds for
// offsets n/2, ..., 1, every lane holds the same value; this is lane 0's, which
// is what a warp's __shfl_xor_sync reduction of these lanes leaves everywhere.
MG_HD_INLINE float butterfly_sum(float* v, int n) {
  for (int offset = n / 2; offset > 0; offset >>= 1) {
    float next[kMaxRowGroup];
    for (int lane = 0; lane < n; ++lane) next[lane] = v[lane] + v[lane ^ offset];
    for (int lane = 0; lane < n; ++lane) v[lane] = next[lane];
  }
  return v[0];
}

// The q8_1 block of x[0..32) given its amax and sum (the warp reductions of
// quantize_q8_1): q = round(x / d) with d = amax / 127.
MG_HD_INLINE int8_t q8_1_quant(float x, float amax) {
  const float d = amax / 127.0f;
  return amax == 0.0f ? 0 : static_cast<int8_t>(roundf(x / d));
}
MG_HD_INLINE void q8_1_scales(float amax, float sum, block_q8_1* out) {
  out->d = f32_to_f16(amax / 127.0f);
  out->s = f32_to_f16(sum);
}

// x[0..32) to one q8_1 block, with the device's reduction order.
MG_HD_INLINE void quantize_q8_1_block(const float* x, block_q8_1* out) {
  float amax = 0.0f;
  float sums[QK8_1];
  for (int i = 0; i < QK8_1; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));
    sums[i] = x[i];
  }
  const float sum = butterfly_sum(sums, QK8_1);
  for (int i = 0; i < QK8_1; ++i) out->qs[i] = q8_1_quant(x[i], amax);
  q8_1_scales(amax, sum, out);
}

// ---- the weight types ----

// ggml_cuda_type_traits and the VDR_*_MMVQ values: elements per block (qk),
// 32-bit quant words per block (qi = qk / (4 * qr)), words one thread takes (vdr).
struct MmvqTraits {
  int qk = 0;
  int qi = 0;
  int vdr = 0;
};
MG_HD constexpr MmvqTraits mmvq_traits(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0: return {32, 8, 2};
    case GgmlType::kQ4_0: return {32, 4, 2};
    case GgmlType::kQ4_K: return {256, 32, 2};
    case GgmlType::kQ5_K: return {256, 32, 2};
    case GgmlType::kQ6_K: return {256, 32, 1};
    case GgmlType::kQ4_1:
      return {32, 4, 2};
    case GgmlType::kQ5_0:
      return {32, 4, 2};
    case GgmlType::kQ5_1:
      return {32, 4, 2};
    case GgmlType::kQ2_K:
      return {256, 16, 1};
    case GgmlType::kQ3_K:
      return {256, 16, 1};
    case GgmlType::kIQ4_NL:
      return {32, 4, 2};
    case GgmlType::kIQ4_XS:
      return {256, 32, 4};
    case GgmlType::kMXFP4:
      return {32, 4, 2};
    default: return {};
  }
}

MG_HD constexpr bool mmvq_type(GgmlType type) { return mmvq_traits(type).qk != 0; }

// vec_dot_q8_0_q8_1: words iqs, iqs + 1 of block bx against q8_1 block y.
MG_HD_INLINE float vec_dot_q8_0_q8_1(const block_q8_0* bx, const block_q8_1* y, int iqs) {
  int sumi = 0;
  for (int i = 0; i < 2; ++i) sumi = dp4a(get_int_b2(bx->qs, iqs + i), get_int_b4(y->qs, iqs + i), sumi);
  return f16_to_f32(bx->d) * f16_to_f32(y->d) * static_cast<float>(sumi);
}

// vec_dot_q4_0_q8_1: the low nibbles of words iqs, iqs + 1 are elements 4i..,
// the high ones 16 + 4i..; "- 8" comes out of the block's sum s.
MG_HD_INLINE float vec_dot_q4_0_q8_1(const block_q4_0* bx, const block_q8_1* y, int iqs) {
  constexpr int kVdr = 2, kQi = 4;
  int sumi = 0;
  for (int i = 0; i < kVdr; ++i) {
    const int v = get_int_b2(bx->qs, iqs + i);
    sumi = dp4a((v >> 0) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i), sumi);
    sumi = dp4a((v >> 4) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i + kQi), sumi);
  }
  const float d4 = f16_to_f32(bx->d);
  return d4 * (static_cast<float>(sumi) * f16_to_f32(y->d) -
               static_cast<float>(8 * kVdr / kQi) * f16_to_f32(y->s));
}

// q4_K and q5_K pack their sub-block scales and mins the same way: the two
// 6-bit scales (sc) and mins (m) of sub-blocks 2j and 2j + 1, read as 16-bit
// words, branch-free (vec_dot_q4_K_q8_1).
MG_HD_INLINE void k_scales_mins(const uint8_t* scales, int j, uint8_t sc[2], uint8_t m[2]) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales);
  const int jm = j & 1;
  const uint32_t s0 = s[jm + 0];
  const uint32_t s2 = s[jm + 2];
  const uint32_t s4 = s[jm + 4];
  const uint32_t hi = static_cast<uint32_t>(-static_cast<int32_t>(j >= 2));
  const uint16_t aux0 = static_cast<uint16_t>(((s0 & 0x3f3f) & ~hi) |
                                              ((((s4 >> 0) & 0x0f0f) | ((s0 & 0xc0c0) >> 2)) & hi));
  const uint16_t aux1 = static_cast<uint16_t>(((s2 & 0x3f3f) & ~hi) |
                                              ((((s4 >> 4) & 0x0f0f) | ((s2 & 0xc0c0) >> 2)) & hi));
  sc[0] = static_cast<uint8_t>(aux0 & 0xff);
  sc[1] = static_cast<uint8_t>(aux0 >> 8);
  m[0] = static_cast<uint8_t>(aux1 & 0xff);
  m[1] = static_cast<uint8_t>(aux1 >> 8);
}

// vec_dot_q4_K_q8_1 and vec_dot_q5_K_q8_1 with their _impl_vmmq functions (one
// body: q5_K adds bit bq8_offset + i of qh as each quant's fifth bit). iqs in
// 0, 2, ..., 30.
template <bool kQ5>
MG_HD_INLINE float vec_dot_k4_k5_q8_1(const uint8_t* scales, const uint8_t* qs, const uint8_t* qh,
                                      uint16_t d, uint16_t dmin, const block_q8_1* y, int iqs) {
  constexpr int kQr = 2;
  const int bq8_offset = kQr * ((iqs / 2) / 4);
  const uint8_t* q4 = qs + 16 * bq8_offset + 4 * ((iqs / 2) % 4);
  const int v[2] = {get_int_b4(q4, 0), get_int_b4(q4, 4)};
  int vh[2] = {0, 0};
  if constexpr (kQ5) {
    const uint8_t* h = qh + 4 * ((iqs / 2) % 4);
    vh[0] = get_int_b4(h, 0) >> bq8_offset;
    vh[1] = get_int_b4(h, 4) >> bq8_offset;
  }
  uint8_t sc[2], m[2];
  k_scales_mins(scales, bq8_offset / 2, sc, m);
  float sumf_d = 0.0f;
  float sumf_m = 0.0f;
  for (int i = 0; i < kQr; ++i) {
    const block_q8_1* y8 = y + bq8_offset + i;
    const int u0 = get_int_b4(y8->qs, (iqs / 2) % 4);
    const int u1 = get_int_b4(y8->qs, (iqs / 2) % 4 + 4);
    int v0 = (v[0] >> (4 * i)) & 0x0F0F0F0F;
    int v1 = (v[1] >> (4 * i)) & 0x0F0F0F0F;
    int dot1, dot2;
    if constexpr (kQ5) {
      v0 |= ((vh[0] >> i) << 4) & 0x10101010;
      v1 |= ((vh[1] >> i) << 4) & 0x10101010;
      dot1 = dp4a(v0, u0, dp4a(v1, u1, 0));
      dot2 = dp4a(0x01010101, u0, dp4a(0x01010101, u1, 0));
    } else {
      dot1 = dp4a(v1, u1, dp4a(v0, u0, 0));
      dot2 = dp4a(0x01010101, u1, dp4a(0x01010101, u0, 0));  // the sum of u
    }
    const float d8 = f16_to_f32(y8->d);
    sumf_d += d8 * static_cast<float>(dot1 * sc[i]);
    sumf_m += d8 * static_cast<float>(dot2 * m[i]);
  }
  return f16_to_f32(d) * sumf_d - f16_to_f32(dmin) * sumf_m;
}

// vec_dot_q6_K_q8_1 with vec_dot_q6_K_q8_1_impl_mmvq: iqs in 0..31. A q6_K
// block is 210 bytes, so only 2-byte alignment holds: 16-bit loads throughout,
// the scale byte taken out of its 16-bit word. ggml subtracts 32 from each
// byte (__vsubss4); the same integer is dp4a(v, u) - 32 * sum(u).
MG_HD_INLINE float vec_dot_q6_K_q8_1(const block_q6_K* bx, const block_q8_1* y, int iqs) {
  constexpr int kQr = 2, kQi = 32;
  const int bq8_offset = 2 * kQr * (iqs / (kQi / 2)) + (iqs % (kQi / 2)) / (kQi / 4);
  const int scale_offset = (kQi / 4) * (iqs / (kQi / 2)) + (iqs % (kQi / 2)) / (kQi / 8);
  const int vh_shift = 2 * ((iqs % (kQi / 2)) / (kQi / 4));
  const int vl = get_int_b2(bx->ql, iqs);
  const int vh = get_int_b2(bx->qh, (kQi / 4) * (iqs / (kQi / 2)) + iqs % (kQi / 4)) >> vh_shift;
  const uint16_t* scale_words = reinterpret_cast<const uint16_t*>(bx->scales);
  float sumf = 0.0f;
  for (int i = 0; i < kQr; ++i) {
    const int s = scale_offset + 4 * i;
    const int sc = static_cast<int8_t>(scale_words[s / 2] >> (8 * (s % 2)));
    const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
    const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
    const block_q8_1* y8 = y + bq8_offset + 2 * i;
    const int u = get_int_b4(y8->qs, iqs % 8);
    const int dot = dp4a(vil | vih, u, 0) - 32 * dp4a(0x01010101, u, 0);
    sumf += f16_to_f32(y8->d) * static_cast<float>(dot * sc);
  }
  return f16_to_f32(bx->d) * sumf;
}

// q4_1 and q5_1 (vec_dot_q4_1_q8_1_impl, _q5_1_): d d8 sum(q u) + m s, the min's
// part in halves, one from each of a block's two threads (vdr 2).
template <typename Block>
MG_HD_INLINE float with_min_dot(const Block* bx, const block_q8_1* y, int sumi) {
  return static_cast<float>(sumi) * f16_product(bx->d, y->d) + f16_product(bx->m, y->s) / 2;
}

// vec_dot_q4_1_q8_1 (vdr 2; 20-byte blocks: 32-bit loads).
MG_HD_INLINE float vec_dot_q4_1_q8_1(const block_q4_1* bx, const block_q8_1* y, int iqs) {
  int sumi = 0;
  for (int i = 0; i < 2; ++i) {
    const int v = get_int_b4(bx->qs, iqs + i);
    sumi = dp4a((v >> 0) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i), sumi);
    sumi = dp4a((v >> 4) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i + 4), sumi);
  }
  return with_min_dot(bx, y, sumi);
}

// The integer dot of q5_0 / q5_1 words iqs, iqs + 1 (vdr 2): the nibbles with
// their fifth bits from qh moved into bit 4 of each byte (vec_dot_q5_0_q8_1_impl's
// shifts). q5_0's 22-byte blocks take 16-bit loads, q5_1's 24-byte ones 32-bit.
template <typename Block>
MG_HD_INLINE int q5_sumi(const Block* bx, const block_q8_1* y, int iqs) {
  constexpr bool kAligned4 = sizeof(Block) % 4 == 0;
  int sumi = 0;
  for (int i = 0; i < 2; ++i) {
    const int vl = kAligned4 ? get_int_b4(bx->qs, iqs + i) : get_int_b2(bx->qs, iqs + i);
    const int vh = (kAligned4 ? get_int_b4(bx->qh, 0) : get_int_b2(bx->qh, 0)) >> (4 * (iqs + i));
    int low = (vl >> 0) & 0x0F0F0F0F;
    low |= (vh << 4) & 0x00000010;
    low |= (vh << 11) & 0x00001000;
    low |= (vh << 18) & 0x00100000;
    low |= (vh << 25) & 0x10000000;
    int high = (vl >> 4) & 0x0F0F0F0F;
    high |= (vh >> 12) & 0x00000010;
    high |= (vh >> 5) & 0x00001000;
    high |= (vh << 2) & 0x00100000;
    high |= (vh << 9) & 0x10000000;
    sumi = dp4a(low, get_int_b4(y->qs, iqs + i), sumi);
    sumi = dp4a(high, get_int_b4(y->qs, iqs + i + 4), sumi);
  }
  return sumi;
}

// vec_dot_q5_0_q8_1: "- 16" comes out of the block's sum s.
MG_HD_INLINE float vec_dot_q5_0_q8_1(const block_q5_0* bx, const block_q8_1* y, int iqs) {
  const int sumi = q5_sumi(bx, y, iqs);
  return f16_to_f32(bx->d) * (static_cast<float>(sumi) * f16_to_f32(y->d) -
                              static_cast<float>(16 * 2 / 4) * f16_to_f32(y->s));
}

MG_HD_INLINE float vec_dot_q5_1_q8_1(const block_q5_1* bx, const block_q8_1* y, int iqs) {
  return with_min_dot(bx, y, q5_sumi(bx, y, iqs));
}

// vec_dot_q2_K_q8_1 with _impl_mmvq (vdr 1, iqs 0..15): word iqs of qs holds
// 2-bit quants for four q8_1 blocks; ggml's scale bytes scales[so + 2i] are taken
// from two 32-bit words.
MG_HD_INLINE float vec_dot_q2_K_q8_1(const block_q2_K* bx, const block_q8_1* y, int iqs) {
  const int bq8_offset = 4 * (iqs / 8);
  const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
  const uint64_t scale_words =
      static_cast<uint32_t>(get_int_b4(bx->scales, scale_offset / 4)) |
      static_cast<uint64_t>(static_cast<uint32_t>(get_int_b4(bx->scales, scale_offset / 4 + 1)))
          << 32;
  const int v = get_int_b4(bx->qs, iqs);
  float sumf_d = 0.0f;
  float sumf_m = 0.0f;
  for (int i = 0; i < 4; ++i) {
    const block_q8_1* y8 = y + bq8_offset + i;
    const int u = get_int_b4(y8->qs, iqs % 8);
    const float d8 = f16_to_f32(y8->d);
    const int sc = static_cast<int>((scale_words >> (8 * (scale_offset % 4 + 2 * i))) & 0xff);
    const int vi = (v >> (2 * i)) & 0x03030303;
    sumf_d += d8 * static_cast<float>(dp4a(vi, u, 0) * (sc & 0xF));
    const int m = (sc >> 4) * 0x01010101;
    sumf_m += d8 * static_cast<float>(dp4a(m, u, 0));
  }
  return f16_to_f32(bx->d) * sumf_d - f16_to_f32(bx->dmin) * sumf_m;
}

// vec_dot_q3_K_q8_1 with _impl_mmvq (vdr 1, iqs 0..15; 110-byte blocks: 16-bit
// loads). ggml subtracts 4 where the high bit is clear (__vsubss4); the same
// integer is dp4a(low, u) - dp4a(4 * clear, u).
MG_HD_INLINE float vec_dot_q3_K_q8_1(const block_q3_K* bx, const block_q8_1* y, int iqs) {
  const int bq8_offset = 4 * (iqs / 8);
  const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
  const int vl = get_int_b2(bx->qs, iqs);
  const int vh = ~get_int_b2(bx->hmask, iqs % 8) >> bq8_offset;
  // Scale isc = scale_offset + 2i has its low nibble in byte isc % 8 and its high
  // bits in byte 8 + isc % 4: with scale_offset in {0, 1, 8, 9}, byte
  // scale_offset % 2 of 16-bit words i and 4 + i % 2.
  const uint16_t* scale_words = reinterpret_cast<const uint16_t*>(bx->scales);
  const int byte_shift = 8 * (scale_offset % 2);
  float sumf = 0.0f;
  for (int i = 0; i < 4; ++i) {
    const block_q8_1* y8 = y + bq8_offset + i;
    const int u = get_int_b4(y8->qs, iqs % 8);
    const int isc = scale_offset + 2 * i;
    const int sc_low = (scale_words[i] >> (byte_shift + 4 * (isc / 8))) & 0xF;
    const int sc_high = ((scale_words[4 + i % 2] >> (byte_shift + 2 * (isc / 4))) & 3) << 4;
    const int sc = (sc_low | sc_high) - 32;
    const int vil = (vl >> (2 * i)) & 0x03030303;
    const int vih = ((vh >> i) << 2) & 0x04040404;
    const int dot = dp4a(vil, u, 0) - dp4a(vih, u, 0);
    sumf += f16_to_f32(y8->d) * static_cast<float>(dot * sc);
  }
  return f16_to_f32(bx->d) * sumf;
}

// vec_dot_iq4_nl_q8_1 (vdr 2; 18-byte blocks: 16-bit loads).
MG_HD_INLINE float vec_dot_iq4_nl_q8_1(const block_iq4_nl* bx, const block_q8_1* y, int iqs) {
  int sumi = 0;
  for (int l = 0; l < 2; ++l) {
    const IntPair v = int_from_table_16(get_int_b2(bx->qs, iqs + l), kIq4nlLow, kIq4nlHigh);
    sumi = dp4a(v.first, get_int_b4(y->qs, iqs + l), sumi);
    sumi = dp4a(v.second, get_int_b4(y->qs, iqs + l + 4), sumi);
  }
  return f16_to_f32(bx->d) * f16_to_f32(y->d) * static_cast<float>(sumi);
}

// vec_dot_iq4_xs_q8_1 (vdr 4, iqs 0, 4, ..., 28: sub-block iqs / 4); the low
// scale nibbles come from one 32-bit word.
MG_HD_INLINE float vec_dot_iq4_xs_q8_1(const block_iq4_xs* bx, const block_q8_1* y, int iqs) {
  const block_q8_1* y8 = y + iqs / 4;
  int sumi = 0;
  for (int j = 0; j < 4; ++j) {
    const IntPair v = int_from_table_16(get_int_b4(bx->qs, iqs + j), kIq4nlLow, kIq4nlHigh);
    sumi = dp4a(v.first, get_int_b4(y8->qs, j), sumi);
    sumi = dp4a(v.second, get_int_b4(y8->qs, j + 4), sumi);
  }
  const int scales_l = get_int_b4(bx->scales_l, 0) >> (8 * (iqs / 8));
  const int ls = ((scales_l >> (iqs & 4)) & 0x0F) | (((bx->scales_h >> (iqs / 2)) & 0x03) << 4);
  sumi *= ls - 32;
  return f16_to_f32(bx->d) * f16_to_f32(y8->d) * static_cast<float>(sumi);
}

// vec_dot_mxfp4_q8_1 (vdr 2): 17-byte blocks, so unaligned words (get_int_unaligned).
MG_HD_INLINE float vec_dot_mxfp4_q8_1(const block_mxfp4* bx, const block_q8_1* y, int iqs) {
  int sumi = 0;
  for (int l = 0; l < 2; ++l) {
    const IntPair v = int_from_table_16(get_int_unaligned(bx->qs, iqs + l), kMxfp4Low, kMxfp4High);
    sumi = dp4a(v.first, get_int_b4(y->qs, iqs + l), sumi);
    sumi = dp4a(v.second, get_int_b4(y->qs, iqs + l + 4), sumi);
  }
  // The scale byte as the low byte of the word it starts (its own block's bytes).
  const uint8_t e = static_cast<uint8_t>(get_int_unaligned(&bx->e, 0));
  return e8m0_to_f32_half(e) * f16_to_f32(y->d) * static_cast<float>(sumi);
}

// The dot of the weight block at `block` (of type) with the q8_1 blocks at y
// (qk / 32 of them), quant words iqs.. of it.
template <GgmlType T>
MG_HD_INLINE float vec_dot_q8_1(const uint8_t* block, const block_q8_1* y, int iqs) {
  if constexpr (T == GgmlType::kQ8_0) {
    return vec_dot_q8_0_q8_1(reinterpret_cast<const block_q8_0*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ4_0) {
    return vec_dot_q4_0_q8_1(reinterpret_cast<const block_q4_0*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ4_K) {
    const block_q4_K* b = reinterpret_cast<const block_q4_K*>(block);
    return vec_dot_k4_k5_q8_1<false>(b->scales, b->qs, nullptr, b->d, b->dmin, y, iqs);
  } else if constexpr (T == GgmlType::kQ5_K) {
    const block_q5_K* b = reinterpret_cast<const block_q5_K*>(block);
    return vec_dot_k4_k5_q8_1<true>(b->scales, b->qs, b->qh, b->d, b->dmin, y, iqs);
  } else if constexpr (T == GgmlType::kQ6_K) {
    return vec_dot_q6_K_q8_1(reinterpret_cast<const block_q6_K*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ4_1) {
    return vec_dot_q4_1_q8_1(reinterpret_cast<const block_q4_1*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ5_0) {
    return vec_dot_q5_0_q8_1(reinterpret_cast<const block_q5_0*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ5_1) {
    return vec_dot_q5_1_q8_1(reinterpret_cast<const block_q5_1*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ2_K) {
    return vec_dot_q2_K_q8_1(reinterpret_cast<const block_q2_K*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kQ3_K) {
    return vec_dot_q3_K_q8_1(reinterpret_cast<const block_q3_K*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kIQ4_NL) {
    return vec_dot_iq4_nl_q8_1(reinterpret_cast<const block_iq4_nl*>(block), y, iqs);
  } else if constexpr (T == GgmlType::kIQ4_XS) {
    return vec_dot_iq4_xs_q8_1(reinterpret_cast<const block_iq4_xs*>(block), y, iqs);
  } else {
    static_assert(T == GgmlType::kMXFP4, "a type mmvq_traits knows");
    return vec_dot_mxfp4_q8_1(reinterpret_cast<const block_mxfp4*>(block), y, iqs);
  }
}

// ---- a row's work over a group of G threads ----

// Elements one thread reads at a time for element types: 16 bytes.
MG_HD constexpr int element_chunk(GgmlType type) { return type == GgmlType::kF32 ? 4 : 8; }

// Work units of a row of cols: (block, word group) pairs for the quant types,
// 16-byte chunks for element types.
MG_HD_INLINE int64_t row_units(GgmlType type, int64_t cols) {
  if (mmvq_type(type)) {
    const MmvqTraits t = mmvq_traits(type);
    return cols / t.qk * (t.qi / t.vdr);
  }
  return cols / element_chunk(type);
}

// The group size for rows of cols: the least power of two that covers the
// row's units, at least the q types' qi / vdr (one block per step) and 2, at
// most 32 (a warp); threads past the units of a short row idle.
MG_HD_INLINE int row_group(GgmlType type, int64_t cols) {
  int minimum = 2;
  if (mmvq_type(type)) minimum = mmvq_traits(type).qi / mmvq_traits(type).vdr;
  int g = minimum < 2 ? 2 : minimum;
  const int64_t units = row_units(type, cols);
  while (g < kMaxRowGroup && g < units) g *= 2;
  return g;
}

// Whether the grouped matvec reads rows of cols of type: a q type (cols a
// multiple of its block; the activations in q8_1) or an element type (cols a
// multiple of its 16-byte chunk; f32 activations).
MG_HD_INLINE bool grouped_matvec_supports(GgmlType type, int64_t cols) {
  if (cols <= 0) return false;
  if (mmvq_type(type)) return cols % mmvq_traits(type).qk == 0;
  if (type == GgmlType::kF32 || type == GgmlType::kF16 || type == GgmlType::kBF16) {
    return cols % element_chunk(type) == 0;
  }
  return false;
}

// Thread t of a group of g: its part of the dot of a quant-type row with the
// q8_1 vector y (mul_mat_vec_q's loop for one row and one column).
template <GgmlType T>
MG_HD_INLINE float mmvq_partial(const uint8_t* row, const block_q8_1* y, int64_t cols, int t,
                                int g) {
  constexpr MmvqTraits tr = mmvq_traits(T);
  constexpr int kBlockBytes = static_cast<int>(quant_block_bytes(T));
  const int blocks = static_cast<int>(cols / tr.qk);
  const int per_block = tr.qi / tr.vdr;
  const int blocks_per_iter = tr.vdr * g / tr.qi;
  const int iqs = tr.vdr * (t % per_block);
  float sum = 0.0f;
  for (int b = t / per_block; b < blocks; b += blocks_per_iter) {
    sum += vec_dot_q8_1<T>(row + b * kBlockBytes, y + b * (tr.qk / QK8_1), iqs);
  }
  return sum;
}

// Thread t of a group of g: its part of the dot of an element-type row with the
// f32 vector x, 16 bytes of the row at a time.
template <GgmlType T>
MG_HD_INLINE float element_partial(const uint8_t* row, const float* x, int64_t cols, int t,
                                   int g) {
  constexpr int kChunk = element_chunk(T);
  float sum = 0.0f;
  for (int64_t c = t; c * kChunk < cols; c += g) {
    const int64_t i0 = c * kChunk;
    for (int i = 0; i < kChunk; ++i) {
      float w;
      if constexpr (T == GgmlType::kF32) {
        w = reinterpret_cast<const float*>(row)[i0 + i];
      } else if constexpr (T == GgmlType::kF16) {
        w = f16_to_f32(reinterpret_cast<const uint16_t*>(row)[i0 + i]);
      } else {
        w = bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[i0 + i]);
      }
      sum += w * x[i0 + i];
    }
  }
  return sum;
}

// One thread's part of a row of type T: q types read y, element types x.
template <GgmlType T>
MG_HD_INLINE float row_partial(const uint8_t* row, const float* x, const block_q8_1* y,
                               int64_t cols, int t, int g) {
  if constexpr (mmvq_type(T)) {
    return mmvq_partial<T>(row, y, cols, t, g);
  } else {
    return element_partial<T>(row, x, cols, t, g);
  }
}

// The row's dot as the kernels compute it: every thread's part, then the
// group's butterfly. The host reference of the grouped matvec.
template <GgmlType T>
MG_HD_INLINE float matvec_row_reference(const uint8_t* row, const float* x, const block_q8_1* y,
                                        int64_t cols) {
  const int g = row_group(T, cols);
  float parts[kMaxRowGroup];
  for (int t = 0; t < g; ++t) parts[t] = row_partial<T>(row, x, y, cols, t, g);
  return butterfly_sum(parts, g);
}

// matvec_row_reference of a type given at run time (the host's tests).
inline float matvec_row_reference(GgmlType type, const uint8_t* row, const float* x,
                                  const block_q8_1* y, int64_t cols) {
  switch (type) {
    case GgmlType::kQ8_0: return matvec_row_reference<GgmlType::kQ8_0>(row, x, y, cols);
    case GgmlType::kQ4_0: return matvec_row_reference<GgmlType::kQ4_0>(row, x, y, cols);
    case GgmlType::kQ4_K: return matvec_row_reference<GgmlType::kQ4_K>(row, x, y, cols);
    case GgmlType::kQ5_K: return matvec_row_reference<GgmlType::kQ5_K>(row, x, y, cols);
    case GgmlType::kQ6_K: return matvec_row_reference<GgmlType::kQ6_K>(row, x, y, cols);
    case GgmlType::kQ4_1:
      return matvec_row_reference<GgmlType::kQ4_1>(row, x, y, cols);
    case GgmlType::kQ5_0:
      return matvec_row_reference<GgmlType::kQ5_0>(row, x, y, cols);
    case GgmlType::kQ5_1:
      return matvec_row_reference<GgmlType::kQ5_1>(row, x, y, cols);
    case GgmlType::kQ2_K:
      return matvec_row_reference<GgmlType::kQ2_K>(row, x, y, cols);
    case GgmlType::kQ3_K:
      return matvec_row_reference<GgmlType::kQ3_K>(row, x, y, cols);
    case GgmlType::kIQ4_NL:
      return matvec_row_reference<GgmlType::kIQ4_NL>(row, x, y, cols);
    case GgmlType::kIQ4_XS:
      return matvec_row_reference<GgmlType::kIQ4_XS>(row, x, y, cols);
    case GgmlType::kMXFP4:
      return matvec_row_reference<GgmlType::kMXFP4>(row, x, y, cols);
    case GgmlType::kF32: return matvec_row_reference<GgmlType::kF32>(row, x, y, cols);
    case GgmlType::kF16: return matvec_row_reference<GgmlType::kF16>(row, x, y, cols);
    case GgmlType::kBF16: return matvec_row_reference<GgmlType::kBF16>(row, x, y, cols);
    default: return 0.0f;
  }
}

}  // namespace moegraph
