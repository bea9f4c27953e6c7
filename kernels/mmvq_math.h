// Matrix-vector products as ggml-cuda's mmvq computes them (llama.cpp v0.5.0,
// ggml/src/ggml-cuda): the activation vector quantized to q8_1 blocks of 32
// (quantize.cu, quantize_q8_1), each weight type's dot with it in integer
// arithmetic (vecdotq.cuh, vec_dot_<type>_q8_1 and their _impl functions), a
// row's work split into units handed to its threads as mul_mat_vec_q hands them
// out (mmvq.cu). Two departures, both for the bytes a thread keeps in flight:
// a thread loads the weight words of a whole trip of units before its first
// dp4a, and every weight load is an aligned 32-bit word. Element types (f32,
// f16, bf16) are read 16 bytes a unit against the f32 activations instead.
//
// The kernels call these functions per thread and reduce a row's parts as
// row_sum_of_parts says; matvec_row_reference below runs the same arithmetic in
// the same order on the host, so the emulator's results equal it bit for bit
// (a GPU may fuse multiply-adds). Light: .cu files include it.
#pragma once

#include <math.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fixed_math.h"
#include "loader/ggml_type.h"
#include "loader/host_device.h"
#include "loader/quant.h"

namespace moegraph {

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

// ---- weight words ----
//
// A thread's weight loads are all issued before the first dp4a that needs
// them (the bytes a thread keeps in flight are what stream the weights at the
// bandwidth: docs/ARCHITECTURE.md, "Matvec"), so each type's dot is split in
// two: load_unit gathers the words one unit of work reads into registers,
// dot_unit does the arithmetic of ggml's vec_dot_<type>_q8_1 on them. On the
// device every weight load is an aligned 32-bit word: a field at 2-byte (or,
// mxfp4's, any) alignment comes out of the aligned words that hold it by a
// funnel shift, where ggml makes 16-bit loads (get_int_b2) or byte loads
// (get_int_b1). Such a load never reaches past the 4-byte word holding the
// field's last byte. On the host the same values come from their bytes.

// The little-endian word at byte p, any alignment.
MG_HD_INLINE uint32_t host_word(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// __funnelshift_r: the 64 bits hi:lo shifted right by shift (< 32), low word.
MG_HD_INLINE uint32_t funnel_right(uint32_t lo, uint32_t hi, uint32_t shift) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, shift);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32) | lo) >> shift);
#endif
}

// The aligned 32-bit word holding byte p. On the device a global load cached
// in L1 too (ld.global.ca): the words of a 2-byte-aligned type overlap from
// one unit to the next, and the L1 serves the second read (through L2 only,
// ld.global.cg, gpusim had the q8_0 matvec at 0.56 of ggml's bandwidth, L2
// latency doubled by the repeated reads; cached, 1.03).
MG_HD_INLINE uint32_t aligned_word(const uint8_t* p) {
  const uint32_t* word =
      reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{3});
#if defined(__CUDA_ARCH__)
  return __ldca(word);
#else
  return *word;
#endif
}

// The device's loads of words [0, N) at byte p, any alignment: N + 1 aligned
// words joined by funnel shifts (the last is the word holding byte p + 4N - 1,
// the same as word N - 1 where p is aligned). Never reads past that word.
template <int N>
MG_HD_INLINE void words_from_aligned_loads(const uint8_t* p, int (&out)[N]) {
  const uint32_t shift = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 3) * 8;
  uint32_t w[N + 1];
  for (int i = 0; i < N; ++i) w[i] = aligned_word(p + 4 * i);
  w[N] = aligned_word(p + 4 * N - 1);
  for (int i = 0; i < N; ++i) out[i] = static_cast<int>(funnel_right(w[i], w[i + 1], shift));
}

// The device's load of the 16-bit field at p (2-byte aligned) and of the byte at p.
MG_HD_INLINE uint32_t u16_from_aligned_load(const uint8_t* p) {
  return (aligned_word(p) >> ((reinterpret_cast<uintptr_t>(p) & 2) * 8)) & 0xffffu;
}
MG_HD_INLINE uint32_t u8_from_aligned_load(const uint8_t* p) {
  return (aligned_word(p) >> ((reinterpret_cast<uintptr_t>(p) & 3) * 8)) & 0xffu;
}

// Words [0, N) at byte p (kAligned: p is 4-byte aligned, one load a word). On
// the host, from their bytes: an aligned word may reach past the allocation,
// which the emulator's ASan would report.
template <int N, bool kAligned>
MG_HD_INLINE void load_words(const uint8_t* p, int (&out)[N]) {
#if defined(__CUDA_ARCH__)
  if constexpr (kAligned) {
    for (int i = 0; i < N; ++i) out[i] = __ldca(reinterpret_cast<const int*>(p) + i);
  } else {
    words_from_aligned_loads<N>(p, out);
  }
#else
  for (int i = 0; i < N; ++i) out[i] = static_cast<int>(host_word(p + 4 * i));
#endif
}

MG_HD_INLINE uint32_t load_u16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return u16_from_aligned_load(p);
#else
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
#endif
}

MG_HD_INLINE uint32_t load_u8(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return u8_from_aligned_load(p);
#else
  return p[0];
#endif
}

template <bool kAligned>
MG_HD_INLINE int load_word(const uint8_t* p) {
  int w[1];
  load_words<1, kAligned>(p, w);
  return w[0];
}

MG_HD_INLINE int y_word(const block_q8_1* y, int i) {
  return reinterpret_cast<const int*>(y->qs)[i];
}
MG_HD_INLINE uint16_t low_half(uint32_t w) { return static_cast<uint16_t>(w & 0xffffu); }
MG_HD_INLINE uint16_t high_half(uint32_t w) { return static_cast<uint16_t>(w >> 16); }

// ---- units: one thread's share of a weight block ----
//
// Unit u of a row is word group u % (qi / vdr) of block u / (qi / vdr), as
// mul_mat_vec_q hands them out (iqs = vdr * (u % (qi / vdr))).

// The weight words a unit of type T reads.
template <GgmlType T>
struct UnitWords;

// q8_0, q4_0, iq4_nl: words iqs, iqs + 1 of 2-byte-aligned blocks, and d.
// mxfp4 likewise, its exponent in d.
struct PairWordsD {
  int q[2];
  uint32_t d;
};
template <> struct UnitWords<GgmlType::kQ8_0> : PairWordsD {};
template <> struct UnitWords<GgmlType::kQ4_0> : PairWordsD {};
template <> struct UnitWords<GgmlType::kIQ4_NL> : PairWordsD {};
template <> struct UnitWords<GgmlType::kMXFP4> : PairWordsD {};
// q4_1: words iqs, iqs + 1 and the d/m word. q5_0 and q5_1 add qh.
template <> struct UnitWords<GgmlType::kQ4_1> {
  int q[2];
  uint32_t dm;
};
template <> struct UnitWords<GgmlType::kQ5_0> {
  int q[2];
  int qh[1];
  uint32_t d;
};
template <> struct UnitWords<GgmlType::kQ5_1> {
  int q[2];
  int qh[1];
  uint32_t dm;
};
// q4_K and q5_K: two quant words 16 bytes apart (q5_K: and their qh words), the
// three words of scales (the unit's 16-bit scale words are halves of them),
// and d/dmin.
template <> struct UnitWords<GgmlType::kQ4_K> {
  int v[2];
  int scales[3];
  uint32_t dm;
};
template <> struct UnitWords<GgmlType::kQ5_K> {
  int v[2];
  int vh[2];
  int scales[3];
  uint32_t dm;
};
template <> struct UnitWords<GgmlType::kQ6_K> {
  int vl[1];
  int vh[1];
  uint32_t scales[2];  // the 16-bit words holding its two scale bytes
  uint32_t d;
};
template <> struct UnitWords<GgmlType::kQ2_K> {
  int scales[2];
  int q[1];
  uint32_t dm;
};
template <> struct UnitWords<GgmlType::kQ3_K> {
  int vl[1];
  int hmask[1];
  int scales[3];
  uint32_t d;
};
template <> struct UnitWords<GgmlType::kIQ4_XS> {
  int q[4];
  int d_scales_h[1];  // d, then scales_h
  int scales_l[1];
};

// The words of unit iqs of the block at b (blocks_ of type T).
template <GgmlType T>
MG_HD_INLINE UnitWords<T> load_unit(const uint8_t* b, int iqs) {
  UnitWords<T> w;
  if constexpr (T == GgmlType::kQ8_0 || T == GgmlType::kQ4_0 || T == GgmlType::kIQ4_NL) {
    load_words<2, false>(b + 2 + 4 * iqs, w.q);  // after d
    w.d = load_u16(b);
  } else if constexpr (T == GgmlType::kMXFP4) {
    w.d = load_u8(b);
    load_words<2, false>(b + 1 + 4 * iqs, w.q);  // after e
  } else if constexpr (T == GgmlType::kQ4_1) {
    load_words<2, true>(b + 4 + 4 * iqs, w.q);
    w.dm = static_cast<uint32_t>(load_word<true>(b));
  } else if constexpr (T == GgmlType::kQ5_0) {
    load_words<2, false>(b + 6 + 4 * iqs, w.q);
    load_words<1, false>(b + 2, w.qh);
    w.d = load_u16(b);
  } else if constexpr (T == GgmlType::kQ5_1) {
    load_words<2, true>(b + 8 + 4 * iqs, w.q);
    load_words<1, true>(b + 4, w.qh);
    w.dm = static_cast<uint32_t>(load_word<true>(b));
  } else if constexpr (T == GgmlType::kQ4_K || T == GgmlType::kQ5_K) {
    constexpr int kQs = T == GgmlType::kQ4_K ? 16 : 48;
    const int bq8_offset = 2 * ((iqs / 2) / 4);
    const uint8_t* q4 = b + kQs + 16 * bq8_offset + 4 * ((iqs / 2) % 4);
    w.v[0] = load_word<true>(q4);
    w.v[1] = load_word<true>(q4 + 16);
    if constexpr (T == GgmlType::kQ5_K) {
      const uint8_t* h = b + 16 + 4 * ((iqs / 2) % 4);
      w.vh[0] = load_word<true>(h);
      w.vh[1] = load_word<true>(h + 16);
    }
    load_words<3, true>(b + 4, w.scales);
    w.dm = static_cast<uint32_t>(load_word<true>(b));
  } else if constexpr (T == GgmlType::kQ6_K) {
    const int scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
    load_words<1, false>(b + 4 * iqs, w.vl);                                 // ql
    load_words<1, false>(b + 128 + 4 * (8 * (iqs / 16) + iqs % 8), w.vh);  // qh
    w.scales[0] = load_u16(b + 192 + 2 * (scale_offset / 2));
    w.scales[1] = load_u16(b + 192 + 2 * ((scale_offset + 4) / 2));
    w.d = load_u16(b + 208);
  } else if constexpr (T == GgmlType::kQ2_K) {
    const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    load_words<2, true>(b + 4 * (scale_offset / 4), w.scales);
    load_words<1, true>(b + 16 + 4 * iqs, w.q);
    w.dm = static_cast<uint32_t>(load_word<true>(b + 80));
  } else if constexpr (T == GgmlType::kQ3_K) {
    load_words<1, false>(b + 32 + 4 * iqs, w.vl);
    load_words<1, false>(b + 4 * (iqs % 8), w.hmask);
    load_words<3, false>(b + 96, w.scales);
    w.d = load_u16(b + 108);
  } else {
    static_assert(T == GgmlType::kIQ4_XS, "a type mmvq_traits knows");
    load_words<4, true>(b + 8 + 4 * iqs, w.q);
    load_words<1, true>(b, w.d_scales_h);
    load_words<1, true>(b + 4, w.scales_l);
  }
  return w;
}

// q4_K and q5_K pack their sub-block scales and mins the same way: the two
// 6-bit scales (sc) and mins (m) of sub-blocks 2j and 2j + 1 from the 16-bit
// scale words jm, jm + 2 and jm + 4 (jm = j % 2: halves jm of the scales'
// three 32-bit words), branch-free (vec_dot_q4_K_q8_1).
MG_HD_INLINE void k_scales_mins(const int (&scales)[3], int j, uint8_t sc[2], uint8_t m[2]) {
  const int jm = j & 1;
  const uint32_t s0 = (static_cast<uint32_t>(scales[0]) >> (16 * jm)) & 0xffffu;
  const uint32_t s2 = (static_cast<uint32_t>(scales[1]) >> (16 * jm)) & 0xffffu;
  const uint32_t s4 = (static_cast<uint32_t>(scales[2]) >> (16 * jm)) & 0xffffu;
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
MG_HD_INLINE float dot_k4_k5(const int (&v)[2], const int (&vh_words)[2], const int (&scales)[3],
                             uint32_t dm, const block_q8_1* y, int iqs) {
  constexpr int kQr = 2;
  const int bq8_offset = kQr * ((iqs / 2) / 4);
  int vh[2] = {0, 0};
  if constexpr (kQ5) {
    vh[0] = vh_words[0] >> bq8_offset;
    vh[1] = vh_words[1] >> bq8_offset;
  }
  uint8_t sc[2], m[2];
  k_scales_mins(scales, bq8_offset / 2, sc, m);
  float sumf_d = 0.0f;
  float sumf_m = 0.0f;
  for (int i = 0; i < kQr; ++i) {
    const block_q8_1* y8 = y + bq8_offset + i;
    const int u0 = y_word(y8, (iqs / 2) % 4);
    const int u1 = y_word(y8, (iqs / 2) % 4 + 4);
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
  return f16_to_f32(low_half(dm)) * sumf_d - f16_to_f32(high_half(dm)) * sumf_m;
}

// q4_1 and q5_1 (vec_dot_q4_1_q8_1_impl, _q5_1_): d d8 sum(q u) + m s, the min's
// part in halves, one from each of a block's two threads (vdr 2).
MG_HD_INLINE float with_min_dot(uint32_t dm, const block_q8_1* y, int sumi) {
  return static_cast<float>(sumi) * f16_product(low_half(dm), y->d) +
         f16_product(high_half(dm), y->s) / 2;
}

// The integer dot of q5_0 / q5_1 words iqs, iqs + 1 (vdr 2): the nibbles with
// their fifth bits from qh moved into bit 4 of each byte (vec_dot_q5_0_q8_1_impl's
// shifts).
MG_HD_INLINE int q5_sumi(const int (&q)[2], int qh, const block_q8_1* y, int iqs) {
  int sumi = 0;
  for (int i = 0; i < 2; ++i) {
    const int vl = q[i];
    const int vh = qh >> (4 * (iqs + i));
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
    sumi = dp4a(low, y_word(y, iqs + i), sumi);
    sumi = dp4a(high, y_word(y, iqs + i + 4), sumi);
  }
  return sumi;
}

// A unit's dot with the q8_1 blocks at y (qk / 32 of them), the arithmetic of
// ggml's vec_dot_<type>_q8_1 (vecdotq.cuh) in its order.
template <GgmlType T>
MG_HD_INLINE float dot_unit(const UnitWords<T>& w, const block_q8_1* y, int iqs) {
  if constexpr (T == GgmlType::kQ8_0) {
    int sumi = 0;
    for (int i = 0; i < 2; ++i) sumi = dp4a(w.q[i], y_word(y, iqs + i), sumi);
    return f16_to_f32(low_half(w.d)) * f16_to_f32(y->d) * static_cast<float>(sumi);
  } else if constexpr (T == GgmlType::kQ4_0) {
    // The low nibbles of words iqs, iqs + 1 are elements 4i.., the high ones
    // 16 + 4i..; "- 8" comes out of the block's sum s.
    constexpr int kVdr = 2, kQi = 4;
    int sumi = 0;
    for (int i = 0; i < kVdr; ++i) {
      sumi = dp4a((w.q[i] >> 0) & 0x0F0F0F0F, y_word(y, iqs + i), sumi);
      sumi = dp4a((w.q[i] >> 4) & 0x0F0F0F0F, y_word(y, iqs + i + kQi), sumi);
    }
    return f16_to_f32(low_half(w.d)) * (static_cast<float>(sumi) * f16_to_f32(y->d) -
                                         static_cast<float>(8 * kVdr / kQi) * f16_to_f32(y->s));
  } else if constexpr (T == GgmlType::kQ4_K) {
    return dot_k4_k5<false>(w.v, w.v, w.scales, w.dm, y, iqs);
  } else if constexpr (T == GgmlType::kQ5_K) {
    return dot_k4_k5<true>(w.v, w.vh, w.scales, w.dm, y, iqs);
  } else if constexpr (T == GgmlType::kQ6_K) {
    // A q6_K block is 210 bytes: its scale bytes come out of their 16-bit
    // words. ggml subtracts 32 from each byte (__vsubss4); the same integer is
    // dp4a(v, u) - 32 * sum(u).
    constexpr int kQr = 2, kQi = 32;
    const int bq8_offset = 2 * kQr * (iqs / (kQi / 2)) + (iqs % (kQi / 2)) / (kQi / 4);
    const int scale_offset = (kQi / 4) * (iqs / (kQi / 2)) + (iqs % (kQi / 2)) / (kQi / 8);
    const int vh_shift = 2 * ((iqs % (kQi / 2)) / (kQi / 4));
    const int vh = w.vh[0] >> vh_shift;
    float sumf = 0.0f;
    for (int i = 0; i < kQr; ++i) {
      const int sc = static_cast<int8_t>(w.scales[i] >> (8 * (scale_offset % 2)));
      const int vil = (w.vl[0] >> (4 * i)) & 0x0F0F0F0F;
      const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
      const block_q8_1* y8 = y + bq8_offset + 2 * i;
      const int u = y_word(y8, iqs % 8);
      const int dot = dp4a(vil | vih, u, 0) - 32 * dp4a(0x01010101, u, 0);
      sumf += f16_to_f32(y8->d) * static_cast<float>(dot * sc);
    }
    return f16_to_f32(low_half(w.d)) * sumf;
  } else if constexpr (T == GgmlType::kQ4_1) {
    int sumi = 0;
    for (int i = 0; i < 2; ++i) {
      sumi = dp4a((w.q[i] >> 0) & 0x0F0F0F0F, y_word(y, iqs + i), sumi);
      sumi = dp4a((w.q[i] >> 4) & 0x0F0F0F0F, y_word(y, iqs + i + 4), sumi);
    }
    return with_min_dot(w.dm, y, sumi);
  } else if constexpr (T == GgmlType::kQ5_0) {
    // "- 16" comes out of the block's sum s.
    const int sumi = q5_sumi(w.q, w.qh[0], y, iqs);
    return f16_to_f32(low_half(w.d)) * (static_cast<float>(sumi) * f16_to_f32(y->d) -
                                        static_cast<float>(16 * 2 / 4) * f16_to_f32(y->s));
  } else if constexpr (T == GgmlType::kQ5_1) {
    return with_min_dot(w.dm, y, q5_sumi(w.q, w.qh[0], y, iqs));
  } else if constexpr (T == GgmlType::kQ2_K) {
    // Word iqs of qs holds 2-bit quants for four q8_1 blocks; ggml's scale
    // bytes scales[so + 2i] come from two 32-bit words.
    const int bq8_offset = 4 * (iqs / 8);
    const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    const uint64_t scale_words = static_cast<uint32_t>(w.scales[0]) |
                                 static_cast<uint64_t>(static_cast<uint32_t>(w.scales[1])) << 32;
    float sumf_d = 0.0f;
    float sumf_m = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const block_q8_1* y8 = y + bq8_offset + i;
      const int u = y_word(y8, iqs % 8);
      const float d8 = f16_to_f32(y8->d);
      const int sc = static_cast<int>((scale_words >> (8 * (scale_offset % 4 + 2 * i))) & 0xff);
      const int vi = (w.q[0] >> (2 * i)) & 0x03030303;
      sumf_d += d8 * static_cast<float>(dp4a(vi, u, 0) * (sc & 0xF));
      const int m = (sc >> 4) * 0x01010101;
      sumf_m += d8 * static_cast<float>(dp4a(m, u, 0));
    }
    return f16_to_f32(low_half(w.dm)) * sumf_d - f16_to_f32(high_half(w.dm)) * sumf_m;
  } else if constexpr (T == GgmlType::kQ3_K) {
    // ggml subtracts 4 where the high bit is clear (__vsubss4); the same
    // integer is dp4a(low, u) - dp4a(4 * clear, u). Scale isc = scale_offset +
    // 2i has its low nibble in byte isc % 8 and its high bits in byte 8 + isc %
    // 4: with scale_offset in {0, 1, 8, 9}, byte scale_offset % 2 of 16-bit
    // scale words i and 4 + i % 2.
    const int bq8_offset = 4 * (iqs / 8);
    const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    const int vh = ~w.hmask[0] >> bq8_offset;
    auto scale_word = [&w](int k) {
      return (static_cast<uint32_t>(w.scales[k / 2]) >> (16 * (k % 2))) & 0xffffu;
    };
    const int byte_shift = 8 * (scale_offset % 2);
    float sumf = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const block_q8_1* y8 = y + bq8_offset + i;
      const int u = y_word(y8, iqs % 8);
      const int isc = scale_offset + 2 * i;
      const int sc_low = (scale_word(i) >> (byte_shift + 4 * (isc / 8))) & 0xF;
      const int sc_high = ((scale_word(4 + i % 2) >> (byte_shift + 2 * (isc / 4))) & 3) << 4;
      const int sc = (sc_low | sc_high) - 32;
      const int vil = (w.vl[0] >> (2 * i)) & 0x03030303;
      const int vih = ((vh >> i) << 2) & 0x04040404;
      const int dot = dp4a(vil, u, 0) - dp4a(vih, u, 0);
      sumf += f16_to_f32(y8->d) * static_cast<float>(dot * sc);
    }
    return f16_to_f32(low_half(w.d)) * sumf;
  } else if constexpr (T == GgmlType::kIQ4_NL || T == GgmlType::kMXFP4) {
    constexpr bool kNl = T == GgmlType::kIQ4_NL;
    int sumi = 0;
    for (int l = 0; l < 2; ++l) {
      const IntPair v = int_from_table_16(w.q[l], kNl ? kIq4nlLow : kMxfp4Low,
                                          kNl ? kIq4nlHigh : kMxfp4High);
      sumi = dp4a(v.first, y_word(y, iqs + l), sumi);
      sumi = dp4a(v.second, y_word(y, iqs + l + 4), sumi);
    }
    const float scale = kNl ? f16_to_f32(low_half(w.d))
                            : e8m0_to_f32_half(static_cast<uint8_t>(w.d));
    return scale * f16_to_f32(y->d) * static_cast<float>(sumi);
  } else {
    static_assert(T == GgmlType::kIQ4_XS, "a type mmvq_traits knows");
    // vdr 4, iqs 0, 4, ..., 28: sub-block iqs / 4; the low scale nibbles come
    // from one 32-bit word.
    const block_q8_1* y8 = y + iqs / 4;
    int sumi = 0;
    for (int j = 0; j < 4; ++j) {
      const IntPair v = int_from_table_16(w.q[j], kIq4nlLow, kIq4nlHigh);
      sumi = dp4a(v.first, y_word(y8, j), sumi);
      sumi = dp4a(v.second, y_word(y8, j + 4), sumi);
    }
    const uint32_t dh = static_cast<uint32_t>(w.d_scales_h[0]);
    const int scales_l = w.scales_l[0] >> (8 * (iqs / 8));
    const int ls =
        ((scales_l >> (iqs & 4)) & 0x0F) | (((high_half(dh) >> (iqs / 2)) & 0x03) << 4);
    sumi *= ls - 32;
    return f16_to_f32(low_half(dh)) * f16_to_f32(y8->d) * static_cast<float>(sumi);
  }
}

// Element types (f32, f16, bf16): a unit is 16 bytes of a row, four aligned
// 32-bit words, against f32 activations.
MG_HD constexpr int element_chunk(GgmlType type) { return type == GgmlType::kF32 ? 4 : 8; }

struct ElementWords {
  int q[4];
};

// An element-type row's activations when it normalizes its input itself (the
// router chained to attn_out: kernels/matvec.cu): RMSNorm's output x[i] *
// scale * weight[i] in block_rmsnorm's order of products, so the same bits as
// reading what the norm writes. A plain input is a const float*.
struct NormedInput {
  const float* x;
  const float* weight;
  float scale;
  MG_HD_INLINE float operator[](int64_t i) const { return x[i] * scale * weight[i]; }
};

// The unit's dot with the activations x[at, at + chunk).
template <GgmlType T, typename X>
MG_HD_INLINE float dot_element_unit(const ElementWords& w, const X& x, int64_t at) {
  constexpr int kChunk = element_chunk(T);
  float sum = 0.0f;
  for (int i = 0; i < kChunk; ++i) {
    const uint32_t word = static_cast<uint32_t>(w.q[i * 4 / kChunk]);
    float v;
    if constexpr (T == GgmlType::kF32) {
      v = f32_from_bits(word);
    } else {
      const uint16_t half = (i % 2 == 0) ? low_half(word) : high_half(word);
      v = T == GgmlType::kF16 ? f16_to_f32(half) : bf16_to_f32(half);
    }
    sum += v * x[at + i];
  }
  return sum;
}

// ---- a row's work ----
//
// ggml-cuda's mul_mat_vec_q (mmvq.cu) at ncols_dst 1: a block of 4 warps
// (kMatvecThreads) on one row, K split over its threads. Here the threads on
// a row are the fewest (a power of two, at least kMinThreadsPerRow) that take
// the row's units in one trip of kTripUnits each, up to the whole block: a
// short row (a small model, an expert's down projection) shares the block with
// others, rows_per_block of them, so no thread idles; a long row is ggml's
// geometry. Each thread takes units t, t + threads, t + 2 threads, ... in trips
// of kTripUnits whose loads are all issued first.

inline constexpr int kMatvecThreads = 128;
inline constexpr int kMaxRowsPerBlock = 32;  // one q8_1 block of a pair's output
inline constexpr int kMinThreadsPerRow = kMatvecThreads / kMaxRowsPerBlock;
inline constexpr int kTripUnits = 2;
// An element type's unit is 16 bytes, fewer than a quant type's word group
// carries weights for: its threads load twice as many a trip (an f32 router
// row of 2048 is then in flight at once). The geometry still counts trips of
// kTripUnits, and a thread adds its units in unit order either way, so the
// bits do not change.
template <GgmlType T>
inline constexpr int kThreadTripUnits = mmvq_type(T) ? kTripUnits : 2 * kTripUnits;

// Work units of a row of cols: (block, word group) pairs for the quant types,
// 16-byte chunks for element types.
MG_HD_INLINE int64_t row_units(GgmlType type, int64_t cols) {
  if (mmvq_type(type)) {
    const MmvqTraits t = mmvq_traits(type);
    return cols / t.qk * (t.qi / t.vdr);
  }
  return cols / element_chunk(type);
}

struct MatvecGeometry {
  int threads_per_row = 0;  // a power of two from kMinThreadsPerRow to kMatvecThreads
  int rows_per_block = 0;   // kMatvecThreads / threads_per_row
};

MG_HD_INLINE MatvecGeometry matvec_geometry(GgmlType type, int64_t cols) {
  const int64_t trips = (row_units(type, cols) + kTripUnits - 1) / kTripUnits;
  int threads = kMinThreadsPerRow;
  while (threads < kMatvecThreads && threads < trips) threads *= 2;
  return {threads, kMatvecThreads / threads};
}

// Blocks a matrix of rows takes along x (times its ranks along y): what every
// matvec launcher grids by.
MG_HD_INLINE int32_t matvec_row_blocks(GgmlType type, int64_t rows, int64_t cols) {
  const int per_block = matvec_geometry(type, cols).rows_per_block;
  return static_cast<int32_t>((rows + per_block - 1) / per_block);
}

// Whether the matvec reads rows of cols of type: a q type (cols a multiple of
// its block; the activations in q8_1) or an element type (cols a multiple of
// its 16-byte chunk; f32 activations).
MG_HD_INLINE bool grouped_matvec_supports(GgmlType type, int64_t cols) {
  if (cols <= 0) return false;
  if (mmvq_type(type)) return cols % mmvq_traits(type).qk == 0;
  if (type == GgmlType::kF32 || type == GgmlType::kF16 || type == GgmlType::kBF16) {
    return cols % element_chunk(type) == 0;
  }
  return false;
}

template <GgmlType T>
using TripWords = std::conditional_t<mmvq_type(T), UnitWords<T>, ElementWords>;

// Unit u of a row of type T: its words (the quant types' iqs in *iqs).
template <GgmlType T>
MG_HD_INLINE TripWords<T> load_row_unit(const uint8_t* row, int64_t u) {
  if constexpr (mmvq_type(T)) {
    constexpr MmvqTraits tr = mmvq_traits(T);
    constexpr int kPerBlock = tr.qi / tr.vdr;
    return load_unit<T>(row + u / kPerBlock * static_cast<int64_t>(quant_block_bytes(T)),
                        tr.vdr * static_cast<int>(u % kPerBlock));
  } else {
    ElementWords w;
    load_words<4, true>(row + 16 * u, w.q);
    return w;
  }
}

template <GgmlType T, typename X>
MG_HD_INLINE float dot_row_unit(const TripWords<T>& w, const X& x, const block_q8_1* y,
                                int64_t u) {
  if constexpr (mmvq_type(T)) {
    constexpr MmvqTraits tr = mmvq_traits(T);
    constexpr int kPerBlock = tr.qi / tr.vdr;
    return dot_unit<T>(w, y + u / kPerBlock * (tr.qk / QK8_1),
                       tr.vdr * static_cast<int>(u % kPerBlock));
  } else {
    return dot_element_unit<T>(w, x, u * element_chunk(T));
  }
}

// Thread t of the `threads` on a row: its parts of the dots of M rows of type
// T (a gate/up pair: M = 2) with the activations (q types read y, element types
// x: a const float* or a NormedInput), into sums[M]. Each trip loads every
// unit's words first (units past the row load the row's last unit and add
// nothing, so the loads need no branch).
template <GgmlType T, int M, typename X>
MG_HD_INLINE void thread_partials(const uint8_t* const (&rows)[M], const X& x,
                                  const block_q8_1* y, int64_t cols, int t, int threads,
                                  float (&sums)[M]) {
  constexpr int kTrip = kThreadTripUnits<T>;
  const int64_t units = row_units(T, cols);
  for (int64_t u0 = t; u0 < units; u0 += static_cast<int64_t>(kTrip) * threads) {
    TripWords<T> w[M][kTrip];
    for (int m = 0; m < M; ++m) {
      for (int i = 0; i < kTrip; ++i) {
        const int64_t u = u0 + static_cast<int64_t>(i) * threads;
        w[m][i] = load_row_unit<T>(rows[m], u < units ? u : units - 1);
      }
    }
    for (int i = 0; i < kTrip; ++i) {
      const int64_t u = u0 + static_cast<int64_t>(i) * threads;
      for (int m = 0; m < M; ++m) {
        const float d = dot_row_unit<T>(w[m][i], x, y, u < units ? u : units - 1);
        sums[m] += u < units ? d : 0.0f;
      }
    }
  }
}

// The row's sum from its threads' parts, as the kernel reduces them: up to a
// warp, a butterfly over the threads; past it (mul_mat_vec_q's order), lane l
// of the row's first warp adds lane l of each later warp, in warp order, then
// the warp's butterfly.
MG_HD_INLINE float row_sum_of_parts(float* parts, int threads) {
  if (threads <= 32) return butterfly_sum(parts, threads);
  for (int lane = 0; lane < 32; ++lane) {
    for (int w = 1; w < threads / 32; ++w) parts[lane] += parts[32 * w + lane];
  }
  return butterfly_sum(parts, 32);
}

// The row's dot as the kernels compute it. The host reference of the matvec.
template <GgmlType T>
MG_HD_INLINE float matvec_row_reference(const uint8_t* row, const float* x, const block_q8_1* y,
                                        int64_t cols) {
  const int threads = matvec_geometry(T, cols).threads_per_row;
  float parts[kMatvecThreads];
  const uint8_t* const rows[1] = {row};
  for (int t = 0; t < threads; ++t) {
    float sums[1] = {0.0f};
    thread_partials<T, 1>(rows, x, y, cols, t, threads, sums);
    parts[t] = sums[0];
  }
  return row_sum_of_parts(parts, threads);
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
    case GgmlType::kQ4_1: return matvec_row_reference<GgmlType::kQ4_1>(row, x, y, cols);
    case GgmlType::kQ5_0: return matvec_row_reference<GgmlType::kQ5_0>(row, x, y, cols);
    case GgmlType::kQ5_1: return matvec_row_reference<GgmlType::kQ5_1>(row, x, y, cols);
    case GgmlType::kQ2_K: return matvec_row_reference<GgmlType::kQ2_K>(row, x, y, cols);
    case GgmlType::kQ3_K: return matvec_row_reference<GgmlType::kQ3_K>(row, x, y, cols);
    case GgmlType::kIQ4_NL: return matvec_row_reference<GgmlType::kIQ4_NL>(row, x, y, cols);
    case GgmlType::kIQ4_XS: return matvec_row_reference<GgmlType::kIQ4_XS>(row, x, y, cols);
    case GgmlType::kMXFP4: return matvec_row_reference<GgmlType::kMXFP4>(row, x, y, cols);
    case GgmlType::kF32: return matvec_row_reference<GgmlType::kF32>(row, x, y, cols);
    case GgmlType::kF16: return matvec_row_reference<GgmlType::kF16>(row, x, y, cols);
    case GgmlType::kBF16: return matvec_row_reference<GgmlType::kBF16>(row, x, y, cols);
    default: return 0.0f;
  }
}

}  // namespace moegraph
