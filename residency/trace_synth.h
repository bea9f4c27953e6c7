// Synthetic routing traces with the properties that matter to an expert cache:
// skewed popularity, token-to-token reuse and slow drift, for any geometry.
//
// Each layer has its own popularity order (a random permutation of its experts);
// the expert at rank r is drawn with weight 1 / (r + 1)^zipf_s. At each step and
// each layer:
// 1. every expert of the previous step's selection is kept with probability
//    `reuse`, independently;
// 2. the rest of the k experts are drawn by popularity, without replacement,
//    from the experts that were not selected at the previous step (only when
//    those run out, from the dropped ones).
// So the measured next-token reuse (trace_stats.h) is `reuse` in expectation,
// whatever the skew. The first step draws all k by popularity. The selection is
// stored hottest rank first.
// Drift: every drift_period steps, each layer swaps the experts at two adjacent
// ranks, chosen at random, so the hot set moves gradually.
// Weights (optional): the softmax of k random logits on the grid (ln 2 / 4) * j,
// j in [0, 32), sorted descending and given to the selection in order; the
// grid makes every exponential an exact power of two times a table constant.
//
// Deterministic across platforms: an own PRNG (xoshiro256** seeded through
// splitmix64) and integer sampling; the popularity weights are rounded to
// integers (2^32 / (r + 1)^s) once, so only std::pow's last bit could matter,
// and that lies 2^-21 below the rounding step.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "residency/trace.h"

namespace moegraph {

// Defaults: Qwen3-30B-A3B's geometry and a next-token reuse like its traces.
struct SynthSpec {
  int32_t n_layer = 48;
  int32_t n_expert = 128;
  int32_t k = 8;
  int64_t n_steps = 1000;
  double zipf_s = 1.0;
  double reuse = 0.45;
  int64_t drift_period = 0;  // 0: no drift
  uint64_t seed = 1;
  bool weights = false;
};

// Refuses a spec it cannot build, naming the CLI flag ("--top-k 9 exceeds --experts 8").
absl::StatusOr<RoutingTrace> SynthesizeTrace(const SynthSpec& spec);

}  // namespace moegraph
