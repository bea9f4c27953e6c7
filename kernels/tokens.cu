// Token kernels: argmax, temperature / top-p sampling and the step bookkeeping
// that lets a captured graph run a whole generation from device memory.
//
// Sampling is one block of 1024 threads computing sample_token's steps
// (kernels/sample_math.h): the max logit; top-k's bisection on the logits' order
// keys (a count per halving); top-p's bisection on the weight threshold (a mass
// per halving, weights recomputed from the logits since there is no scratch);
// then the draw. Thread t owns run t of the tokens, and every mass is the
// shared tree of the runs' sums, so the floats are the host's, bit for bit.
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/reduce.cuh"
#include "kernels/sample_math.h"

namespace moegraph {
namespace {

constexpr int kTokenThreads = kSampleRuns;

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

// The fixed-shape sum (sample_math.h) of the runs' values, thread t holding run
// t's: the pairwise tree in shared memory, level by level. On every thread.
__device__ float shaped_sum(float run_value, float* sums) {
  const int32_t t = static_cast<int32_t>(threadIdx.x);
  sums[t] = run_value;
  __syncthreads();
  for (int32_t stride = 1; stride < kSampleRuns; stride *= 2) {
    if (t % (2 * stride) == 0 && t + stride < kSampleRuns) sums[t] += sums[t + stride];
    __syncthreads();
  }
  const float total = sums[0];
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kTokenThreads)
    sample_kernel(const float* __restrict__ logits, int32_t n,
                  const SamplingParams* __restrict__ params_in, const int32_t* __restrict__ step,
                  int32_t* __restrict__ token_out) {
  const SamplingParams params = *params_in;
  __shared__ float scratch[32];
  __shared__ double count_scratch[32];
  __shared__ int32_t index_scratch[32];
  __shared__ float sums[kSampleRuns];
  __shared__ int32_t chosen_run;
  __shared__ float chosen_base;
  if (sample_is_greedy(params.temperature)) {
    const int32_t best = block_argmax(logits, n, scratch, index_scratch);
    if (threadIdx.x == 0) *token_out = best;
    return;
  }
  SampleCut cut;
  float local_max = -INFINITY;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) local_max = fmaxf(local_max, logits[i]);
  cut.max_logit = block_max(local_max, scratch);

  if (params.top_k > 0 && params.top_k < n) {
    uint64_t lo = 0, hi = uint64_t{1} << 32;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      double count = 0.0;
      for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        count += logits[i] == logits[i] && sample_order_key(logits[i]) >= mid ? 1.0 : 0.0;
      }
      topk_step(mid, static_cast<int64_t>(block_sum(count, count_scratch)), params.top_k, &lo, &hi);
    }
    cut.min_key = static_cast<uint32_t>(lo);
  }

  // This thread's run, in index order.
  int32_t run_begin, run_end;
  sample_run(n, static_cast<int32_t>(threadIdx.x), &run_begin, &run_end);
  auto cut_mass = [&](const SampleCut& c) {
    float run_sum = 0.0f;
    for (int32_t i = run_begin; i < run_end; ++i) run_sum += sample_cut_weight(logits[i], c);
    return shaped_sum(run_sum, sums);
  };
  if (params.top_p < 1.0f) {
    const float target = params.top_p * cut_mass(cut);
    uint32_t lo = kNucleusLowBits, hi = kNucleusHighBits;
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      SampleCut at_mid = cut;
      at_mid.min_weight = f32_from_bits(mid);
      nucleus_step(mid, cut_mass(at_mid), target, &lo, &hi);
    }
    cut.min_weight = f32_from_bits(lo);
  }
  cut.min_weight = fmaxf(cut.min_weight, params.min_p);

  // The draw: the runs' sums scanned in order by thread 0, then the chosen
  // run's thread walks it.
  float run_sum = 0.0f;
  for (int32_t i = run_begin; i < run_end; ++i) {
    run_sum += sample_draw_weight(logits[i], cut, params.temperature);
  }
  const float target = sample_uniform(params.seed, *step) * shaped_sum(run_sum, sums);
  sums[threadIdx.x] = run_sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    // The run where base + run sum first exceeds the target; if rounding leaves
    // none, the last run with mass (its walk then returns its last kept token).
    float base = 0.0f;
    chosen_run = -1;
    for (int32_t t = 0; t < kSampleRuns; ++t) {
      if (sums[t] <= 0.0f) continue;
      chosen_run = t;
      chosen_base = base;
      if (base + sums[t] > target) break;
      base += sums[t];
    }
  }
  __syncthreads();
  if (chosen_run < 0) {
    // Nothing survives (every logit NaN): the argmax, as sample_token.
    const int32_t best = block_argmax(logits, n, scratch, index_scratch);
    if (threadIdx.x == 0) *token_out = best;
    return;
  }
  if (static_cast<int32_t>(threadIdx.x) != chosen_run) return;
  float running = 0.0f;
  int32_t last = -1;
  for (int32_t i = run_begin; i < run_end; ++i) {
    const float w = sample_draw_weight(logits[i], cut, params.temperature);
    if (w <= 0.0f) continue;
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

cudaError_t launch_sample(const float* logits, int32_t n, const SamplingParams* params,
                          const int32_t* step, int32_t* token_out, cudaStream_t stream) {
  if (logits == nullptr || n <= 0 || params == nullptr || step == nullptr || token_out == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<sample_kernel>(1, kTokenThreads, stream, logits, n, params, step, token_out);
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
