// Token sampling: the Philox-4x32-10 draw and the temperature / top-p decision
// given that draw. sample_token is the decision in one sequence (the CPU's and
// the tests' definition); the sampling kernel computes the same steps with
// block-wide reductions. Light: .cu files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "loader/host_device.h"
#include "loader/quant.h"

namespace moegraph {

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

// The draw of step `step` under seed: counter {step, 0, 0, 0}, key = the seed's
// two 32-bit halves; a replay with the same seed and step draws the same value.
MG_HD inline float sample_uniform(uint64_t seed, int32_t step) {
  const uint32_t counter[4] = {static_cast<uint32_t>(step), 0u, 0u, 0u};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(counter, key, out);
  return uniform_from_bits(out[0]);
}

// Temperature 0 (or below) is greedy decoding: the argmax, no draw.
MG_HD inline bool sample_is_greedy(float temperature) { return !(temperature > 0.0f); }

// Unnormalised probability of a logit: exp((logit - max) / T), in (0, 1].
MG_HD inline float sample_weight(float logit, float max_logit, float temperature) {
  return expf((logit - max_logit) / temperature);
}

// Top-p keeps every token whose weight is at least a threshold t: the largest
// weight value such that the weights >= t hold at least top_p of the total mass
// (so tokens tied at the boundary are all kept). t is found by bisection on the
// bits of non-negative floats, which order as the floats do: the invariant is
// mass(>= bits lo) >= target > mass(>= bits hi), from lo = 0.0 up to hi = just
// above 1.0 (the largest weight), in at most 30 halvings.
inline constexpr uint32_t kNucleusLowBits = 0u;
inline constexpr uint32_t kNucleusHighBits = 0x3f800001u;

// One bisection step: the new (lo, hi) given mass(>= mid) against the target.
MG_HD inline uint32_t nucleus_mid(uint32_t lo, uint32_t hi) { return lo + (hi - lo) / 2; }
MG_HD inline void nucleus_step(uint32_t mid, float mass_at_mid, float target, uint32_t* lo,
                               uint32_t* hi) {
  if (mass_at_mid >= target) {
    *lo = mid;
  } else {
    *hi = mid;
  }
}

// Whether a weight is kept by threshold t and can be drawn (a zero weight never is).
MG_HD inline bool nucleus_keeps(float weight, float threshold) {
  return weight >= threshold && weight > 0.0f;
}

// The sampled token given the draw u in [0, 1): with weights w_i (sample_weight)
// and the kept set K (top_p < 1: nucleus_keeps of the bisection's threshold;
// top_p >= 1: every positive weight), the first i of K in index order whose
// running sum of kept weights exceeds u * sum(K); if rounding leaves none, the
// last token of K. Requires n > 0, temperature > 0, 0 < top_p.
MG_HD inline int32_t sample_token(const float* logits, int32_t n, float temperature, float top_p,
                                  float u) {
  float max_logit = logits[0];
  for (int32_t i = 1; i < n; ++i) max_logit = fmaxf(max_logit, logits[i]);
  float threshold = 0.0f;
  if (top_p < 1.0f) {
    float total = 0.0f;
    for (int32_t i = 0; i < n; ++i) total += sample_weight(logits[i], max_logit, temperature);
    const float target = top_p * total;
    uint32_t lo = kNucleusLowBits, hi = kNucleusHighBits;
    while (hi - lo > 1) {
      const uint32_t mid = nucleus_mid(lo, hi);
      const float t = f32_from_bits(mid);
      float mass = 0.0f;
      for (int32_t i = 0; i < n; ++i) {
        const float w = sample_weight(logits[i], max_logit, temperature);
        if (nucleus_keeps(w, t)) mass += w;
      }
      nucleus_step(mid, mass, target, &lo, &hi);
    }
    threshold = f32_from_bits(lo);
  }
  float kept = 0.0f;
  for (int32_t i = 0; i < n; ++i) {
    const float w = sample_weight(logits[i], max_logit, temperature);
    if (nucleus_keeps(w, threshold)) kept += w;
  }
  const float target = u * kept;
  float running = 0.0f;
  int32_t last = -1;
  for (int32_t i = 0; i < n; ++i) {
    const float w = sample_weight(logits[i], max_logit, temperature);
    if (!nucleus_keeps(w, threshold)) continue;
    running += w;
    if (running > target) return i;
    last = i;
  }
  return last;
}

}  // namespace moegraph
