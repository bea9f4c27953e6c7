// Token kernels: argmax, temperature / top-p sampling and the step bookkeeping
// that lets a captured graph run a whole generation from device memory.
//
// Sampling is one block of 1024 threads computing sample_token's steps
// (kernels/sample_math.h) with block reductions: the max logit, the total weight,
// a bisection for the top-p threshold (a reduction per halving, weights
// recomputed from the logits since there is no scratch), the kept mass, then the
// draw: each thread owns a contiguous run of tokens, thread 0 scans the runs'
// sums to find the run where the running sum passes u * kept, and that run's
// thread walks it.
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/reduce.cuh"
#include "kernels/sample_math.h"

namespace moegraph {
namespace {

constexpr int kTokenThreads = 1024;

// The block's argmax of logits[0..n) (ties to the lowest id), on every thread.
__device__ int32_t block_argmax(const float* logits, int32_t n, float* value_scratch,
                                int32_t* index_scratch) {
  float best = -INFINITY;
  int32_t best_index = INT32_MAX;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (topk_precedes(logits[i], i, best, best_index)) {
      best = logits[i];
      best_index = i;
    }
  }
  block_best(&best, &best_index, value_scratch, index_scratch);
  return best_index;
}

__global__ void __launch_bounds__(kTokenThreads)
    argmax_kernel(const float* __restrict__ logits, int32_t n, int32_t* __restrict__ token_out) {
  __shared__ float value_scratch[32];
  __shared__ int32_t index_scratch[32];
  const int32_t best = block_argmax(logits, n, value_scratch, index_scratch);
  if (threadIdx.x == 0) *token_out = best;
}

// The kept mass of logits[0..n) under threshold, on every thread.
__device__ float kept_mass(const float* logits, int32_t n, float max_logit, float temperature,
                           float threshold, float* scratch) {
  float mass = 0.0f;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float w = sample_weight(logits[i], max_logit, temperature);
    if (nucleus_keeps(w, threshold)) mass += w;
  }
  return block_sum(mass, scratch);
}

__global__ void __launch_bounds__(kTokenThreads)
    sample_kernel(const float* __restrict__ logits, int32_t n, float temperature, float top_p,
                  uint64_t seed, const int32_t* __restrict__ step,
                  int32_t* __restrict__ token_out) {
  __shared__ float scratch[32];
  __shared__ int32_t index_scratch[32];
  __shared__ float run_sums[kTokenThreads];
  __shared__ int32_t chosen_run;
  __shared__ float chosen_base;
  if (sample_is_greedy(temperature)) {
    const int32_t best = block_argmax(logits, n, scratch, index_scratch);
    if (threadIdx.x == 0) *token_out = best;
    return;
  }
  float local_max = -INFINITY;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) local_max = fmaxf(local_max, logits[i]);
  const float max_logit = block_max(local_max, scratch);

  float threshold = 0.0f;
  if (top_p < 1.0f) {
    const float target = top_p * kept_mass(logits, n, max_logit, temperature, 0.0f, scratch);
    uint32_t lo = kNucleusLowBits, hi = kNucleusHighBits;
    while (hi - lo > 1) {
      const uint32_t mid = nucleus_mid(lo, hi);
      const float mass = kept_mass(logits, n, max_logit, temperature, f32_from_bits(mid), scratch);
      nucleus_step(mid, mass, target, &lo, &hi);
    }
    threshold = f32_from_bits(lo);
  }
  const float target = sample_uniform(seed, *step) *
                       kept_mass(logits, n, max_logit, temperature, threshold, scratch);

  // The draw: contiguous runs, scanned in order by thread 0.
  const int32_t run_len = (n + blockDim.x - 1) / blockDim.x;
  const int32_t run_begin = min(n, static_cast<int32_t>(threadIdx.x) * run_len);
  const int32_t run_end = min(n, run_begin + run_len);
  float run_sum = 0.0f;
  for (int32_t i = run_begin; i < run_end; ++i) {
    const float w = sample_weight(logits[i], max_logit, temperature);
    if (nucleus_keeps(w, threshold)) run_sum += w;
  }
  run_sums[threadIdx.x] = run_sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    // The run where base + run sum first exceeds the target; if rounding leaves
    // none, the last run with kept mass (its walk then returns its last kept token).
    float base = 0.0f;
    chosen_run = -1;
    for (int32_t t = 0; t < static_cast<int32_t>(blockDim.x); ++t) {
      if (run_sums[t] <= 0.0f) continue;
      chosen_run = t;
      chosen_base = base;
      if (base + run_sums[t] > target) break;
      base += run_sums[t];
    }
    // No kept token (every logit NaN): -1, as sample_token, not a stale token.
    if (chosen_run < 0) *token_out = -1;
  }
  __syncthreads();
  if (static_cast<int32_t>(threadIdx.x) != chosen_run) return;
  float running = 0.0f;
  int32_t last = -1;
  for (int32_t i = run_begin; i < run_end; ++i) {
    const float w = sample_weight(logits[i], max_logit, temperature);
    if (!nucleus_keeps(w, threshold)) continue;
    running += w;
    last = i;
    if (chosen_base + running > target) break;
  }
  *token_out = last;
}

// A thread per logit.
__global__ void record_logits_kernel(const float* __restrict__ logits, int32_t n,
                                     const int32_t* __restrict__ step, int32_t record_steps,
                                     float* __restrict__ record) {
  const int32_t i = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  const int32_t s = *step;
  if (i >= n || s >= record_steps) return;
  record[static_cast<int64_t>(s) * n + i] = logits[i];
}

__global__ void begin_step_kernel(const int32_t* __restrict__ prompt,
                                  const int32_t* __restrict__ n_prompt,
                                  const int32_t* __restrict__ sampled,
                                  const int32_t* __restrict__ step, int32_t* __restrict__ token,
                                  int32_t* __restrict__ pos) {
  const int32_t s = *step;
  *token = s < *n_prompt ? prompt[s] : *sampled;
  *pos = s;
}

__global__ void end_step_kernel(const int32_t* __restrict__ sampled, int32_t* __restrict__ step,
                                int32_t* __restrict__ out_tokens, DeviceCounters* counters) {
  out_tokens[*step] = *sampled;
  ++*step;
  ++counters->steps;
}

}  // namespace

cudaError_t launch_argmax(const float* logits, int32_t n, int32_t* token_out, cudaStream_t stream) {
  if (logits == nullptr || n <= 0 || token_out == nullptr) return cudaErrorInvalidValue;
  return launch_kernel<argmax_kernel>(1, kTokenThreads, stream, logits, n, token_out);
}

cudaError_t launch_sample(const float* logits, int32_t n, float temperature, float top_p,
                          uint64_t seed, const int32_t* step, int32_t* token_out,
                          cudaStream_t stream) {
  // Negated comparisons also reject NaN.
  if (logits == nullptr || n <= 0 || step == nullptr || token_out == nullptr ||
      !(temperature >= 0.0f) || !(temperature <= 3.4e38f) || !(top_p > 0.0f) || !(top_p <= 1.0f)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<sample_kernel>(1, kTokenThreads, stream, logits, n, temperature, top_p, seed,
                                      step, token_out);
}

cudaError_t launch_record_logits(const float* logits, int32_t n, const int32_t* step,
                                 int32_t record_steps, float* record, cudaStream_t stream) {
  if (logits == nullptr || n <= 0 || step == nullptr || record_steps <= 0 || record == nullptr) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 256;
  return launch_kernel<record_logits_kernel>((n + kThreads - 1) / kThreads, kThreads, stream,
                                             logits, n, step, record_steps, record);
}

cudaError_t launch_begin_step(const int32_t* prompt, const int32_t* n_prompt,
                              const int32_t* sampled, const int32_t* step, int32_t* token,
                              int32_t* pos, cudaStream_t stream) {
  if (prompt == nullptr || n_prompt == nullptr || sampled == nullptr || step == nullptr ||
      token == nullptr || pos == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<begin_step_kernel>(1, 1, stream, prompt, n_prompt, sampled, step, token,
                                          pos);
}

cudaError_t launch_end_step(const int32_t* sampled, int32_t* step, int32_t* out_tokens,
                            DeviceCounters* counters, cudaStream_t stream) {
  if (sampled == nullptr || step == nullptr || out_tokens == nullptr || counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<end_step_kernel>(1, 1, stream, sampled, step, out_tokens, counters);
}

}  // namespace moegraph
