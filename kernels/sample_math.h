// Token sampling, as llama.cpp's default chain orders it (top-k, top-p, min-p,
// temperature, then the draw), with a Philox-4x32-10 draw keyed by the seed and
// counted by the position whose logits are sampled. sample_token is the whole
// decision in one sequence, for the CPU backend, the oracle and the tests; the
// sampling kernel (kernels/tokens.cu) computes the same steps in parallel.
//
// Both compute the same bits, so the same logits and seed give the same token
// on either backend: the arithmetic is written out here (exp_nonpositive,
// kernels/fixed_math.h; every multiply-add that could be fused is an explicit fmaf),
// and every sum has a fixed shape: n tokens in kSampleRuns contiguous runs, each
// run summed in index order, the run sums added as a pairwise tree
// (sample_tree_sum), which the kernel's block does level by level. Light: .cu
// files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/fixed_math.h"
#include "kernels/moe_math.h"
#include "loader/host_device.h"
#include "loader/quant.h"

namespace moegraph {

// Sampling settings; the defaults are greedy decoding.
struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy (the argmax, ties to the lowest id, no draw)
  int32_t top_k = 0;         // <= 0: every token
  float top_p = 1.0f;        // >= 1: no nucleus cut
  float min_p = 0.0f;        // <= 0: no floor
  uint64_t seed = 0;
};

// The ranges the samplers accept: temperature >= 0 (finite), top_k >= 0,
// 0 < top_p <= 1, 0 <= min_p <= 1. Negated comparisons also reject NaN.
MG_HD inline bool sampling_params_valid(const SamplingParams& p) {
  return p.temperature >= 0.0f && p.temperature <= 3.4e38f && p.top_k >= 0 && p.top_p > 0.0f &&
         p.top_p <= 1.0f && p.min_p >= 0.0f && p.min_p <= 1.0f;
}

// Philox-4x32-10 (Salmon et al., SC11; Random123's philox4x32 with 10 rounds).
MG_HD inline void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t next0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t next2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = next0;
    c2 = next2;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// A uniform float in [0, 1) from the top 24 bits (every value exact in f32).
MG_HD inline float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// The draw for the logits of position `step`: counter {step, 0, 0, 0}, key =
// the seed's two 32-bit halves; a replay with the same seed draws the same value.
MG_HD inline float sample_uniform(uint64_t seed, int32_t step) {
  const uint32_t counter[4] = {static_cast<uint32_t>(step), 0u, 0u, 0u};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(counter, key, out);
  return uniform_from_bits(out[0]);
}

MG_HD inline bool sample_is_greedy(float temperature) { return !(temperature > 0.0f); }

// ---- the fixed shape of every sum ----

inline constexpr int32_t kSampleRuns = 1024;  // the kernel's block size

// Run r of n tokens: [*begin, *end), contiguous, in index order.
MG_HD inline void sample_run(int32_t n, int32_t r, int32_t* begin, int32_t* end) {
  const int32_t len = (n + kSampleRuns - 1) / kSampleRuns;
  const int64_t b = static_cast<int64_t>(r) * len;
  *begin = static_cast<int32_t>(b < n ? b : n);
  *end = static_cast<int32_t>(b + len < n ? b + len : n);
}

// The pairwise tree over sums[0..kSampleRuns): at stride s = 1, 2, 4, ...,
// sums[i] += sums[i + s] for i a multiple of 2s. Returns sums[0]; overwrites sums.
MG_HD inline float sample_tree_sum(float* sums) {
  for (int32_t stride = 1; stride < kSampleRuns; stride *= 2) {
    for (int32_t i = 0; i + stride < kSampleRuns; i += 2 * stride) sums[i] += sums[i + stride];
  }
  return sums[0];
}

// ---- the cuts ----

// A float's bits, mapped so that unsigned order is the floats' order.
MG_HD inline uint32_t sample_order_key(float f) {
  const uint32_t bits = f32_to_bits(f);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// What survives the cuts: logits whose key is at least min_key (top-k: the k-th
// largest logit's; ties at the boundary all survive), and whose weight
// e^(logit - max) is at least min_weight (the larger of top-p's threshold and
// min_p, both relative to the largest weight, 1) and positive. A NaN logit
// never survives.
struct SampleCut {
  float max_logit = 0.0f;
  uint32_t min_key = 0;
  float min_weight = 0.0f;
};

// The weight a token keeps through the cuts (temperature 1), 0 when cut.
MG_HD inline float sample_cut_weight(float logit, const SampleCut& cut) {
  if (!(logit == logit) || sample_order_key(logit) < cut.min_key) return 0.0f;
  const float w = exp_nonpositive(logit - cut.max_logit);
  return w >= cut.min_weight && w > 0.0f ? w : 0.0f;
}

// The weight a surviving token is drawn with: e^((logit - max) / T).
MG_HD inline float sample_draw_weight(float logit, const SampleCut& cut, float temperature) {
  return sample_cut_weight(logit, cut) > 0.0f ? exp_nonpositive((logit - cut.max_logit) / temperature)
                                              : 0.0f;
}

// Top-k finds the largest key t with count(key >= t) >= k by bisection over
// [lo, hi) of 2^32 keys: count(>= lo) >= k > count(>= hi), 32 halvings.
MG_HD inline void topk_step(uint64_t mid, int64_t count_at_mid, int32_t k, uint64_t* lo,
                            uint64_t* hi) {
  if (count_at_mid >= k) {
    *lo = mid;
  } else {
    *hi = mid;
  }
}

// Top-p keeps every weight at least a threshold t: the largest weight value such
// that the surviving weights >= t hold at least top_p of the surviving mass (so
// ties at the boundary are all kept). t is found by bisection on the bits of
// non-negative floats, which order as the floats do: mass(>= bits lo) >= target
// > mass(>= bits hi), from lo = 0.0 up to hi = just above 1.0, in at most 30
// halvings.
inline constexpr uint32_t kNucleusLowBits = 0u;
inline constexpr uint32_t kNucleusHighBits = 0x3f800001u;

MG_HD inline void nucleus_step(uint32_t mid, float mass_at_mid, float target, uint32_t* lo,
                               uint32_t* hi) {
  if (mass_at_mid >= target) {
    *lo = mid;
  } else {
    *hi = mid;
  }
}

// ---- the decision in one sequence ----

namespace sample_detail {

// Sum over the tokens of f(i), in the fixed shape.
template <typename F>
float ShapedSum(int32_t n, F f) {
  float sums[kSampleRuns];
  for (int32_t r = 0; r < kSampleRuns; ++r) {
    int32_t begin, end;
    sample_run(n, r, &begin, &end);
    float s = 0.0f;
    for (int32_t i = begin; i < end; ++i) s += f(i);
    sums[r] = s;
  }
  return sample_tree_sum(sums);
}

}  // namespace sample_detail

// The cuts for logits[0..n) under params (not greedy).
inline SampleCut sample_cut(const float* logits, int32_t n, const SamplingParams& params) {
  SampleCut cut;
  cut.max_logit = -INFINITY;
  for (int32_t i = 0; i < n; ++i) cut.max_logit = fmaxf(cut.max_logit, logits[i]);
  if (params.top_k > 0 && params.top_k < n) {
    uint64_t lo = 0, hi = uint64_t{1} << 32;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      int64_t count = 0;
      for (int32_t i = 0; i < n; ++i) {
        count += logits[i] == logits[i] && sample_order_key(logits[i]) >= mid;
      }
      topk_step(mid, count, params.top_k, &lo, &hi);
    }
    cut.min_key = static_cast<uint32_t>(lo);
  }
  if (params.top_p < 1.0f) {
    const float target = params.top_p * sample_detail::ShapedSum(n, [&](int32_t i) {
                           return sample_cut_weight(logits[i], cut);
                         });
    uint32_t lo = kNucleusLowBits, hi = kNucleusHighBits;
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      SampleCut at_mid = cut;
      at_mid.min_weight = f32_from_bits(mid);
      const float mass = sample_detail::ShapedSum(
          n, [&](int32_t i) { return sample_cut_weight(logits[i], at_mid); });
      nucleus_step(mid, mass, target, &lo, &hi);
    }
    cut.min_weight = f32_from_bits(lo);
  }
  cut.min_weight = fmaxf(cut.min_weight, params.min_p);
  return cut;
}

// Greedy decoding's token: the argmax, ties to the lowest id, NaN as -inf (as
// the argmax kernel).
inline int32_t sample_argmax(const float* logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) {
    if (topk_precedes(logits[i], i, logits[best], best)) best = i;
  }
  return best;
}

// The sampled token given the draw u in [0, 1). Greedy: sample_argmax. Else,
// with v_i = sample_draw_weight and the runs' sums in order, the first token (in
// index order) at which base-of-its-run + running sum within the run exceeds
// u * total; if rounding leaves none, the last surviving token; if nothing
// survives (every logit NaN), sample_argmax, so a token is always in range. The
// draw's bases add the run sums in run order, as the kernel's thread 0 does.
// Requires n > 0 and sampling_params_valid(params).
inline int32_t sample_token(const float* logits, int32_t n, const SamplingParams& params, float u) {
  if (sample_is_greedy(params.temperature)) return sample_argmax(logits, n);
  const SampleCut cut = sample_cut(logits, n, params);
  auto weight = [&](int32_t i) { return sample_draw_weight(logits[i], cut, params.temperature); };
  const float target = u * sample_detail::ShapedSum(n, weight);
  float base = 0.0f;
  int32_t last = -1;
  for (int32_t r = 0; r < kSampleRuns; ++r) {
    int32_t begin, end;
    sample_run(n, r, &begin, &end);
    float run_sum = 0.0f;
    for (int32_t i = begin; i < end; ++i) run_sum += weight(i);
    if (run_sum <= 0.0f) continue;
    if (base + run_sum > target) {
      float running = 0.0f;
      for (int32_t i = begin; i < end; ++i) {
        const float w = weight(i);
        if (w <= 0.0f) continue;
        running += w;
        last = i;
        if (base + running > target) return i;
      }
      return last;
    }
    base += run_sum;
    for (int32_t i = end - 1; i >= begin; --i) {
      if (weight(i) > 0.0f) {
        last = i;
        break;
      }
    }
  }
  return last >= 0 ? last : sample_argmax(logits, n);
}

}  // namespace moegraph
