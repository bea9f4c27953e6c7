// Token kernels: sampling (the argmax included) and the step bookkeeping
// that lets a captured graph run a whole generation from device memory.
//
// Sampling computes sample_token's steps (kernels/sample_math.h) in one launch
// of blocks of 1024 threads, each over kSampleBlockLogits tokens. Every block finds
// its argmax and, when top-k keeps at most kSampleCandidates tokens, its own
// top-k: the tokens whose order key is at least its k-th largest, in index
// order. The global k-th largest key is at least every block's, so these hold
// every token top-k keeps; the others weigh exactly 0 in every sum, and adding
// 0 changes no float. The last block (kernels/epilogue.cuh) then runs the
// decision over the candidates alone, or over the whole vocabulary when
// top-k does not bound them (no top-k, a larger k, or a block with more ties
// than it can hold): the max logit; top-k's bisection on the order keys (a
// count per halving); top-p's bisection on the weight threshold (a mass per
// halving); then the draw. Thread t owns run t of the tokens, and every mass is
// the shared tree of the runs' sums, so the floats are the host's, bit for bit.
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/launch_geometry.h"
#include "kernels/reduce.cuh"
#include "kernels/sample_math.h"

namespace moegraph {
namespace {

constexpr int kTokenThreads = kSampleRuns;
constexpr int32_t kSampleCandidates = 256;  // per block, the largest top-k it holds

// Blocks of kSampleBlockLogits tokens, 4 a thread (launch_geometry.h).
int32_t sample_blocks(int32_t n) { return sample_launch_geometry(n).grid.x; }

// The scratch of one launch over B blocks (sample_scratch_bytes).
struct SampleScratch {
  int32_t* path;          // SamplePath of the last decision
  float* best_value;      // [B] each block's argmax
  int32_t* best_index;    // [B]
  int32_t* n_candidates;  // [B] each block's top-k count, -1: more than it holds
  int32_t* block_token;   // [B][kSampleCandidates] each block's candidates
  float* block_logit;     // [B][kSampleCandidates]
  int32_t* token;         // [B * kSampleCandidates] all candidates, in index order
  float* logit;           // [B * kSampleCandidates]
};

__device__ inline SampleScratch sample_scratch_at(void* base, int32_t blocks) {
  uint8_t* p = static_cast<uint8_t*>(base);
  const size_t b = static_cast<size_t>(blocks), c = b * kSampleCandidates;
  SampleScratch s;
  s.path = reinterpret_cast<int32_t*>(p);
  s.best_value = reinterpret_cast<float*>(p + 16);
  s.best_index = reinterpret_cast<int32_t*>(p + 16 + 4 * b);
  s.n_candidates = reinterpret_cast<int32_t*>(p + 16 + 8 * b);
  s.block_token = reinterpret_cast<int32_t*>(p + 16 + 12 * b);
  s.block_logit = reinterpret_cast<float*>(p + 16 + 12 * b + 4 * c);
  s.token = reinterpret_cast<int32_t*>(p + 16 + 12 * b + 8 * c);
  s.logit = reinterpret_cast<float*>(p + 16 + 12 * b + 12 * c);
  return s;
}

// The block's shared memory, declared by the kernel (see kernels/epilogue.cuh).
struct SampleShared {
  float scratch[32];
  int32_t count_scratch[32];
  int32_t index_scratch[32];
  float sums[kSampleRuns];
  int32_t scan[kSampleRuns];
  int32_t n_candidates;  // all blocks' together
  int32_t chosen_run;
  float chosen_base;
  EpilogueShared epilogue;
};

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

// The first index in token[0, size) (ascending) at least value.
__device__ int32_t lower_bound(const int32_t* token, int32_t size, int32_t value) {
  int32_t lo = 0, hi = size;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (token[mid] < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The draw over size tokens: logit[j] is the logit of token[j] (token null:
// of j), ascending; every token not among them weighs 0. n is the vocabulary
// (the runs' shape), argmax the vocabulary's argmax (when nothing survives).
__device__ void sample_over(const float* logit, const int32_t* token, int32_t size, int32_t n,
                            const SamplingParams& params, int32_t step, int32_t argmax,
                            SampleShared* sh, int32_t* token_out) {
  SampleCut cut;
  float local_max = -INFINITY;
  for (int32_t j = threadIdx.x; j < size; j += blockDim.x) local_max = fmaxf(local_max, logit[j]);
  cut.max_logit = block_max(local_max, sh->scratch);

  if (params.top_k > 0 && params.top_k < n) {
    uint64_t lo = 0, hi = uint64_t{1} << 32;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      int32_t count = 0;
      for (int32_t j = threadIdx.x; j < size; j += blockDim.x) {
        count += logit[j] == logit[j] && sample_order_key(logit[j]) >= mid ? 1 : 0;
      }
      topk_step(mid, block_sum(count, sh->count_scratch), params.top_k, &lo, &hi);
    }
    cut.min_key = static_cast<uint32_t>(lo);
  }

  // This thread's run of the vocabulary, as the range of j it covers.
  int32_t run_begin, run_end;
  sample_run(n, static_cast<int32_t>(threadIdx.x), &run_begin, &run_end);
  if (token != nullptr) {
    run_begin = lower_bound(token, size, run_begin);
    run_end = lower_bound(token, size, run_end);
  }
  auto cut_mass = [&](const SampleCut& c) {
    float run_sum = 0.0f;
    for (int32_t j = run_begin; j < run_end; ++j) run_sum += sample_cut_weight(logit[j], c);
    return shaped_sum(run_sum, sh->sums);
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
  for (int32_t j = run_begin; j < run_end; ++j) {
    run_sum += sample_draw_weight(logit[j], cut, params.temperature);
  }
  const float target = sample_uniform(params.seed, step) * shaped_sum(run_sum, sh->sums);
  sh->sums[threadIdx.x] = run_sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    // The run where base + run sum first exceeds the target; if rounding leaves
    // none, the last run with mass (its walk then returns its last kept token).
    float base = 0.0f;
    sh->chosen_run = -1;
    for (int32_t t = 0; t < kSampleRuns; ++t) {
      if (sh->sums[t] <= 0.0f) continue;
      sh->chosen_run = t;
      sh->chosen_base = base;
      if (base + sh->sums[t] > target) break;
      base += sh->sums[t];
    }
  }
  __syncthreads();
  if (sh->chosen_run < 0) {
    // Nothing survives (every logit NaN): the argmax, as sample_token.
    if (threadIdx.x == 0) *token_out = argmax;
    return;
  }
  if (static_cast<int32_t>(threadIdx.x) != sh->chosen_run) return;
  float running = 0.0f;
  int32_t last = -1;
  for (int32_t j = run_begin; j < run_end; ++j) {
    const float w = sample_draw_weight(logit[j], cut, params.temperature);
    if (w <= 0.0f) continue;
    running += w;
    last = token != nullptr ? token[j] : j;
    if (sh->chosen_base + running > target) break;
  }
  *token_out = last;
}

// The last block's decision over the blocks' argmaxes and candidates (or the
// whole vocabulary), into *token_out by one thread.
__device__ void decide_token(const float* __restrict__ logits, int32_t n,
                             const SamplingParams& params, const int32_t* step,
                             const SampleScratch& s, bool greedy, bool bounded, SampleShared& sh,
                             int32_t* __restrict__ token_out) {
  const int32_t t = static_cast<int32_t>(threadIdx.x);
  // The vocabulary's argmax from the blocks' (the order is total: ties to the
  // lowest id), and whether every block's candidates are there.
  float best = -INFINITY;
  int32_t best_index = INT32_MAX;
  int32_t held = 0;
  for (int32_t b = t; b < static_cast<int32_t>(gridDim.x); b += blockDim.x) {
    const float value = __ldcg(s.best_value + b);
    const int32_t index = __ldcg(s.best_index + b);
    if (topk_precedes(value, index, best, best_index)) {
      best = value;
      best_index = index;
    }
    if (bounded && __ldcg(s.n_candidates + b) < 0) held = 1;
  }
  block_best(&best, &best_index, sh.scratch, sh.index_scratch);
  const bool overflow = block_sum(held, sh.count_scratch) > 0;
  if (greedy) {
    if (t == 0) {
      *token_out = best_index;
      *s.path = static_cast<int32_t>(SamplePath::kArgmax);
    }
    return;
  }
  const int32_t step_now = *step;
  if (!bounded || overflow) {
    if (t == 0) *s.path = static_cast<int32_t>(SamplePath::kVocabulary);
    sample_over(logits, nullptr, n, n, params, step_now, best_index, &sh, token_out);
    return;
  }
  // The blocks' candidates side by side, in block (so index) order; sh.scan[b]
  // is block b's offset (launch_sample keeps gridDim.x within kTokenThreads).
  if (t == 0) {
    int32_t at = 0;
    for (int32_t b = 0; b < static_cast<int32_t>(gridDim.x); ++b) {
      sh.scan[b] = at;
      at += __ldcg(s.n_candidates + b);
    }
    sh.n_candidates = at;
    *s.path = static_cast<int32_t>(SamplePath::kCandidates);
  }
  __syncthreads();
  const int32_t size = sh.n_candidates;
  for (int32_t b = t / 32; b < static_cast<int32_t>(gridDim.x); b += blockDim.x / 32) {
    const int32_t count = __ldcg(s.n_candidates + b);
    for (int32_t i = t % 32; i < count; i += 32) {
      s.token[sh.scan[b] + i] = __ldcg(s.block_token + b * kSampleCandidates + i);
      s.logit[sh.scan[b] + i] = __ldcg(s.block_logit + b * kSampleCandidates + i);
    }
  }
  __syncthreads();  // the block's own writes, visible to the block
  sample_over(s.logit, s.token, size, n, params, step_now, best_index, &sh, token_out);
}

__global__ void __launch_bounds__(kTokenThreads)
    sample_kernel(const float* __restrict__ logits, int32_t n,
                  const SamplingParams* __restrict__ params_in, const int32_t* step,
                  void* scratch_base, unsigned int* __restrict__ tickets,
                  int32_t* __restrict__ token_out, StepEnd end) {
  wait_for_prior_grids();
  __shared__ SampleShared sh;
  const SamplingParams params = *params_in;
  const SampleScratch s = sample_scratch_at(scratch_base, static_cast<int32_t>(gridDim.x));
  const int32_t block = blockIdx.x;
  const int32_t t = static_cast<int32_t>(threadIdx.x);
  // This thread's 4 tokens of the block's chunk, in index order.
  const int32_t first = block * kSampleBlockLogits + 4 * t;
  float v[4];
  for (int i = 0; i < 4; ++i) v[i] = first + i < n ? logits[first + i] : NAN;

  float best = -INFINITY;
  int32_t best_index = INT32_MAX;
  for (int i = 0; i < 4; ++i) {
    if (first + i < n && topk_precedes(v[i], first + i, best, best_index)) {
      best = v[i];
      best_index = first + i;
    }
  }
  block_best(&best, &best_index, sh.scratch, sh.index_scratch);
  if (t == 0) {
    s.best_value[block] = best;
    s.best_index[block] = best_index;
  }

  const bool greedy = sample_is_greedy(params.temperature);
  const bool bounded = !greedy && params.top_k > 0 && params.top_k < n &&
                       params.top_k <= kSampleCandidates;
  if (bounded) {
    // The block's k-th largest key (0 when it has fewer than k logits that
    // are not NaN: all of them are kept), then its tokens at or past it.
    uint64_t lo = 0, hi = uint64_t{1} << 32;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      int32_t count = 0;
      for (int i = 0; i < 4; ++i) count += v[i] == v[i] && sample_order_key(v[i]) >= mid ? 1 : 0;
      topk_step(mid, block_sum(count, sh.count_scratch), params.top_k, &lo, &hi);
    }
    bool keep[4];
    int32_t kept = 0;
    for (int i = 0; i < 4; ++i) {
      keep[i] = v[i] == v[i] && sample_order_key(v[i]) >= lo;
      kept += keep[i] ? 1 : 0;
    }
    // Inclusive scan of the threads' counts (Hillis-Steele), so the block's
    // candidates land in index order.
    sh.scan[t] = kept;
    __syncthreads();
    for (int32_t offset = 1; offset < kTokenThreads; offset *= 2) {
      const int32_t before = t >= offset ? sh.scan[t - offset] : 0;
      __syncthreads();
      sh.scan[t] += before;
      __syncthreads();
    }
    const int32_t total = sh.scan[kTokenThreads - 1];
    if (total <= kSampleCandidates) {
      int32_t at = block * kSampleCandidates + sh.scan[t] - kept;
      for (int i = 0; i < 4; ++i) {
        if (!keep[i]) continue;
        s.block_token[at] = first + i;
        s.block_logit[at] = v[i];
        ++at;
      }
    }
    if (t == 0) s.n_candidates[block] = total <= kSampleCandidates ? total : -1;
  }

  if (!last_block_done(tickets, gridDim.x, &sh.epilogue)) return;
  decide_token(logits, n, params, step, s, greedy, bounded, sh, token_out);
  if (end.step == nullptr) return;
  // The step's end, once its token is written (by one of the block's threads).
  __syncthreads();
  if (t == 0) {
    end.out_tokens[*end.step] = *token_out;
    ++*end.step;
    ++end.counters->steps;
  }
}

// A thread per logit.
__global__ void record_logits_kernel(const float* __restrict__ logits, int32_t n,
                                     const int32_t* __restrict__ step, int32_t record_steps,
                                     float* __restrict__ record) {
  wait_for_prior_grids();
  const int32_t i = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  const int32_t s = *step;
  if (i >= n || s >= record_steps) return;
  record[static_cast<int64_t>(s) * n + i] = logits[i];
}

}  // namespace

size_t sample_scratch_bytes(int32_t n) {
  const size_t blocks = static_cast<size_t>(sample_blocks(n));
  return 16 + 12 * blocks + 16 * blocks * kSampleCandidates;
}

cudaError_t launch_sample(const float* logits, int32_t n, const SamplingParams* params,
                          const int32_t* step, void* scratch, unsigned int* tickets,
                          int32_t* token_out, const StepEnd& end, cudaStream_t stream) {
  if (logits == nullptr || n <= 0 || n > kSampleBlockLogits * kTokenThreads || params == nullptr ||
      step == nullptr || scratch == nullptr || reinterpret_cast<uintptr_t>(scratch) % 16 != 0 ||
      tickets == nullptr || token_out == nullptr ||
      (end.step != nullptr && (end.step != step || end.out_tokens == nullptr ||
                               end.counters == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = sample_launch_geometry(n);
  return launch_kernel<sample_kernel>(g.grid, g.block, stream, logits, n, params,
                                      step, scratch, tickets, token_out, end);
}

cudaError_t launch_record_logits(const float* logits, int32_t n, const int32_t* step,
                                 int32_t record_steps, float* record, cudaStream_t stream) {
  if (logits == nullptr || n <= 0 || step == nullptr || record_steps <= 0 || record == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = record_logits_launch_geometry(n);
  return launch_kernel<record_logits_kernel>(g.grid, g.block, stream,
                                             logits, n, step, record_steps, record);
}

}  // namespace moegraph
