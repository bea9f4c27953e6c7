// Highway compiles this file once per target (foreach_target.h re-includes it);
// the functions in HWY_NAMESPACE are that target's, the ones after HWY_ONCE
// dispatch to the best target the CPU supports.
//
// The integer dot products multiply u8 by i8 in pairs into int16 (vpmaddubsw
// on x86; the portable target widens both to int16 first), then multiply-add
// int16 pairs into int32 (pmaddwd). A K-quant's group scale multiplies the
// int16 products inside that multiply-add, as ggml's AVX2 code does, so one
// int32 accumulator serves a whole super-block; the block scales (and the q8_0
// scales) multiply the int32 sums in f32. On x86 each quantized type's kernel
// follows its ggml_vec_dot_* (ggml-cpu/arch/x86/quants.c, AVX2) wherever the
// rounding depends on it: the same products in each int32 lane, the same f32
// multiply-adds in the same order (fused where ggml's build fuses them), the
// same horizontal sum; so each dot is ggml's CPU backend's bit for bit
// (tests/cpu_kernels_test.cc holds them to ggml's own results).
// Every target the CPU may have (AVX-512 with VNNI: AVX3_DL, which Highway
// compiles only when asked; AVX-512; AVX2) and the portable one (EMU128, or
// SCALAR where the compiler is too old for EMU128: GCC before 12.3), which the
// tests run too; SSSE3 and SSE4 would only add compile time.
#ifndef HWY_COMPILE_ALL_ATTAINABLE
#define HWY_COMPILE_ALL_ATTAINABLE
#define HWY_WANT_AVX3_DL
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_kernels.cc"
#include "cpu/simd_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/act_quant.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "loader/quant.h"

// The x86 targets unpack each weight block once for several activation rows
// (DotTile); the portable one takes one row at a time.
// The AVX-512 targets (AVX3, and AVX3_DL with VNNI) add 512-bit kernels.
#undef MOEGRAPH_X86_TILES
#undef MOEGRAPH_AVX512
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define MOEGRAPH_AVX512 1
#endif
#if HWY_TARGET == HWY_AVX2 || defined(MOEGRAPH_AVX512)
#define MOEGRAPH_X86_TILES 1
#endif

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// This Highway's AVX3_DL target string names avxvnni but not avx512vnni, which its
// runtime check for AVX3_DL requires; the 512-bit dot products need it by name.
#pragma GCC target("avx512vnni")
#endif
namespace moegraph {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#ifndef MOEGRAPH_X86_TILES
using D16 = hn::ScalableTag<int16_t>;       // 32-element groups: 1, 2 or 4 vectors
using D16x16 = hn::CappedTag<int16_t, 16>;  // 16-element groups (q6_K, q4_0 halves)

template <class D>
HWY_INLINE hn::Vec<D> LoadI8(D d, const int8_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<int8_t, D>(), p));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadU8(D d, const uint8_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<uint8_t, D>(), p));
}
template <class D>
HWY_INLINE int32_t SumI32(D d16, hn::Vec<hn::RepartitionToWide<D>> a,
                          hn::Vec<hn::RepartitionToWide<D>> b) {
  const hn::RepartitionToWide<D> d32;
  (void)d16;
  return hn::GetLane(hn::SumOfLanes(d32, hn::Add(a, b)));
}

float DotQ8_0(const block_q8_0* x, const block_q8_0* y, int64_t nb) {
  const D16 d16;
  const hn::RepartitionToWide<D16> d32;
  const hn::RebindToFloat<decltype(d32)> df;
  const size_t n = hn::Lanes(d16);
  auto acc = hn::Zero(df);
  for (int64_t b = 0; b < nb; ++b) {
    auto s0 = hn::Zero(d32), s1 = hn::Zero(d32);
    for (size_t i = 0; i < QK8_0; i += n) {
      s0 = hn::ReorderWidenMulAccumulate(d32, LoadI8(d16, x[b].qs + i), LoadI8(d16, y[b].qs + i),
                                         s0, s1);
    }
    const float scale = f16_to_f32(x[b].d) * f16_to_f32(y[b].d);
    acc = hn::MulAdd(hn::ConvertTo(df, hn::Add(s0, s1)), hn::Set(df, scale), acc);
  }
  return hn::GetLane(hn::SumOfLanes(df, acc));
}

float DotQ4_0(const block_q4_0* x, const block_q8_0* y, int64_t nb) {
  const D16x16 d16;
  const hn::RepartitionToWide<D16x16> d32;
  const hn::RebindToFloat<decltype(d32)> df;
  const size_t n = hn::Lanes(d16);
  const auto mask = hn::Set(d16, 0x0F);
  const auto eight = hn::Set(d16, 8);
  auto acc = hn::Zero(df);
  for (int64_t b = 0; b < nb; ++b) {
    auto s0 = hn::Zero(d32), s1 = hn::Zero(d32);
    for (size_t i = 0; i < QK4_0 / 2; i += n) {
      const auto w = LoadU8(d16, x[b].qs + i);
      s0 = hn::ReorderWidenMulAccumulate(d32, hn::Sub(hn::And(w, mask), eight),
                                         LoadI8(d16, y[b].qs + i), s0, s1);
      s0 = hn::ReorderWidenMulAccumulate(d32, hn::Sub(hn::ShiftRight<4>(w), eight),
                                         LoadI8(d16, y[b].qs + QK4_0 / 2 + i), s0, s1);
    }
    const float scale = f16_to_f32(x[b].d) * f16_to_f32(y[b].d);
    acc = hn::MulAdd(hn::ConvertTo(df, hn::Add(s0, s1)), hn::Set(df, scale), acc);
  }
  return hn::GetLane(hn::SumOfLanes(df, acc));
}

// q4_K and q5_K (kFive): per 64-element chunk c, the low nibbles are elements
// [0, 32) with scale 2c, the high ones [32, 64) with scale 2c + 1.
template <bool kFive, typename Block>
float DotK45(const Block* x, const block_q8_K* y, int64_t nb) {
  const D16 d16;
  const hn::RepartitionToWide<D16> d32;
  const size_t n = hn::Lanes(d16);
  const auto mask = hn::Set(d16, 0x0F);
  const auto one = hn::Set(d16, 1);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) get_scale_min_k4(j, x[b].scales, &sc[j], &mn[j]);
    int32_t summ = 0;
    for (int j = 0; j < QK_K / 16; ++j) summ += y[b].bsums[j] * mn[j / 2];
    auto s0 = hn::Zero(d32), s1 = hn::Zero(d32);
    for (int c = 0; c < 4; ++c) {
      const auto scale_lo = hn::Set(d16, sc[2 * c]);
      const auto scale_hi = hn::Set(d16, sc[2 * c + 1]);
      for (size_t i = 0; i < 32; i += n) {
        const auto w = LoadU8(d16, x[b].qs + 32 * c + i);
        auto lo = hn::And(w, mask);
        auto hi = hn::ShiftRight<4>(w);
        if constexpr (kFive) {
          const auto h = LoadU8(d16, x[b].qh + i);
          lo = hn::Add(lo, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(h, 2 * c), one)));
          hi = hn::Add(hi, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(h, 2 * c + 1), one)));
        }
        const int8_t* a = y[b].qs + 64 * c + i;
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(lo, LoadI8(d16, a)), scale_lo, s0, s1);
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(hi, LoadI8(d16, a + 32)), scale_hi, s0, s1);
      }
    }
    const int32_t sumi = SumI32(d16, s0, s1);
    sum += f16_to_f32(x[b].d) * y[b].d * static_cast<float>(sumi) -
           f16_to_f32(x[b].dmin) * y[b].d * static_cast<float>(summ);
  }
  return sum;
}

// q6_K: per 128-element half, element l of [0, 32) gives four values (l, l + 32,
// l + 64, l + 96) from ql[l], ql[l + 32] and qh[l]; a scale per 16 elements.
float DotQ6K(const block_q6_K* x, const block_q8_K* y, int64_t nb) {
  const D16x16 d16;
  const hn::RepartitionToWide<D16x16> d32;
  const size_t n = hn::Lanes(d16);
  const auto mask = hn::Set(d16, 0x0F);
  const auto three = hn::Set(d16, 3);
  const auto bias = hn::Set(d16, 32);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    auto s0 = hn::Zero(d32), s1 = hn::Zero(d32);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x[b].ql + 64 * half;
      const uint8_t* qh = x[b].qh + 32 * half;
      const int8_t* a = y[b].qs + 128 * half;
      const int8_t* scales = x[b].scales + 8 * half;
      for (size_t i = 0; i < 32; i += n) {
        const auto l0 = LoadU8(d16, ql + i);
        const auto l1 = LoadU8(d16, ql + 32 + i);
        const auto h = LoadU8(d16, qh + i);
        const auto w0 = hn::Or(hn::And(l0, mask), hn::ShiftLeft<4>(hn::And(h, three)));
        const auto w1 =
            hn::Or(hn::And(l1, mask), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<2>(h), three)));
        const auto w2 =
            hn::Or(hn::ShiftRight<4>(l0), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<4>(h), three)));
        const auto w3 = hn::Or(hn::ShiftRight<4>(l1), hn::ShiftLeft<4>(hn::ShiftRight<6>(h)));
        const size_t g = i / 16;  // a vector of at most 16 lanes sits in one group
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(hn::Sub(w0, bias), LoadI8(d16, a + i)),
                                           hn::Set(d16, scales[g]), s0, s1);
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(hn::Sub(w1, bias), LoadI8(d16, a + 32 + i)),
                                           hn::Set(d16, scales[2 + g]), s0, s1);
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(hn::Sub(w2, bias), LoadI8(d16, a + 64 + i)),
                                           hn::Set(d16, scales[4 + g]), s0, s1);
        s0 = hn::ReorderWidenMulAccumulate(d32, hn::Mul(hn::Sub(w3, bias), LoadI8(d16, a + 96 + i)),
                                           hn::Set(d16, scales[6 + g]), s0, s1);
      }
    }
    sum += f16_to_f32(x[b].d) * y[b].d * static_cast<float>(SumI32(d16, s0, s1));
  }
  return sum;
}

#endif  // !MOEGRAPH_X86_TILES

// Element rows: four accumulators hide the multiply-add latency.
template <class Load>
float DotElements(const float* a, int64_t count, const Load& load) {
  const hn::ScalableTag<float> df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  auto acc0 = hn::Zero(df), acc1 = hn::Zero(df), acc2 = hn::Zero(df), acc3 = hn::Zero(df);
  int64_t i = 0;
  for (; i + 4 * n <= count; i += 4 * n) {
    acc0 = hn::MulAdd(hn::LoadU(df, a + i), load(df, i), acc0);
    acc1 = hn::MulAdd(hn::LoadU(df, a + i + n), load(df, i + n), acc1);
    acc2 = hn::MulAdd(hn::LoadU(df, a + i + 2 * n), load(df, i + 2 * n), acc2);
    acc3 = hn::MulAdd(hn::LoadU(df, a + i + 3 * n), load(df, i + 3 * n), acc3);
  }
  for (; i + n <= count; i += n) acc0 = hn::MulAdd(hn::LoadU(df, a + i), load(df, i), acc0);
  float sum = hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3))));
  if (i < count) {
    const hn::CappedTag<float, 1> d1;
    for (; i < count; ++i) sum += hn::GetLane(hn::Mul(hn::LoadU(d1, a + i), load(d1, i)));
  }
  return sum;
}

float DotF32(const float* a, const float* b, int64_t n) {
  return DotElements(a, n, [b](auto d, int64_t i) { return hn::LoadU(d, b + i); });
}

float DotF16(const float* a, const uint16_t* b, int64_t n) {
  const auto* h = reinterpret_cast<const hwy::float16_t*>(b);
  return DotElements(a, n, [h](auto d, int64_t i) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, decltype(d)>(), h + i));
  });
}

float DotBF16(const float* a, const uint16_t* b, int64_t n) {
  return DotElements(a, n, [b](auto d, int64_t i) {
    const hn::RebindToUnsigned<decltype(d)> du;
    const auto wide = hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint16_t, decltype(d)>(), b + i));
    return hn::BitCast(d, hn::ShiftLeft<16>(wide));
  });
}

template <class Load>
void AxpyElements(float alpha, float* y, int64_t count, const Load& load) {
  const hn::ScalableTag<float> df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  const auto va = hn::Set(df, alpha);
  int64_t i = 0;
  for (; i + n <= count; i += n) {
    hn::StoreU(hn::MulAdd(va, load(df, i), hn::LoadU(df, y + i)), df, y + i);
  }
  const hn::CappedTag<float, 1> d1;
  for (; i < count; ++i) {
    hn::StoreU(hn::MulAdd(hn::Set(d1, alpha), load(d1, i), hn::LoadU(d1, y + i)), d1, y + i);
  }
}

void AxpyF32(float alpha, const float* x, float* y, int64_t n) {
  AxpyElements(alpha, y, n, [x](auto d, int64_t i) { return hn::LoadU(d, x + i); });
}

void AxpyF16(float alpha, const uint16_t* x, float* y, int64_t n) {
  const auto* h = reinterpret_cast<const hwy::float16_t*>(x);
  AxpyElements(alpha, y, n, [h](auto d, int64_t i) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, decltype(d)>(), h + i));
  });
}

// SimdDeltaRuleStep: row j's dots with k and q from the undecayed row (decay
// times them is the decayed row's), then m_j = decay m_j + delta_j k.
void DeltaRuleStep(int head_dim, const float* q, const float* k, const float* v, float decay,
                   float beta, float scale, float* m, float* o) {
  const hn::ScalableTag<float> df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  const int64_t d = head_dim;
  const float kq = DotF32(k, q, d);
  const auto vdecay = hn::Set(df, decay);
  for (int64_t j = 0; j < d; ++j) {
    float* row = m + j * d;
    auto acc_k = hn::Zero(df), acc_q = hn::Zero(df);
    int64_t i = 0;
    for (; i + n <= d; i += n) {
      const auto r = hn::LoadU(df, row + i);
      acc_k = hn::MulAdd(r, hn::LoadU(df, k + i), acc_k);
      acc_q = hn::MulAdd(r, hn::LoadU(df, q + i), acc_q);
    }
    float mk = hn::GetLane(hn::SumOfLanes(df, acc_k));
    float mq = hn::GetLane(hn::SumOfLanes(df, acc_q));
    for (int64_t t = i; t < d; ++t) {
      mk += row[t] * k[t];
      mq += row[t] * q[t];
    }
    const float delta = (v[j] - decay * mk) * beta;
    const auto vdelta = hn::Set(df, delta);
    for (i = 0; i + n <= d; i += n) {
      hn::StoreU(hn::MulAdd(vdelta, hn::LoadU(df, k + i), hn::Mul(vdecay, hn::LoadU(df, row + i))),
                 df, row + i);
    }
    for (; i < d; ++i) row[i] = decay * row[i] + delta * k[i];
    o[j] = (decay * mq + delta * kq) * scale;
  }
}

// A K or V row's elements i.. as f32 lanes: f16 bits widened (exactly), or f32.
template <bool kF16, class D>
HWY_INLINE hn::Vec<D> LoadKv(D d, const uint8_t* row, int64_t i) {
  if constexpr (kF16) {
    const auto* h = reinterpret_cast<const hwy::float16_t*>(row);
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), h + i));
  } else {
    return hn::LoadU(d, reinterpret_cast<const float*>(row) + i);
  }
}

// AttendHeads for heads of kDim elements, a multiple of 4 vectors: each K row
// widened once for all the heads (a GQA group shares it), and a head's output
// kept in registers across the positions, where DotF16 and AxpyF16 reload
// both for every position. Each score and each output lane takes
// DotElements' and AxpyElements' operations in their order, so the bits are
// the general loop's, head by head.
template <int kDim, bool kF16, class RowOf>
void AttendGroupInRegisters(const float* q, int heads, const uint8_t* k, const uint8_t* v,
                            const RowOf& row_of, int64_t n, float scale, const float* sinks,
                            float* scores, float* out) {
  const hn::ScalableTag<float> df;
  constexpr int kLanes = static_cast<int>(hn::MaxLanes(df));
  constexpr int kChunks = kDim / kLanes;
  static_assert(kChunks % 4 == 0, "DotElements' four accumulators, whole");
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* kj = k + row_of(j);
    hn::Vec<decltype(df)> kv[kChunks];
    for (int c = 0; c < kChunks; ++c) kv[c] = LoadKv<kF16>(df, kj, c * kLanes);
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + h * kDim;
      auto acc0 = hn::Zero(df), acc1 = hn::Zero(df), acc2 = hn::Zero(df), acc3 = hn::Zero(df);
      for (int c = 0; c < kChunks; c += 4) {
        acc0 = hn::MulAdd(hn::LoadU(df, qh + c * kLanes), kv[c], acc0);
        acc1 = hn::MulAdd(hn::LoadU(df, qh + (c + 1) * kLanes), kv[c + 1], acc1);
        acc2 = hn::MulAdd(hn::LoadU(df, qh + (c + 2) * kLanes), kv[c + 2], acc2);
        acc3 = hn::MulAdd(hn::LoadU(df, qh + (c + 3) * kLanes), kv[c + 3], acc3);
      }
      scores[h * n + j] = scale * hn::GetLane(hn::SumOfLanes(
                                      df, hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3))));
    }
  }
  for (int h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    const float sink = sinks == nullptr ? -INFINITY : sinks[h];
    float max = sink;
    for (int64_t j = 0; j < n; ++j) max = std::max(max, s[j]);
    double sum = sink == -INFINITY ? 0.0 : std::exp(static_cast<double>(sink) - max);
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - max);
      sum += s[j];
    }
    hn::Vec<decltype(df)> ov[kChunks];
    for (int c = 0; c < kChunks; ++c) ov[c] = hn::Zero(df);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* vj = v + row_of(j);
      const auto w = hn::Set(df, s[j]);
      for (int c = 0; c < kChunks; ++c) ov[c] = hn::MulAdd(w, LoadKv<kF16>(df, vj, c * kLanes), ov[c]);
    }
    const auto inv = hn::Set(df, static_cast<float>(1.0 / sum));
    float* oh = out + h * kDim;
    for (int c = 0; c < kChunks; ++c) hn::StoreU(hn::Mul(ov[c], inv), df, oh + c * kLanes);
  }
}

// One head's general loop: DotF16/F32 scores, softmax in f64, AxpyF16/F32.
template <class RowOf>
void AttendHeadLoop(const float* q, const uint8_t* k, const uint8_t* v, const RowOf& row_of,
                    bool f16, int64_t n, int head_dim, float scale, float sink, float* scores,
                    float* out) {
  float max = sink;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* kj = k + row_of(j);
    scores[j] = scale * (f16 ? DotF16(q, reinterpret_cast<const uint16_t*>(kj), head_dim)
                             : DotF32(q, reinterpret_cast<const float*>(kj), head_dim));
    max = std::max(max, scores[j]);
  }
  double sum = sink == -INFINITY ? 0.0 : std::exp(static_cast<double>(sink) - max);
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - max);
    sum += scores[j];
  }
  std::fill_n(out, head_dim, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* vj = v + row_of(j);
    if (f16) {
      AxpyF16(scores[j], reinterpret_cast<const uint16_t*>(vj), out, head_dim);
    } else {
      AxpyF32(scores[j], reinterpret_cast<const float*>(vj), out, head_dim);
    }
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int d = 0; d < head_dim; ++d) out[d] *= inv;
}

void AttendHeads(const float* q, int heads, const uint8_t* k, const uint8_t* v, size_t stride,
                 bool f16, int64_t first, int64_t n, int64_t rows, int head_dim, float scale,
                 const float* sinks, float* scores, float* out) {
  auto row_bytes = [&](int64_t j) {
    const int64_t p = first + j;
    return static_cast<size_t>(rows > 0 ? p % rows : p) * stride;
  };
  constexpr int kLanes = static_cast<int>(hn::MaxLanes(hn::ScalableTag<float>()));
  // In registers where a head is at most 8 vectors (AVX-512: 64 and 128;
  // AVX2: 64).
  if constexpr (128 / kLanes <= 8 && 128 % (4 * kLanes) == 0) {
    if (head_dim == 128) {
      return f16 ? AttendGroupInRegisters<128, true>(q, heads, k, v, row_bytes, n, scale, sinks,
                                                     scores, out)
                 : AttendGroupInRegisters<128, false>(q, heads, k, v, row_bytes, n, scale, sinks,
                                                      scores, out);
    }
  }
  if constexpr (64 / kLanes <= 8 && 64 % (4 * kLanes) == 0) {
    if (head_dim == 64) {
      return f16 ? AttendGroupInRegisters<64, true>(q, heads, k, v, row_bytes, n, scale, sinks,
                                                    scores, out)
                 : AttendGroupInRegisters<64, false>(q, heads, k, v, row_bytes, n, scale, sinks,
                                                     scores, out);
    }
  }
  for (int h = 0; h < heads; ++h) {
    AttendHeadLoop(q + h * head_dim, k, v, row_bytes, f16, n, head_dim, scale,
                   sinks == nullptr ? -INFINITY : sinks[h], scores, out + h * head_dim);
  }
}

#ifdef MOEGRAPH_X86_TILES
// x86 (AVX2, and AVX-512 at 256 bits): ggml's AVX2 scheme on tiles of weight
// rows by activation rows (MatMulRows picks the shapes). Highway 1.0.3 (Debian 12) lacks the
// u8 x i8 pairwise multiply-add (SatWidenMulPairwiseAdd, added in Highway 1.1)
// and the i8 sign transfer, so MulPairs and SignOf wrap the intrinsics every
// AVX2 CPU has (vpmaddubsw, vpsignb), and F16 the F16C conversion. No int16 saturates: weights are
// at most 63, activations at most 127 in magnitude, and 2 * 63 * 127 < 32767.
using DU8 = hn::Full256<uint8_t>;
using DI8 = hn::Full256<int8_t>;
using DI16 = hn::Full256<int16_t>;
using DI32 = hn::Full256<int32_t>;
using DF32 = hn::Full256<float>;
using VI32 = hn::Vec256<int32_t>;
using VF32 = hn::Vec256<float>;

HWY_INLINE hn::Vec256<int16_t> MulPairs(hn::Vec256<uint8_t> a, hn::Vec256<int8_t> b) {
  return hn::Vec256<int16_t>{_mm256_maddubs_epi16(a.raw, b.raw)};
}
// b with the sign of s (0 where s is 0).
HWY_INLINE hn::Vec256<int8_t> SignOf(hn::Vec256<int8_t> b, hn::Vec256<int8_t> s) {
  return hn::Vec256<int8_t>{_mm256_sign_epi8(b.raw, s.raw)};
}
// acc + the int16 pairs of p times scale, summed in pairs (vpmaddwd).
HWY_INLINE VI32 MulAddPairs(hn::Vec256<int16_t> p, hn::Vec256<int16_t> scale, VI32 acc) {
  VI32 unused = hn::Zero(DI32());
  return hn::ReorderWidenMulAccumulate(DI32(), p, scale, acc, unused);
}
// Sums of 4 products of x and y (signed 32-element blocks) in 8 lanes.
HWY_INLINE VI32 DotI8(hn::Vec256<uint8_t> abs_x, hn::Vec256<int8_t> x, hn::Vec256<int8_t> y) {
  return MulAddPairs(MulPairs(abs_x, SignOf(y, x)), hn::Set(DI16(), 1), hn::Zero(DI32()));
}
HWY_INLINE float ReduceF32(VF32 v) { return hn::GetLane(hn::SumOfLanes(DF32(), v)); }
// A block scale: F16C's conversion (exact, as f16_to_f32) without its branches.
HWY_INLINE float F16(uint16_t h) { return _cvtsh_ss(h); }

// Each weight block's lines kPrefetchBytes ahead, asked for as it is read: on a
// model much larger than the caches, decode on one thread streams weights
// about 1.6x faster with it (the 17 GiB Qwen3-30B-A3B-shaped file, 2.3 to 3.7
// t/s; 1 KiB ahead gives 3.0, 8 KiB as 4 KiB); mxfp4 rows of 16 MiB with one
// activation row 15% faster on BM_Dot.
constexpr int kPrefetchBytes = 4096;
template <typename Block>
HWY_INLINE void PrefetchAhead(const Block* x) {
  const char* ahead = reinterpret_cast<const char*>(x) + kPrefetchBytes;
  for (size_t line = 0; line < sizeof(Block); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// R weight rows by N activation rows: out[r * N + n]. Each (r, n) takes the
// operations it takes alone; the tile only shares loads and unpacking.
template <int R, int N>
void DotQ8_0Tile(const block_q8_0* const* x, const block_q8_0* const* y, int64_t nb, float* out) {
  VF32 acc[R][N];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) acc[r][n] = hn::Zero(DF32());
  }
  for (int64_t b = 0; b < nb; ++b) {
    hn::Vec256<int8_t> w[R];
    hn::Vec256<uint8_t> abs_w[R];
    float dx[R];
    for (int r = 0; r < R; ++r) {
      PrefetchAhead(x[r] + b);
      w[r] = hn::LoadU(DI8(), x[r][b].qs);
      abs_w[r] = hn::BitCast(DU8(), hn::Abs(w[r]));
      dx[r] = F16(x[r][b].d);
    }
    for (int n = 0; n < N; ++n) {
      const auto a = hn::LoadU(DI8(), y[n][b].qs);
      const float dy = F16(y[n][b].d);
      for (int r = 0; r < R; ++r) {
        const VI32 s = DotI8(abs_w[r], w[r], a);
        acc[r][n] = hn::MulAdd(hn::ConvertTo(DF32(), s), hn::Set(DF32(), dx[r] * dy), acc[r][n]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) out[r * N + n] = ReduceF32(acc[r][n]);
  }
}

// The 32-element block types, ggml's ggml_vec_dot_{q4_0,q5_0}_q8_0 and
// ggml_vec_dot_{q4_1,q5_1}_q8_1 (x86/quants.c, AVX2) and q4_0's scheme for
// iq4_nl and mxfp4: a block's weights as 32 bytes, element i in byte i, low
// nibbles then high (bytes_from_nibbles_32); q5's fifth bit from qh
// (bytes_from_bits_32); the table types' nibbles looked up in their 16 values
// (vpshufb: q4_0's is i - 8, iq4_nl's kvalues_iq4nl, mxfp4's doubled E2M1).
HWY_INLINE hn::Vec256<uint8_t> Nibbles(const uint8_t* qs) {
  const hn::Full128<uint8_t> d128;
  const auto q = hn::LoadU(d128, qs);
  return hn::Combine(DU8(), hn::ShiftRight<4>(q), hn::And(q, hn::Set(d128, uint8_t{0x0F})));
}
// 0xFF in byte i where bit i of the 32 at qh is set.
HWY_INLINE hn::Vec256<uint8_t> FifthBits(const uint8_t* qh) {
  return hn::VecFromMask(DU8(), hn::LoadMaskBits(DU8(), qh));
}
HWY_INLINE hn::Vec256<int8_t> Lookup(hn::Vec256<uint8_t> nibbles, uint64_t low, uint64_t high) {
  const hn::Full128<uint8_t> d128;
  alignas(16) const uint64_t words[2] = {low, high};
  const auto table128 = hn::Load(d128, reinterpret_cast<const uint8_t*>(words));
  return hn::TableLookupBytes(hn::BitCast(DI8(), hn::Combine(DU8(), table128, table128)),
                              hn::BitCast(DI8(), nibbles));
}

// -8 .. 7: q4_0's nibble minus 8, as a table.
constexpr uint64_t kQ4_0Low = 0xfffefdfcfbfaf9f8ull, kQ4_0High = 0x0706050403020100ull;

// Signed weights (the types without a min) meet the activations as ggml's
// mul_sum_i8_pairs_float: |w| times a with w's sign. Unsigned ones (q4_1,
// q5_1) as mul_sum_us8_pairs_float: w times a.
HWY_INLINE hn::Vec256<int8_t> Weights(const block_q4_0& b) {
  return Lookup(Nibbles(b.qs), kQ4_0Low, kQ4_0High);
}
HWY_INLINE hn::Vec256<int8_t> Weights(const block_iq4_nl& b) {
  return Lookup(Nibbles(b.qs), kIq4nlLow, kIq4nlHigh);
}
HWY_INLINE hn::Vec256<int8_t> Weights(const block_mxfp4& b) {
  return Lookup(Nibbles(b.qs), kMxfp4Low, kMxfp4High);
}
// The nibble less 16 where the fifth bit is clear: nibble | 0xF0.
HWY_INLINE hn::Vec256<int8_t> Weights(const block_q5_0& b) {
  const auto high = hn::AndNot(FifthBits(b.qh), hn::Set(DU8(), uint8_t{0xF0}));
  return hn::BitCast(DI8(), hn::Or(Nibbles(b.qs), high));
}
HWY_INLINE hn::Vec256<uint8_t> Weights(const block_q4_1& b) { return Nibbles(b.qs); }
HWY_INLINE hn::Vec256<uint8_t> Weights(const block_q5_1& b) {
  return hn::Or(Nibbles(b.qs), hn::And(FifthBits(b.qh), hn::Set(DU8(), uint8_t{0x10})));
}

HWY_INLINE float BlockScale(const block_q4_0& b) { return F16(b.d); }
HWY_INLINE float BlockScale(const block_q5_0& b) { return F16(b.d); }
HWY_INLINE float BlockScale(const block_q4_1& b) { return F16(b.d); }
HWY_INLINE float BlockScale(const block_q5_1& b) { return F16(b.d); }
HWY_INLINE float BlockScale(const block_iq4_nl& b) { return F16(b.d); }
HWY_INLINE float BlockScale(const block_mxfp4& b) { return e8m0_to_f32_half(b.e); }

#ifdef MOEGRAPH_AVX512
// iq4_nl and mxfp4 on AVX-512: blocks b and b + 1 in one 512-bit vector, so
// the lanes of one accumulator hold ggml's accum1 (b even) and accum2 (b odd),
// each lane taking the operations it takes at 256 bits (below), at half the
// instructions; the lanes go back to accum1 | accum2 before ggml's sum. The
// weights' magnitudes are looked up and their signs read off the nibble (no
// vpsignb at 512 bits: the activations are negated under the sign mask; where
// a weight is 0 its product is 0 either way). The activations come paired as
// the nibbles unpack (ActPair) and their block scales converted, once per
// matrix; the weights' scales 16 blocks at a time in vector lanes; each pair's
// two products d_w d_a (the same f32 products) one permute away. With VNNI
// (AVX3_DL) the weights are looked up biased to unsigned, w + kBias, and one
// vpdpbusd a pair sums their products with the activations from -kBias times
// the activations' sums of 4 (made once per matrix): the same int32 lanes,
// exactly, in one instruction where the sign transfer takes four.

// 16 blocks' scales from their first bytes (one gather): mxfp4's e8m0 as
// e8m0_to_f32_half, iq4_nl's f16 d. Lanes past `valid` are 0.
HWY_INLINE __m512 BlockScales16(const block_mxfp4* x, __mmask16 valid) {
  const __m512i offsets =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(sizeof(block_mxfp4)));
  const __m512i e = _mm512_and_si512(
      _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, &x->e, 1),
      _mm512_set1_epi32(0xFF));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __m512i bits =
      _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny);
  return _mm512_maskz_mov_ps(valid, _mm512_castsi512_ps(bits));
}
HWY_INLINE __m512 BlockScales16(const block_iq4_nl* x, __mmask16 valid) {
  const __m512i offsets =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(sizeof(block_iq4_nl)));
  const __m512i d = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, &x->d, 1);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
}

// Each type's 16 values (as Lookup takes them), their magnitudes, and which
// nibbles are negative: mxfp4's those with bit 3 set (sign and magnitude),
// iq4_nl's those without (its values ascend from -127).
template <typename Block>
struct PairTable;
constexpr int8_t TableValue(uint64_t low, uint64_t high, int i) {
  return static_cast<int8_t>(((i < 8 ? low : high) >> (8 * (i % 8))) & 0xFF);
}
constexpr int MinValue(uint64_t low, uint64_t high) {
  int least = 0;
  for (int i = 0; i < 16; ++i) least = std::min<int>(least, TableValue(low, high, i));
  return least;
}
template <>
struct PairTable<block_mxfp4> {
  static constexpr uint64_t kLow = kMxfp4Low, kHigh = kMxfp4High;
  static constexpr bool kNegativeWithBit3 = true;
  static constexpr int kBias = -MinValue(kLow, kHigh);  // 12
};
template <>
struct PairTable<block_iq4_nl> {
  static constexpr uint64_t kLow = kIq4nlLow, kHigh = kIq4nlHigh;
  static constexpr bool kNegativeWithBit3 = false;
  static constexpr int kBias = -MinValue(kLow, kHigh);  // 127
};
// The 16 values plus bias from `first` on, 8 of them, as unsigned bytes.
constexpr uint64_t BiasedWord(uint64_t low, uint64_t high, int first, int bias) {
  uint64_t word = 0;
  for (int i = 0; i < 8; ++i) {
    word |= static_cast<uint64_t>(TableValue(low, high, first + i) + bias) << (8 * i);
  }
  return word;
}
constexpr uint64_t AbsWord(uint64_t low, uint64_t high, int first) {
  uint64_t word = 0;
  for (int i = 0; i < 8; ++i) {
    const int v = TableValue(low, high, first + i);
    word |= static_cast<uint64_t>(v < 0 ? -v : v) << (8 * i);
  }
  return word;
}
template <typename Block>
constexpr bool SignsFollowBit3() {
  using T = PairTable<Block>;
  for (int i = 0; i < 16; ++i) {
    const int v = TableValue(T::kLow, T::kHigh, i);
    if (v != 0 && (v < 0) != (T::kNegativeWithBit3 == (i >= 8))) return false;
  }
  return true;
}
static_assert(SignsFollowBit3<block_mxfp4>() && SignsFollowBit3<block_iq4_nl>());
// Biased values fit a byte, and a pair's vpdpbusd cannot overflow int32.
static_assert(PairTable<block_mxfp4>::kBias == 12 && PairTable<block_iq4_nl>::kBias == 127);
static_assert(113 + PairTable<block_iq4_nl>::kBias <= 255);

// An activation row's blocks 2p and 2p + 1 as the weights unpack: the low
// halves (elements 0-15) of both, then the high halves (16-31); so each
// 128-bit lane meets its weights' nibbles without a shuffle.
HWY_INLINE __m512i ActPair(const block_q8_0* y, int64_t p) {
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[2 * p].qs))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[2 * p + 1].qs)), 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

// One ActPair (or its VNNI correction), cache-line aligned (a vector of
// __m512i would drop the alignment: GCC ignores a template argument's
// attributes).
struct alignas(64) ActPairBytes {
  uint8_t bytes[64];
};

#if HWY_TARGET == HWY_AVX3_DL
// A pair's int32 lanes of -bias times the sums of 4 of its activations.
HWY_INLINE __m512i PairCorrection(__m512i pair, int bias) {
  const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), pair);
  return _mm512_mullo_epi32(sums, _mm512_set1_epi32(-bias));
}
#endif

// x: R weight rows; y: N activation rows, their pairs (ActPair) in act_pairs[n],
// the pairs' corrections (PairCorrection, AVX3_DL only) in act_corrections[n]
// and their block scales in act_scales[n].
template <int R, int N, typename Block>
void DotPairs512Tile(const Block* const* x, const block_q8_0* const* y,
                     const ActPairBytes* const* act_pairs,
                     const ActPairBytes* const* act_corrections, const float* const* act_scales,
                     int64_t nb, float* out) {
  using T = PairTable<Block>;
#if HWY_TARGET == HWY_AVX3_DL
  alignas(16) const uint64_t words[2] = {BiasedWord(T::kLow, T::kHigh, 0, T::kBias),
                                         BiasedWord(T::kLow, T::kHigh, 8, T::kBias)};
#else
  (void)act_corrections;
  alignas(16)
      const uint64_t words[2] = {AbsWord(T::kLow, T::kHigh, 0), AbsWord(T::kLow, T::kHigh, 8)};
  const __m512i bit3 = _mm512_set1_epi8(0x08);
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
#endif
  // Indexed by a nibble: its magnitude, or (VNNI) its value plus kBias.
  const __m512i table =
      _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(words)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // A pair's int32 lanes: b's 0-3, b + 1's 0-3, b's 4-7, b + 1's 4-7; its
  // scales from elements 0 (b) and 1 (b + 1) of a chunk's, + 2 a pair.
  const __m512i first_pair = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i two = _mm512_set1_epi32(2);
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  }
  int64_t b = 0;
  while (b + 1 < nb) {
    const int chunk = static_cast<int>(std::min<int64_t>(16, (nb - b) & ~int64_t{1}));
    const __mmask16 in_chunk = static_cast<__mmask16>((1u << chunk) - 1);
    __m512 scales[R][N];
    for (int r = 0; r < R; ++r) {
      const __m512 dx = BlockScales16(x[r] + b, in_chunk);
      for (int n = 0; n < N; ++n) {
        scales[r][n] = _mm512_mul_ps(dx, _mm512_maskz_loadu_ps(in_chunk, act_scales[n] + b));
      }
    }
    __m512i pair = first_pair;
    for (int k = 0; k < chunk; k += 2, b += 2, pair = _mm512_add_epi32(pair, two)) {
      __m512i a[N];
      for (int n = 0; n < N; ++n) a[n] = _mm512_load_si512(act_pairs[n][b / 2].bytes);
      for (int r = 0; r < R; ++r) {
        PrefetchAhead(x[r] + b);
        const __m256i q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[r][b].qs))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[r][b + 1].qs)), 1);
        // 128-bit lanes: b's low nibbles, b + 1's, b's high, b + 1's.
        const __m512i nibbles = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), low4);
        const __m512i looked_up = _mm512_shuffle_epi8(table, nibbles);
#if HWY_TARGET != HWY_AVX3_DL
        const __mmask64 negative = T::kNegativeWithBit3 ? _mm512_test_epi8_mask(nibbles, bit3)
                                                        : _mm512_testn_epi8_mask(nibbles, bit3);
#endif
        for (int n = 0; n < N; ++n) {
#if HWY_TARGET == HWY_AVX3_DL
          const __m512i dot = _mm512_dpbusd_epi32(
              _mm512_load_si512(act_corrections[n][b / 2].bytes), looked_up, a[n]);
#else
          const __m512i signed_a = _mm512_mask_sub_epi8(a[n], negative, zero, a[n]);
          const __m512i dot = _mm512_madd_epi16(_mm512_maddubs_epi16(looked_up, signed_a), ones);
#endif
          acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                      _mm512_permutexvar_ps(pair, scales[r][n]), acc[r][n]);
        }
      }
    }
  }
  // Back to ggml's accum1 (b even) and accum2 (b odd), 8 lanes each.
  const __m512i unpair = _mm512_set_epi32(15, 14, 13, 12, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
  const hn::CappedTag<float, 1> d1;
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      const __m512 halves = _mm512_permutexvar_ps(unpair, acc[r][n]);
      float sum = ReduceF32(
          hn::Add(VF32{_mm512_castps512_ps256(halves)}, VF32{_mm512_extractf32x8_ps(halves, 1)}));
      if (b < nb) {  // an odd last block, as DotBlock32Tile takes it
        const auto w = Weights(x[r][b]);
        const VI32 dot = DotI8(hn::BitCast(DU8(), hn::Abs(w)), w, hn::LoadU(DI8(), y[n][b].qs));
        const float sumi = static_cast<float>(hn::GetLane(hn::SumOfLanes(DI32(), dot)));
        sum = hn::GetLane(hn::MulAdd(hn::Set(d1, act_scales[n][b] * BlockScale(x[r][b])),
                                     hn::Set(d1, sumi), hn::Set(d1, sum)));
      }
      out[r * N + n] = sum;
    }
  }
}
#endif

// Each block adds d_w d_a dot(block) to an f32 vector, as ggml does: q4_0, q5_0
// in one accumulator; iq4_nl and mxfp4 alternate two (ggml's accum1, accum2)
// and take an odd last block apart, in one fused multiply-add on the total.
// q4_1 and q5_1 (Act block_q8_1) add the sum of m_w s_a after the lanes', in
// fused multiply-adds as ggml's build compiles it.
template <int N, typename Block, typename Act>
void DotBlock32Tile(const Block* x, const Act* const* y, int64_t nb, float* out) {
  constexpr bool kMin = std::is_same_v<Act, block_q8_1>;
  constexpr bool kPairs = std::is_same_v<Block, block_iq4_nl> || std::is_same_v<Block, block_mxfp4>;
  const hn::CappedTag<float, 1> d1;
  const auto ones = hn::Set(DI16(), 1);
  VF32 acc[2][N];
  hn::Vec<decltype(d1)> summs[N];
  for (int n = 0; n < N; ++n) {
    acc[0][n] = acc[1][n] = hn::Zero(DF32());
    summs[n] = hn::Zero(d1);
  }
  // dot[n] = block b's 8 lanes of 4 products with activation row n.
  const auto block = [&](int64_t b, VI32* dot) {
    PrefetchAhead(x + b);
    const auto w = Weights(x[b]);
    hn::Vec256<uint8_t> abs_w;
    if constexpr (kMin) {
      abs_w = w;
    } else {
      abs_w = hn::BitCast(DU8(), hn::Abs(w));
    }
    for (int n = 0; n < N; ++n) {
      const auto a = hn::LoadU(DI8(), y[n][b].qs);
      hn::Vec256<int16_t> pairs;
      if constexpr (kMin) {
        pairs = MulPairs(abs_w, a);
        summs[n] = hn::MulAdd(hn::Set(d1, F16(x[b].m)), hn::Set(d1, F16(y[n][b].s)), summs[n]);
      } else {
        pairs = MulPairs(abs_w, SignOf(a, w));
      }
      dot[n] = MulAddPairs(pairs, ones, hn::Zero(DI32()));
    }
  };
  const auto accumulate = [&](int64_t b, const VI32* dot, VF32* to) {
    const float dx = BlockScale(x[b]);
    for (int n = 0; n < N; ++n) {
      to[n] =
          hn::MulAdd(hn::ConvertTo(DF32(), dot[n]), hn::Set(DF32(), dx * F16(y[n][b].d)), to[n]);
    }
  };
  VI32 dot[N];
  int64_t b = 0;
  for (; b + (kPairs ? 1 : 0) < nb; b += kPairs ? 2 : 1) {
    block(b, dot);
    accumulate(b, dot, acc[0]);
    if constexpr (kPairs) {
      block(b + 1, dot);
      accumulate(b + 1, dot, acc[1]);
    }
  }
  for (int n = 0; n < N; ++n) {
    out[n] = ReduceF32(kPairs ? hn::Add(acc[0][n], acc[1][n]) : acc[0][n]);
    if constexpr (kMin) out[n] += hn::GetLane(summs[n]);
  }
  if (kPairs && b < nb) {
    block(b, dot);
    const float dx = BlockScale(x[b]);
    for (int n = 0; n < N; ++n) {
      const float sumi = static_cast<float>(hn::GetLane(hn::SumOfLanes(DI32(), dot[n])));
      out[n] = hn::GetLane(
          hn::MulAdd(hn::Set(d1, F16(y[n][b].d) * dx), hn::Set(d1, sumi), hn::Set(d1, out[n])));
    }
  }
}

// q4_K/q5_K's eight 6-bit scales and mins from their 12 bytes at once, as
// ggml's SIMD code unpacks them (get_scale_min_k4, four bytes at a time).
HWY_INLINE void UnpackScalesMinsK4(const uint8_t* packed, uint8_t* sc, uint8_t* mn) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kTop2 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t scales[2] = {u[0] & kLow6, (u[2] & kLow4) | (((u[0] >> 6) & kTop2) << 4)};
  const uint32_t mins[2] = {u[1] & kLow6, ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kTop2) << 4)};
  std::memcpy(sc, scales, 8);
  std::memcpy(mn, mins, 8);
}

// q4_K and q5_K (kFive), ggml's ggml_vec_dot_q4_K_q8_K and _q5_K_q8_K (AVX2):
// chunk c's 32 bytes hold elements [64c, 64c + 32) in their low nibbles
// (scale 2c) and [64c + 32, 64c + 64) in their high ones (scale 2c + 1). The
// mins meet the activations' bsums summed in pairs (min j, 32 elements), in 4
// lanes; q4_K accumulates them in 4 f32 lanes, q5_K their total in one fused
// multiply-add per block, and both add that to the lanes' sum at the end.
template <bool kFive, int R, int N, typename Block>
void DotK45Tile(const Block* const* x, const block_q8_K* const* y, int64_t nb, float* out) {
  const hn::Full128<int16_t> d16x8;
  const hn::Full128<int32_t> d32x4;
  const hn::Full128<float> df4;
  const auto mask = hn::Set(DU8(), uint8_t{0x0F});
  const auto one = hn::Set(DU8(), uint8_t{1});
  VF32 acc[R][N];
  hn::Vec128<float> acc_min[R][N];  // q5_K: lane 0
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      acc[r][n] = hn::Zero(DF32());
      acc_min[r][n] = hn::Zero(df4);
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t sc[R][8];
    hn::Vec128<int16_t> mins8[R];
    VI32 sumi[R][N];
    for (int r = 0; r < R; ++r) {
      PrefetchAhead(x[r] + b);
      uint8_t mn[8];
      UnpackScalesMinsK4(x[r][b].scales, sc[r], mn);
      mins8[r] = hn::PromoteTo(d16x8, hn::LoadU(hn::Full64<uint8_t>(), mn));
      for (int n = 0; n < N; ++n) sumi[r][n] = hn::Zero(DI32());
    }
    for (int c = 0; c < 4; ++c) {
      hn::Vec256<uint8_t> lo[R], hi[R];
      hn::Vec256<int16_t> scale_lo[R], scale_hi[R];
      for (int r = 0; r < R; ++r) {
        const auto q = hn::LoadU(DU8(), x[r][b].qs + 32 * c);
        lo[r] = hn::And(q, mask);
        hi[r] = hn::ShiftRight<4>(q);
        if constexpr (kFive) {
          const auto h = hn::LoadU(DU8(), x[r][b].qh);
          lo[r] = hn::Or(lo[r], hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(h, 2 * c), one)));
          hi[r] = hn::Or(hi[r], hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(h, 2 * c + 1), one)));
        }
        scale_lo[r] = hn::Set(DI16(), static_cast<int16_t>(sc[r][2 * c]));
        scale_hi[r] = hn::Set(DI16(), static_cast<int16_t>(sc[r][2 * c + 1]));
      }
      for (int n = 0; n < N; ++n) {
        const auto a_lo = hn::LoadU(DI8(), y[n][b].qs + 64 * c);
        const auto a_hi = hn::LoadU(DI8(), y[n][b].qs + 64 * c + 32);
        for (int r = 0; r < R; ++r) {
          sumi[r][n] = MulAddPairs(MulPairs(lo[r], a_lo), scale_lo[r], sumi[r][n]);
          sumi[r][n] = MulAddPairs(MulPairs(hi[r], a_hi), scale_hi[r], sumi[r][n]);
        }
      }
    }
    for (int n = 0; n < N; ++n) {
      // Each min's 32 elements: the bsums added in pairs, in int16 (vphaddw).
      const hn::Vec128<int16_t> pairs{_mm_hadd_epi16(hn::LoadU(d16x8, y[n][b].bsums).raw,
                                                     hn::LoadU(d16x8, y[n][b].bsums + 8).raw)};
      for (int r = 0; r < R; ++r) {
        hn::Vec128<int32_t> unused = hn::Zero(d32x4);
        const auto mins =
            hn::ReorderWidenMulAccumulate(d32x4, mins8[r], pairs, hn::Zero(d32x4), unused);
        const float d = F16(x[r][b].d), dmin = -y[n][b].d * F16(x[r][b].dmin);
        acc[r][n] = hn::MulAdd(hn::ConvertTo(DF32(), sumi[r][n]), hn::Set(DF32(), d * y[n][b].d),
                               acc[r][n]);
        if constexpr (kFive) {
          const float total = static_cast<float>(hn::GetLane(hn::SumOfLanes(d32x4, mins)));
          acc_min[r][n] = hn::MulAdd(hn::Set(df4, dmin), hn::Set(df4, total), acc_min[r][n]);
        } else {
          acc_min[r][n] = hn::MulAdd(hn::Set(df4, dmin), hn::ConvertTo(df4, mins), acc_min[r][n]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      const auto mins = kFive ? acc_min[r][n] : hn::SumOfLanes(df4, acc_min[r][n]);
      out[r * N + n] = ReduceF32(acc[r][n]) + hn::GetLane(mins);
    }
  }
}

// q6_K: per 128-element half, byte l of ql, ql + 32 and qh gives elements l,
// l + 32, l + 64 and l + 96 as unsigned 6-bit values; the bias of 32 comes off
// through the activations' bsums, 32 * sum(scale * bsum).
template <int N>
void DotQ6KTile(const block_q6_K* x, const block_q8_K* const* y, int64_t nb, float* out) {
  const hn::Full128<int16_t> d16x8;
  const auto mask = hn::Set(DU8(), uint8_t{0x0F});
  const auto three = hn::Set(DU8(), uint8_t{3});
  VF32 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = hn::Zero(DF32());
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(x + b);
    alignas(32) int16_t scales[16];
    for (int j = 0; j < 16; ++j) scales[j] = x[b].scales[j];
    const auto scales16 = hn::Load(DI16(), scales);
    VI32 sumi[N];
    for (int n = 0; n < N; ++n) sumi[n] = hn::Zero(DI32());
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x[b].ql + 64 * half;
      const auto l0 = hn::LoadU(DU8(), ql);
      const auto l1 = hn::LoadU(DU8(), ql + 32);
      const auto h = hn::LoadU(DU8(), x[b].qh + 32 * half);
      const hn::Vec256<uint8_t> w[4] = {
          hn::Or(hn::And(l0, mask), hn::ShiftLeft<4>(hn::And(h, three))),
          hn::Or(hn::And(l1, mask), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<2>(h), three))),
          hn::Or(hn::ShiftRight<4>(l0), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<4>(h), three))),
          hn::Or(hn::ShiftRight<4>(l1), hn::ShiftLeft<4>(hn::ShiftRight<6>(h)))};
      hn::Vec256<int16_t> scale[4];  // 16 elements (8 pairs) per scale
      for (int k = 0; k < 4; ++k) {
        const int8_t* s = x[b].scales + 8 * half + 2 * k;
        scale[k] =
            hn::Combine(DI16(), hn::Set(d16x8, int16_t{s[1]}), hn::Set(d16x8, int16_t{s[0]}));
      }
      for (int n = 0; n < N; ++n) {
        const int8_t* a = y[n][b].qs + 128 * half;
        for (int k = 0; k < 4; ++k) {
          sumi[n] = MulAddPairs(MulPairs(w[k], hn::LoadU(DI8(), a + 32 * k)), scale[k], sumi[n]);
        }
      }
    }
    const float d = F16(x[b].d);
    for (int n = 0; n < N; ++n) {
      const VI32 bias = MulAddPairs(hn::LoadU(DI16(), y[n][b].bsums), scales16, hn::Zero(DI32()));
      const VI32 s = hn::Sub(sumi[n], hn::ShiftLeft<5>(bias));
      acc[n] = hn::MulAdd(hn::ConvertTo(DF32(), s), hn::Set(DF32(), d * y[n][b].d), acc[n]);
    }
  }
  for (int n = 0; n < N; ++n) out[n] = ReduceF32(acc[n]);
}

// q2_K and q3_K's int16 scales, one per 16 elements: for 128-element chunk j,
// run s (bytes 32s .. 32s + 31 of its activations) takes scale 8j + 2s in its
// low 16 bytes and 8j + 2s + 1 in its high ones (ggml's get_scale_shuffle_q3k
// over the chunk's 8 scales in both 128-bit halves).
HWY_INLINE void RunScales(hn::Vec256<int16_t> scales16, hn::Vec256<int16_t> (&out)[2][4]) {
  alignas(32) static constexpr uint8_t kPairs[32] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0,
                                                     1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3,
                                                     2, 3, 2, 3, 2, 3, 2, 3, 2, 3};
  const hn::Vec256<int16_t> chunk[2] = {hn::ConcatLowerLower(DI16(), scales16, scales16),
                                        hn::ConcatUpperUpper(DI16(), scales16, scales16)};
  for (int s = 0; s < 4; ++s) {
    const auto index =
        hn::Add(hn::Load(DU8(), kPairs), hn::Set(DU8(), static_cast<uint8_t>(4 * s)));
    for (int j = 0; j < 2; ++j)
      out[j][s] = hn::BitCast(DI16(), hn::TableLookupBytes(chunk[j], index));
  }
}

// q2_K, ggml's ggml_vec_dot_q2_K_q8_K (AVX2): byte l of chunk j's 32 holds
// elements 128j + 32s + l (s = 0..3) at bits 2s; per 16 elements a 4-bit
// scale (low nibble) and min (high), the mins met by the bsums, and their
// term accumulated before the scales'.
template <int N>
void DotQ2KTile(const block_q2_K* x, const block_q8_K* const* y, int64_t nb, float* out) {
  const hn::Full128<uint8_t> d8;
  const auto three = hn::Set(DU8(), uint8_t{3});
  VF32 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = hn::Zero(DF32());
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(x + b);
    const auto packed = hn::LoadU(d8, x[b].scales);
    const auto mins16 = hn::PromoteTo(DI16(), hn::ShiftRight<4>(packed));
    hn::Vec256<int16_t> scale[2][4];
    RunScales(hn::PromoteTo(DI16(), hn::And(packed, hn::Set(d8, uint8_t{0x0F}))), scale);
    VI32 sumi[N];
    for (int n = 0; n < N; ++n) sumi[n] = hn::Zero(DI32());
    for (int j = 0; j < 2; ++j) {
      const auto q = hn::LoadU(DU8(), x[b].qs + 32 * j);
      const hn::Vec256<uint8_t> w[4] = {hn::And(q, three), hn::And(hn::ShiftRight<2>(q), three),
                                        hn::And(hn::ShiftRight<4>(q), three), hn::ShiftRight<6>(q)};
      for (int n = 0; n < N; ++n) {
        const int8_t* a = y[n][b].qs + 128 * j;
        for (int s = 0; s < 4; ++s) {
          sumi[n] = MulAddPairs(MulPairs(w[s], hn::LoadU(DI8(), a + 32 * s)), scale[j][s], sumi[n]);
        }
      }
    }
    const float d = F16(x[b].d), dmin = F16(x[b].dmin);
    for (int n = 0; n < N; ++n) {
      const VI32 mins = MulAddPairs(mins16, hn::LoadU(DI16(), y[n][b].bsums), hn::Zero(DI32()));
      acc[n] = hn::MulAdd(hn::Set(DF32(), -y[n][b].d * dmin), hn::ConvertTo(DF32(), mins), acc[n]);
      acc[n] = hn::MulAdd(hn::Set(DF32(), y[n][b].d * d), hn::ConvertTo(DF32(), sumi[n]), acc[n]);
    }
  }
  for (int n = 0; n < N; ++n) out[n] = ReduceF32(acc[n]);
}

// q3_K, ggml's ggml_vec_dot_q3_K_q8_K (AVX2): q2_K's layout for the low two
// bits, hmask's bit 4j + s of byte l the third (set: +0, clear: -4, taken off
// as a second product), signed 6-bit scales.
template <int N>
void DotQ3KTile(const block_q3_K* x, const block_q8_K* const* y, int64_t nb, float* out) {
  constexpr uint32_t kLow4 = 0x0f0f0f0f, kTop2 = 0x03030303;
  const hn::Full128<uint8_t> d8;
  const auto three = hn::Set(DU8(), uint8_t{3});
  const auto four = hn::Set(DU8(), uint8_t{4});
  VF32 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = hn::Zero(DF32());
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(x + b);
    uint32_t u[3];
    std::memcpy(u, x[b].scales, 12);
    const uint32_t packed[4] = {(u[0] & kLow4) | ((u[2] & kTop2) << 4),
                                (u[1] & kLow4) | (((u[2] >> 2) & kTop2) << 4),
                                ((u[0] >> 4) & kLow4) | (((u[2] >> 4) & kTop2) << 4),
                                ((u[1] >> 4) & kLow4) | (((u[2] >> 6) & kTop2) << 4)};
    const auto scales8 =
        hn::Sub(hn::LoadU(d8, reinterpret_cast<const uint8_t*>(packed)), hn::Set(d8, uint8_t{32}));
    hn::Vec256<int16_t> scale[2][4];
    RunScales(hn::PromoteTo(DI16(), hn::BitCast(hn::Full128<int8_t>(), scales8)), scale);
    const auto hbits = hn::LoadU(DU8(), x[b].hmask);
    VI32 sumi[N];
    for (int n = 0; n < N; ++n) sumi[n] = hn::Zero(DI32());
    for (int j = 0; j < 2; ++j) {
      const auto q = hn::LoadU(DU8(), x[b].qs + 32 * j);
      const hn::Vec256<uint8_t> low[4] = {hn::And(q, three), hn::And(hn::ShiftRight<2>(q), three),
                                          hn::And(hn::ShiftRight<4>(q), three),
                                          hn::ShiftRight<6>(q)};
      hn::Vec256<uint8_t> high[4];
      for (int s = 0; s < 4; ++s) {
        const auto bit = hn::Set(DU8(), static_cast<uint8_t>(1u << (4 * j + s)));
        high[s] = hn::IfThenZeroElse(hn::TestBit(hbits, bit), four);
      }
      for (int n = 0; n < N; ++n) {
        const int8_t* a = y[n][b].qs + 128 * j;
        for (int s = 0; s < 4; ++s) {
          const auto act = hn::LoadU(DI8(), a + 32 * s);
          const auto p = hn::Sub(MulPairs(low[s], act), MulPairs(high[s], act));
          sumi[n] = MulAddPairs(p, scale[j][s], sumi[n]);
        }
      }
    }
    const float d = F16(x[b].d);
    for (int n = 0; n < N; ++n) {
      acc[n] = hn::MulAdd(hn::Set(DF32(), y[n][b].d * d), hn::ConvertTo(DF32(), sumi[n]), acc[n]);
    }
  }
  for (int n = 0; n < N; ++n) out[n] = ReduceF32(acc[n]);
}

// iq4_xs, ggml's ggml_vec_dot_iq4_xs_q8_K (AVX2): iq4_nl's table per 32, with
// signed 6-bit sub-block scales in the int16 multiply-add and one f16 scale
// per 256.
template <int N>
void DotIq4XsTile(const block_iq4_xs* x, const block_q8_K* const* y, int64_t nb, float* out) {
  VF32 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = hn::Zero(DF32());
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(x + b);
    VI32 sumi[N];
    for (int n = 0; n < N; ++n) sumi[n] = hn::Zero(DI32());
    for (int ib = 0; ib < QK_K / 32; ++ib) {
      const auto w = Lookup(Nibbles(x[b].qs + 16 * ib), kIq4nlLow, kIq4nlHigh);
      const auto abs_w = hn::BitCast(DU8(), hn::Abs(w));
      const auto scale = hn::Set(DI16(), static_cast<int16_t>(iq4_xs_scale(&x[b], ib)));
      for (int n = 0; n < N; ++n) {
        const auto a = hn::LoadU(DI8(), y[n][b].qs + 32 * ib);
        sumi[n] = MulAddPairs(MulPairs(abs_w, SignOf(a, w)), scale, sumi[n]);
      }
    }
    const float d = F16(x[b].d);
    for (int n = 0; n < N; ++n) {
      acc[n] = hn::MulAdd(hn::Set(DF32(), d * y[n][b].d), hn::ConvertTo(DF32(), sumi[n]), acc[n]);
    }
  }
  for (int n = 0; n < N; ++n) out[n] = ReduceF32(acc[n]);
}

template <int R, int N>
void DotTile(GgmlType type, const uint8_t* const* w, const uint8_t* const* act, int64_t cols,
             float* out);
#endif  // MOEGRAPH_X86_TILES

float DotRow(GgmlType type, const uint8_t* w, const uint8_t* act, int64_t cols) {
  switch (type) {
    case GgmlType::kF16:
      return DotF16(reinterpret_cast<const float*>(act), reinterpret_cast<const uint16_t*>(w),
                    cols);
    case GgmlType::kBF16:
      return DotBF16(reinterpret_cast<const float*>(act), reinterpret_cast<const uint16_t*>(w),
                     cols);
    case GgmlType::kF32:
      return DotF32(reinterpret_cast<const float*>(act), reinterpret_cast<const float*>(w), cols);
#ifndef MOEGRAPH_X86_TILES
    // The types issue 21 added have x86 kernels only; here ggml's generic C
    // order (cpu/act_quant.h).
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kIQ4_XS:
    case GgmlType::kIQ4_NL:
    case GgmlType::kMXFP4:
      return dot_row_ref(type, w, act, cols);
#endif
    default:
      break;
  }
#ifndef MOEGRAPH_X86_TILES
  switch (type) {
    case GgmlType::kQ8_0:
      return DotQ8_0(reinterpret_cast<const block_q8_0*>(w),
                     reinterpret_cast<const block_q8_0*>(act), cols / QK8_0);
    case GgmlType::kQ4_0:
      return DotQ4_0(reinterpret_cast<const block_q4_0*>(w),
                     reinterpret_cast<const block_q8_0*>(act), cols / QK4_0);
    case GgmlType::kQ4_K:
      return DotK45<false>(reinterpret_cast<const block_q4_K*>(w),
                           reinterpret_cast<const block_q8_K*>(act), cols / QK_K);
    case GgmlType::kQ5_K:
      return DotK45<true>(reinterpret_cast<const block_q5_K*>(w),
                          reinterpret_cast<const block_q8_K*>(act), cols / QK_K);
    default:
      return DotQ6K(reinterpret_cast<const block_q6_K*>(w),
                    reinterpret_cast<const block_q8_K*>(act), cols / QK_K);
  }
#else
  float out = 0.0f;
  DotTile<1, 1>(type, &w, &act, cols, &out);
  return out;
#endif
}

#ifdef MOEGRAPH_X86_TILES
// A kernel that tiles the activation rows only, on each of R weight rows.
template <int R, int N, typename Block, typename Act>
void EachRow(void (*kernel)(const Block*, const Act* const*, int64_t, float*),
             const uint8_t* const* w, const uint8_t* const* act, int64_t nb, float* out) {
  for (int r = 0; r < R; ++r) {
    kernel(reinterpret_cast<const Block*>(w[r]), reinterpret_cast<const Act* const*>(act), nb,
           out + r * N);
  }
}

// R weight rows with N activation rows, out[r * N + n]; each result is what
// R = N = 1 gives. q8_0, q4_K and q5_K tile both; the others the activation
// rows only.
template <int R, int N>
void DotTile(GgmlType type, const uint8_t* const* w, const uint8_t* const* act, int64_t cols,
             float* out) {
  const auto* y0 = reinterpret_cast<const block_q8_0* const*>(act);
  const auto* yk = reinterpret_cast<const block_q8_K* const*>(act);
  const int64_t nb32 = cols / QK8_0, nb256 = cols / QK_K;
  switch (type) {
    case GgmlType::kQ8_0:
      return DotQ8_0Tile<R, N>(reinterpret_cast<const block_q8_0* const*>(w), y0, nb32, out);
    case GgmlType::kQ4_K:
      return DotK45Tile<false, R, N>(reinterpret_cast<const block_q4_K* const*>(w), yk, nb256, out);
    case GgmlType::kQ5_K:
      return DotK45Tile<true, R, N>(reinterpret_cast<const block_q5_K* const*>(w), yk, nb256, out);
    case GgmlType::kQ4_0:
      return EachRow<R, N>(&DotBlock32Tile<N, block_q4_0, block_q8_0>, w, act, nb32, out);
    case GgmlType::kQ5_0:
      return EachRow<R, N>(&DotBlock32Tile<N, block_q5_0, block_q8_0>, w, act, nb32, out);
    case GgmlType::kIQ4_NL:
      return EachRow<R, N>(&DotBlock32Tile<N, block_iq4_nl, block_q8_0>, w, act, nb32, out);
    case GgmlType::kMXFP4:
      return EachRow<R, N>(&DotBlock32Tile<N, block_mxfp4, block_q8_0>, w, act, nb32, out);
    case GgmlType::kQ4_1:
      return EachRow<R, N>(&DotBlock32Tile<N, block_q4_1, block_q8_1>, w, act, nb32, out);
    case GgmlType::kQ5_1:
      return EachRow<R, N>(&DotBlock32Tile<N, block_q5_1, block_q8_1>, w, act, nb32, out);
    case GgmlType::kQ2_K:
      return EachRow<R, N>(&DotQ2KTile<N>, w, act, nb256, out);
    case GgmlType::kQ3_K:
      return EachRow<R, N>(&DotQ3KTile<N>, w, act, nb256, out);
    case GgmlType::kIQ4_XS:
      return EachRow<R, N>(&DotIq4XsTile<N>, w, act, nb256, out);
    case GgmlType::kQ6_K:
      return EachRow<R, N>(&DotQ6KTile<N>, w, act, nb256, out);
    default:
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < N; ++n) out[r * N + n] = DotRow(type, w[r], act[n], cols);
      }
  }
}
#else
template <int R, int N>
void DotTile(GgmlType type, const uint8_t* const* w, const uint8_t* const* act, int64_t cols,
             float* out) {
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) out[r * N + n] = DotRow(type, w[r], act[n], cols);
  }
}
#endif

// A batch's weight rows go 2 at a time, each pair over its activation rows 4
// at a time, so a tile unpacks each weight block once and loads each
// activation block once. A single activation row (decode) meets one weight row
// at a time (iq4_nl and mxfp4 on AVX-512 aside, kPairDecodeRows): measured,
// tiles of 2 or 4 rows halve decode's rate on rows of 1024 columns (BM_Dot;
// the cause is not known).
constexpr int kBatchRows = 2, kBatchActs = 4;

template <int R, int N>
void Tile(const MatMulArgs& m, int64_t r, int64_t t) {
  const uint8_t* w[R];
  const uint8_t* act[N];
  float out[R * N];
  for (int i = 0; i < R; ++i) w[i] = m.w + static_cast<size_t>(r + i) * m.w_row_bytes;
  for (int n = 0; n < N; ++n) act[n] = m.act + static_cast<size_t>(t + n) * m.act_row_bytes;
  DotTile<R, N>(m.type, w, act, m.cols, out);
  for (int i = 0; i < R; ++i) {
    for (int n = 0; n < N; ++n) m.out[(t + n) * m.out_stride + r + i] = out[i * N + n];
  }
}

template <int R>
void RowsTimesActs(const MatMulArgs& m, int64_t r) {
  int64_t t = 0;
  for (; t + kBatchActs <= m.n_act; t += kBatchActs) Tile<R, kBatchActs>(m, r, t);
  for (; t < m.n_act; ++t) Tile<R, 1>(m, r, t);
}

#ifdef MOEGRAPH_AVX512
// iq4_nl and mxfp4 on AVX-512 (DotPairs512Tile), in Tile's shapes, each
// activation row's pairs and block scales made once for all the rows.
struct PairActs {
  std::vector<ActPairBytes> pairs;        // n_act rows of nb / 2
  std::vector<ActPairBytes> corrections;  // the pairs' PairCorrection (AVX3_DL)
  std::vector<float> scales;              // n_act rows of nb
  int64_t nb = 0;
};

template <typename Block, int R, int N>
void PairTile(const MatMulArgs& m, const PairActs& acts, int64_t r, int64_t t) {
  const Block* x[R];
  const block_q8_0* y[N];
  const ActPairBytes* pairs[N];
  const ActPairBytes* corrections[N];
  const float* scales[N];
  float out[R * N];
  for (int i = 0; i < R; ++i) {
    x[i] = reinterpret_cast<const Block*>(m.w + static_cast<size_t>(r + i) * m.w_row_bytes);
  }
  for (int n = 0; n < N; ++n) {
    y[n] =
        reinterpret_cast<const block_q8_0*>(m.act + static_cast<size_t>(t + n) * m.act_row_bytes);
    pairs[n] = acts.pairs.data() + (t + n) * (acts.nb / 2);
    corrections[n] = acts.corrections.data() + (t + n) * (acts.nb / 2);
    scales[n] = acts.scales.data() + (t + n) * acts.nb;
  }
  DotPairs512Tile<R, N>(x, y, pairs, corrections, scales, acts.nb, out);
  for (int i = 0; i < R; ++i) {
    for (int n = 0; n < N; ++n) m.out[(t + n) * m.out_stride + r + i] = out[i * N + n];
  }
}

// Decode takes 2 weight rows at a time (two multiply-add chains in flight):
// on BM_Dot (16 MiB of mxfp4, one activation row) 1.2-1.3x one row; 4 rows
// measured slower than 1.
constexpr int kPairDecodeRows = 2;

template <typename Block>
void PairMatMulRows(const MatMulArgs& m) {
  thread_local PairActs acts;
  acts.nb = m.cols / QK8_0;
  const int64_t n_pairs = acts.nb / 2;
  acts.pairs.resize(static_cast<size_t>(m.n_act * n_pairs));
#if HWY_TARGET == HWY_AVX3_DL
  acts.corrections.resize(acts.pairs.size());
#endif
  acts.scales.resize(static_cast<size_t>(m.n_act * acts.nb));
  for (int64_t t = 0; t < m.n_act; ++t) {
    const auto* y = reinterpret_cast<const block_q8_0*>(m.act + t * m.act_row_bytes);
    for (int64_t p = 0; p < n_pairs; ++p) {
      const __m512i pair = ActPair(y, p);
      _mm512_store_si512(acts.pairs[t * n_pairs + p].bytes, pair);
#if HWY_TARGET == HWY_AVX3_DL
      _mm512_store_si512(acts.corrections[t * n_pairs + p].bytes,
                         PairCorrection(pair, PairTable<Block>::kBias));
#endif
    }
    for (int64_t b = 0; b < acts.nb; ++b) acts.scales[t * acts.nb + b] = F16(y[b].d);
  }
  const auto rows_times_acts = [&](auto rows, int64_t r) {
    constexpr int R = decltype(rows)::value;
    int64_t t = 0;
    for (; t + kBatchActs <= m.n_act; t += kBatchActs)
      PairTile<Block, R, kBatchActs>(m, acts, r, t);
    for (; t < m.n_act; ++t) PairTile<Block, R, 1>(m, acts, r, t);
  };
  int64_t r = m.row_begin;
  if (m.n_act > 1) {
    for (; r + kBatchRows <= m.row_end; r += kBatchRows) {
      rows_times_acts(std::integral_constant<int, kBatchRows>(), r);
    }
  } else {
    for (; r + kPairDecodeRows <= m.row_end; r += kPairDecodeRows) {
      PairTile<Block, kPairDecodeRows, 1>(m, acts, r, 0);
    }
  }
  for (; r < m.row_end; ++r) rows_times_acts(std::integral_constant<int, 1>(), r);
}
#endif

void MatMulRows(const MatMulArgs& m) {
#ifdef MOEGRAPH_AVX512
  if (m.type == GgmlType::kMXFP4) return PairMatMulRows<block_mxfp4>(m);
  if (m.type == GgmlType::kIQ4_NL) return PairMatMulRows<block_iq4_nl>(m);
#endif
  int64_t r = m.row_begin;
  if (m.n_act > 1) {
    for (; r + kBatchRows <= m.row_end; r += kBatchRows) RowsTimesActs<kBatchRows>(m, r);
  }
  for (; r < m.row_end; ++r) RowsTimesActs<1>(m, r);
}

// ---- activation rows quantized (cpu/act_quant.h's quantize_act_row, vectorized) ----

// std::round: to nearest, ties away from zero (exact for |v| < 2^23: v - t and
// t + 1 are).
template <class D>
HWY_INLINE hn::Vec<D> RoundHalfAway(D d, hn::Vec<D> v) {
  const auto t = hn::Trunc(v);
  const auto step = hn::CopySign(hn::Set(d, 1.0f), v);
  return hn::IfThenElse(hn::Ge(hn::Abs(hn::Sub(v, t)), hn::Set(d, 0.5f)), hn::Add(t, step), t);
}

// The largest magnitude among x[0..count), count a multiple of the lanes.
template <class D>
HWY_INLINE float MaxAbs(D df, const float* x, int64_t count) {
  auto vmax = hn::Zero(df);
  for (int64_t i = 0; i < count; i += static_cast<int64_t>(hn::Lanes(df))) {
    vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, x + i)));
  }
  return hn::GetLane(hn::MaxOfLanes(df, vmax));
}

// quantize_row_q8_0_ref: amax, d = amax / 127, qs = round(x / d) (times 1 / d).
void QuantizeQ8_0(const float* x, int64_t cols, block_q8_0* y) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t b = 0; b < cols / QK8_0; ++b, x += QK8_0) {
    const float d = MaxAbs(df, x, QK8_0) / 127.0f;
    const auto id = hn::Set(df, d != 0.0f ? 1.0f / d : 0.0f);
    for (int64_t i = 0; i < QK8_0; i += n) {
      const auto q = hn::ConvertTo(di, RoundHalfAway(df, hn::Mul(hn::LoadU(df, x + i), id)));
      hn::StoreU(hn::DemoteTo(d8, q), d8, y[b].qs + i);
    }
    y[b].d = f32_to_f16(d);
  }
}

// quantize_row_q8_K_ref: the first element of the largest magnitude sets the
// scale -127 / max; quants to nearest (ties to even, nearest_int), at most
// 127; bsums the sums of 16.
void QuantizeQ8_K(const float* x, int64_t cols, block_q8_K* y) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t b = 0; b < cols / QK_K; ++b, x += QK_K) {
    const float amax = MaxAbs(df, x, QK_K);
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    // The first element of the largest magnitude (ggml's quantize_row_q8_K);
    // bounded, as a NaN equals nothing.
    int64_t first = 0;
    while (first + 1 < QK_K && std::fabs(x[first]) != amax) ++first;
    const float iscale = -127.0f / x[first];
    const auto vscale = hn::Set(df, iscale);
    const auto top = hn::Set(di, 127);
    for (int64_t g = 0; g < QK_K; g += 16) {
      auto sum = hn::Zero(di);
      for (int64_t i = g; i < g + 16; i += n) {
        const auto q = hn::Min(hn::ConvertTo(di, hn::Round(hn::Mul(vscale, hn::LoadU(df, x + i)))),
                               top);
        hn::StoreU(hn::DemoteTo(d8, q), d8, y[b].qs + i);
        sum = hn::Add(sum, q);
      }
      y[b].bsums[g / 16] = static_cast<int16_t>(hn::GetLane(hn::SumOfLanes(di, sum)));
    }
    y[b].d = 1.0f / iscale;
  }
}

void QuantizeActRow(ActType type, const float* x, int64_t cols, uint8_t* dst) {
  if (type == ActType::kQ8_0) return QuantizeQ8_0(x, cols, reinterpret_cast<block_q8_0*>(dst));
  if (type == ActType::kQ8_K) return QuantizeQ8_K(x, cols, reinterpret_cast<block_q8_K*>(dst));
  quantize_act_row(type, x, cols, dst);
}

}  // namespace HWY_NAMESPACE
}  // namespace moegraph
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegraph {

HWY_EXPORT(MatMulRows);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotF16);
HWY_EXPORT(AxpyF32);
HWY_EXPORT(AxpyF16);
HWY_EXPORT(AttendHeads);
HWY_EXPORT(DeltaRuleStep);
HWY_EXPORT(QuantizeActRow);

void SimdMatMulRows(const MatMulArgs& args) { HWY_DYNAMIC_DISPATCH(MatMulRows)(args); }
void SimdQuantizeActRow(ActType type, const float* x, int64_t cols, uint8_t* dst) {
  HWY_DYNAMIC_DISPATCH(QuantizeActRow)(type, x, cols, dst);
}
float SimdDotF32(const float* a, const float* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF32)(a, b, n);
}
float SimdDotF16(const float* a, const uint16_t* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF16)(a, b, n);
}
void SimdAxpyF32(float alpha, const float* x, float* y, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AxpyF32)(alpha, x, y, n);
}
void SimdAxpyF16(float alpha, const uint16_t* x, float* y, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AxpyF16)(alpha, x, y, n);
}

void SimdDeltaRuleStep(int head_dim, const float* q, const float* k, const float* v, float decay,
                       float beta, float scale, float* m, float* o) {
  HWY_DYNAMIC_DISPATCH(DeltaRuleStep)(head_dim, q, k, v, decay, beta, scale, m, o);
}

void SimdAttendHeads(const float* q, int heads, const uint8_t* k, const uint8_t* v, size_t stride,
                     bool f16, int64_t first, int64_t n, int64_t rows, int head_dim, float scale,
                     const float* sinks, float* scores, float* out) {
  HWY_DYNAMIC_DISPATCH(AttendHeads)
  (q, heads, k, v, stride, f16, first, n, rows, head_dim, scale, sinks, scores, out);
}

// The target SimdForceTarget last forced (0: none).
int64_t forced_target = 0;

std::vector<int64_t> SimdTargets() {
  // Highway's list shrinks to the forced target: lift the force to read the
  // CPU's own, then put it back.
  hwy::SetSupportedTargetsForTest(0);
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  hwy::SetSupportedTargetsForTest(forced_target);
  return targets;
}

std::string SimdTargetName(int64_t target) { return hwy::TargetName(target); }

std::string SimdTargetName() {
  // The best target left after SimdForceTarget: the lowest set bit of the mask.
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

std::string SimdTargetLabel() {
  // Highway's names: AVX3 is AVX-512 (F, VL, DQ, BW); its suffixes are CPU generations.
  const std::string name = SimdTargetName();
  if (name == "AVX3") return "AVX-512";
  if (name == "AVX3_DL") return "AVX-512 (VNNI, Ice Lake)";
  if (name == "AVX3_ZEN4") return "AVX-512 (Zen 4)";
  if (name == "AVX3_SPR") return "AVX-512 (FP16, Sapphire Rapids)";
  if (name == "EMU128" || name == "SCALAR") return "portable (no SIMD target)";
  return name;
}

void SimdForceTarget(int64_t target) {
  forced_target = target;
  hwy::SetSupportedTargetsForTest(target);
}

}  // namespace moegraph
#endif  // HWY_ONCE
