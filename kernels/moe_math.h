// Decisions of the MoE kernels: router softmax and top-k, which ranks an expert
// pass computes, and the residency step split into the pieces the one-block
// residency kernel runs (thread 0 mutates, the block finds argmins). Shared by
// the kernels and the CPU tests. Light: .cu files include it.
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/fixed_math.h"
#include "loader/host_device.h"
#include "residency/policy.h"

namespace moegraph {

// Largest k and n_expert the router and expert kernels accept (shared-memory sizes).
inline constexpr int32_t kMaxTopK = 64;
inline constexpr int32_t kMaxRouterExperts = 1024;

// The router's top-k runs on a block of kRouterThreads (block_router_topk,
// kernels/epilogue.cuh): thread t holds experts t, t + kRouterThreads, ...; the
// k best of the threads' bests bound the choice, and the experts at or above
// that bound (at most k per thread: k x ceil(n_expert / kRouterThreads)) are
// ranked in one block-wide pass, which holds kRouterThreads of them.
inline constexpr int32_t kRouterThreads = 128;
MG_HD inline bool router_topk_fits(int32_t n_expert, int32_t k) {
  const int32_t held = (n_expert + kRouterThreads - 1) / kRouterThreads;
  return n_expert > 0 && n_expert <= kMaxRouterExperts && k > 0 && k <= kMaxTopK &&
         k <= n_expert && k * held <= kRouterThreads;
}

// A rank's miss flag through the step: the slot decision writes 0 (hit) or 1
// (missed, its copy not done), and the stage copy's last block of the rank
// writes 2 once the whole expert is in its slot. Nonzero: missed this step.
inline constexpr uint8_t kRankHit = 0;
inline constexpr uint8_t kRankStaging = 1;
inline constexpr uint8_t kRankCopied = 2;

// Which experts an expert pass computes: kHits before the copies join, kMisses
// after; kAll every rank after the join (or with nothing to copy); kReady every
// rank at once, a missed rank's blocks first waiting for its copy (the one pass
// of the cached arms: a layer with one miss does not pay a pass).
enum class ExpertPass : int32_t { kHits = 0, kMisses = 1, kAll = 2, kReady = 3 };

// Whether the pass computes a rank whose miss flag is missed (kRank*).
MG_HD inline bool rank_in_pass(ExpertPass pass, uint8_t missed) {
  switch (pass) {
    case ExpertPass::kHits:
      return missed == kRankHit;
    case ExpertPass::kMisses:
      return missed != kRankHit;
    default:
      return true;
  }
}

// Whether the rank's blocks wait for its copy before reading the slot.
MG_HD inline bool rank_waits_for_copy(ExpertPass pass, uint8_t missed) {
  return pass == ExpertPass::kReady && missed != kRankHit;
}

// Whether a rank's expert counts as computed after its copy (pass_b_experts)
// rather than without one (pass_a_experts).
MG_HD inline bool rank_computed_after_copy(ExpertPass pass, uint8_t missed) {
  return pass == ExpertPass::kMisses || rank_waits_for_copy(pass, missed);
}

// ---- router ----

// Routing replay (moegraph bench --routing-trace): the selection of `layer` at
// trace step *step comes from a trace in device memory instead of the router,
// with no readback: ids [n_steps][n_layer][k], weights the same shape (the
// trace's f16 router weights, widened to f32 when uploaded) or null
// (uniform_weight, 1/k, each). *step is the routing cursor mod n_steps, kept by
// launch_routing_step_end. (A 64-bit remainder or a float division in the
// router's epilogue is a call that cost matvec instances a stack frame.) The
// router still runs, so its cost stays in the step.
struct RoutingReplay {
  const int32_t* ids = nullptr;  // null: no replay
  const float* weights = nullptr;
  float uniform_weight = 0.0f;
  int32_t n_layer = 0;
  int32_t layer = 0;
  const int64_t* step = nullptr;
};

// Rank r of the trace's row over the router's choice of k experts and
// weights; a row the trace lacks (its first id < 0) keeps the router's.
MG_HD inline void replay_rank(const RoutingReplay& t, int32_t k, int32_t r, int32_t* experts,
                              float* weights) {
  const int64_t row = (*t.step * t.n_layer + t.layer) * k;
  if (t.ids[row] < 0) return;
  experts[r] = t.ids[row + r];
  weights[r] = t.weights != nullptr ? t.weights[row + r] : t.uniform_weight;
}

// The router's softmax, the same bits on the host and in the router kernel
// (block_router_topk): f32, exp_nonpositive of (logit - max), and the sum in
// one warp's shape: lane l adds logits l, l + 32, ... in index order, then the
// 32 lanes' sums butterfly (kRouterLanes). No f64: a consumer card runs it at 1/64 rate.
inline constexpr int32_t kRouterLanes = 32;
MG_HD inline float router_exp(float logit, float max_logit) {
  return exp_nonpositive(logit - max_logit);
}

MG_HD inline void router_softmax(const float* logits, int32_t n, float* probs) {
  float max_logit = -INFINITY;
  for (int32_t i = 0; i < n; ++i) max_logit = fmaxf(max_logit, logits[i]);
  float lane_sums[kRouterLanes];
  for (int32_t lane = 0; lane < kRouterLanes; ++lane) {
    float sum = 0.0f;
    for (int32_t i = lane; i < n; i += kRouterLanes) sum += router_exp(logits[i], max_logit);
    lane_sums[lane] = sum;
  }
  const float sum = butterfly_sum(lane_sums, kRouterLanes);
  for (int32_t i = 0; i < n; ++i) probs[i] = router_exp(logits[i], max_logit) / sum;
}

// Top-k order: a larger value first, equal values by the lower index (a stable
// descending sort). A NaN ranks as -inf, so the order stays total and a real
// element always precedes a reduction's idle pair (-inf, INT32_MAX): a parallel
// argmax finds the same element and never returns the idle index.
MG_HD inline bool topk_precedes(float a, int32_t index_a, float b, int32_t index_b) {
  if (isnan(a)) a = -INFINITY;
  if (isnan(b)) b = -INFINITY;
  return a > b || (a == b && index_a < index_b);
}

// An expert as the router's top-k ranks it: its id and topk_key of its value
// (+ score_bias). {i, topk_key(a)} < {j, topk_key(b)} exactly when
// topk_precedes(a, i, b, j), and so does rank_word's order (the key above the
// id, which is non-negative): one integer compare a pair, no NaN test, for
// ranking by counting.
struct alignas(8) RankedExpert {
  int32_t index;
  uint32_t key;
};

// The f32 bits mapped so that a larger value gives a smaller key; a NaN as
// -inf and -0 as +0 (topk_precedes finds them equal).
MG_HD inline uint32_t topk_key(float value) {
  if (isnan(value)) value = -INFINITY;
  if (value == 0.0f) value = 0.0f;
  const uint32_t bits = f32_to_bits(value);
  return (bits & 0x80000000u) != 0 ? bits : ~bits & 0x7fffffffu;
}

MG_HD inline bool operator<(const RankedExpert& a, const RankedExpert& b) {
  return a.key < b.key || (a.key == b.key && a.index < b.index);
}

MG_HD inline uint64_t rank_word(const RankedExpert& e) {
  return static_cast<uint64_t>(e.key) << 32 | static_cast<uint32_t>(e.index);
}

// The k best of values[0..n) in top-k order (k rounds of argmax over the rest).
MG_HD inline void select_topk(const float* values, int32_t n, int32_t k, int32_t* chosen) {
  for (int32_t t = 0; t < k; ++t) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; ++i) {
      bool taken = false;
      for (int32_t u = 0; u < t; ++u) taken = taken || chosen[u] == i;
      if (taken) continue;
      if (best < 0 || topk_precedes(values[i], i, values[best], best)) best = i;
    }
    chosen[t] = best;
  }
}

// How the router's logits become what it chooses by (ExpertGating): softmax
// probabilities, the sigmoid of each logit (glm4moe), or the logits themselves
// with a softmax over the k chosen (gpt-oss).
enum class RouterGating : int32_t { kSoftmax = 0, kSigmoid = 1, kSoftmaxWeight = 2 };

// The sigmoid of a logit in f32 from exp_nonpositive: 1 / (1 + e^-x), or
// e^x / (1 + e^x) below 0, so the exp's argument is never positive.
MG_HD inline float router_sigmoid(float logit) {
  if (logit >= 0.0f) return 1.0f / (1.0f + exp_nonpositive(-logit));
  const float e = exp_nonpositive(logit);
  return e / (1.0f + e);
}

// Rank r's router weight of the chosen experts, as the oracle's SelectExperts
// makes them (through topk_weights): its value (a probability, or its logit
// softmaxed over the k with kSoftmaxWeight), divided by the k values' f32 sum
// in rank order (clamped at f16's smallest normal, as build_moe_ffn's
// ggml_clamp) when norm_topk (llama.cpp's norm_w), then times scale
// (expert_weights_scale). chosen_values: the k chosen experts' values, rank
// order. Each rank computes the max and the sum itself (the same bits in every
// rank), so a block's threads weigh their ranks side by side.
MG_HD inline float topk_weight(const float* chosen_values, int32_t k, RouterGating gating,
                               bool norm_topk, float scale, int32_t r) {
  const bool softmax = gating == RouterGating::kSoftmaxWeight;
  float max = -INFINITY;
  if (softmax) {
    for (int32_t q = 0; q < k; ++q) max = fmaxf(max, chosen_values[q]);
  }
  auto weight = [&](int32_t q) -> float {
    const float v = chosen_values[q];
    return softmax ? exp_nonpositive(v - max) : v;
  };
  float sum = 0.0f;
  for (int32_t q = 0; q < k; ++q) sum += weight(q);
  // The softmax over the k is already normalised: its sum is then 1.
  const float norm = fmaxf(softmax ? 1.0f : sum, 6.103515625e-5f);
  float w = softmax ? weight(r) / sum : weight(r);
  if (norm_topk) w /= norm;
  return scale != 1.0f ? w * scale : w;
}

// Every rank's weight (topk_weight) into weights[0, k).
MG_HD inline void topk_weights(const float* chosen_values, int32_t k, RouterGating gating,
                               bool norm_topk, float scale, float* weights) {
  for (int32_t r = 0; r < k; ++r) {
    weights[r] = topk_weight(chosen_values, k, gating, norm_topk, scale, r);
  }
}

// ---- residency step, in pieces ----
// residency_step (residency/policy.h) is: keys; for each rank, table lookup and
// touch_hit on a hit; for each miss, find_victim then evict/admit. The kernel runs
// touch_hit as hit_refresh + (when it returns true) demote of the argmin of
// demotion_rank, and each miss as the argmin of victim_rank + admit_miss, so the
// two slot scans are block-wide reductions instead of one thread's loops.

// touch_hit up to its demotion: stamps slot and promotes it; true when the
// protected segment overflowed, so the oldest protected slot must be demoted.
MG_HD inline bool hit_refresh(const ResidencyState& s, const ResidencyPool& pool, int32_t slot) {
  s.stamp[slot] = (*pool.clock)++;
  if (s.seg[slot] == kProtected) return false;
  s.seg[slot] = kProtected;
  return ++*pool.n_protected > pool.protected_cap;
}

// The argmin over the pool is oldest_protected(): protected slots by stamp (unique).
MG_HD inline uint64_t demotion_rank(const ResidencyState& s, int32_t slot) {
  return s.owner[slot] != kNoKey && s.seg[slot] == kProtected ? s.stamp[slot] : kNotAVictim;
}

MG_HD inline void demote(const ResidencyState& s, const ResidencyPool& pool, int32_t slot) {
  s.seg[slot] = kProbation;
  s.stamp[slot] = (*pool.clock)++;
  --*pool.n_protected;
}

// The miss branch of residency_step for victim (find_victim's slot): evicts its
// owner (appending it to evicted_keys) and admits key to probation. Updates out.
MG_HD inline void admit_miss(const ResidencyState& s, const ResidencyPool& pool, int32_t victim,
                             int32_t key, int32_t* evicted_keys, StepOutcome* out) {
  const int32_t old_key = s.owner[victim];
  if (old_key != kNoKey) {
    s.table[old_key] = kNoSlot;
    if (s.seg[victim] == kProtected) --*pool.n_protected;
    evicted_keys[out->n_evictions++] = old_key;
  }
  s.owner[victim] = key;
  s.table[key] = victim;
  s.seg[victim] = kProbation;
  s.stamp[victim] = (*pool.clock)++;
  ++out->n_misses;
}

}  // namespace moegraph
