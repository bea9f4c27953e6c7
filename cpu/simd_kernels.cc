// Highway compiles this file once per target (foreach_target.h re-includes it);
// the functions in HWY_NAMESPACE are that target's, the ones after HWY_ONCE
// dispatch to the best target the CPU supports.
//
// The integer dot products widen int8 to int16 and multiply-add pairs into
// int32 (ReorderWidenMulAccumulate: pmaddwd on x86). A K-quant's group scale
// multiplies the int16 products inside that multiply-add, as ggml's AVX2 code
// does, so one int32 accumulator serves a whole super-block; the block scales
// (and the q8_0 scales) multiply the int32 sums in f32.
// Every target the CPU may have (AVX-512, AVX2) and the portable one (EMU128,
// or SCALAR where the compiler is too old for EMU128: GCC before 12.3), which
// the tests run too; SSSE3 and SSE4 would only add compile time.
#ifndef HWY_COMPILE_ALL_ATTAINABLE
#define HWY_COMPILE_ALL_ATTAINABLE
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_kernels.cc"
#include "cpu/simd_kernels.h"

#include "cpu/act_quant.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "loader/quant.h"

HWY_BEFORE_NAMESPACE();
namespace moegraph {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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

float DotRow(GgmlType type, const uint8_t* w, const uint8_t* act, int64_t cols) {
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
    case GgmlType::kQ6_K:
      return DotQ6K(reinterpret_cast<const block_q6_K*>(w),
                    reinterpret_cast<const block_q8_K*>(act), cols / QK_K);
    case GgmlType::kF16:
      return DotF16(reinterpret_cast<const float*>(act), reinterpret_cast<const uint16_t*>(w),
                    cols);
    case GgmlType::kBF16:
      return DotBF16(reinterpret_cast<const float*>(act), reinterpret_cast<const uint16_t*>(w),
                     cols);
    default:
      return DotF32(reinterpret_cast<const float*>(act), reinterpret_cast<const float*>(w), cols);
  }
}

void MatMulRows(const MatMulArgs& m) {
  for (int64_t r = m.row_begin; r < m.row_end; ++r) {
    const uint8_t* w = m.w + static_cast<size_t>(r) * m.w_row_bytes;
    for (int64_t t = 0; t < m.n_act; ++t) {
      m.out[t * m.out_stride + r] =
          DotRow(m.type, w, m.act + static_cast<size_t>(t) * m.act_row_bytes, m.cols);
    }
  }
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

void SimdMatMulRows(const MatMulArgs& args) { HWY_DYNAMIC_DISPATCH(MatMulRows)(args); }
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

std::vector<int64_t> SimdTargets() { return hwy::SupportedAndGeneratedTargets(); }

std::string SimdTargetName(int64_t target) { return hwy::TargetName(target); }

std::string SimdTargetName() {
  // The best target left after SimdForceTarget: the lowest set bit of the mask.
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

void SimdForceTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }

}  // namespace moegraph
#endif  // HWY_ONCE
