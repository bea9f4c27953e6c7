// MoE kernels: the end of a step's routing record or replay, the residency
// steps, the stage-every-token arm's slots and the stage copy of missed
// experts (the router with its top-k and replay and the expert passes with the
// combine are kernels/matvec.cu). Decisions come from kernels/moe_math.h,
// residency/policy.h and residency/hazard_policy.h; this file holds the
// indexing and launch geometry.
//
// Grids never depend on per-step values: the expert passes and the stage copy
// launch a block row per rank (blockIdx.y = r) and a block whose rank is not in
// its pass returns at once, so one captured graph serves every hit/miss pattern.
#include "kernels/copy_ready.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/launch_geometry.h"
#include "kernels/moe_math.h"
#include "kernels/reduce.cuh"

namespace moegraph {
namespace {

// Threads and blocks: kernels/launch_geometry.h.
constexpr int kStageUnroll = 4;


// One block striding over the step's selection; thread 0 advances the cursor
// (and the replay's step) after the block has read it.
__global__ void routing_step_end_kernel(const int32_t* __restrict__ selection, int32_t n,
                                        int32_t* __restrict__ record, int64_t record_steps,
                                        int64_t* cursor, int64_t replay_steps,
                                        int64_t* replay_step) {
  wait_for_prior_grids();
  const int64_t step = *cursor;
  if (record != nullptr && step < record_steps) {
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) record[step * n + i] = selection[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *cursor = step + 1;
    if (replay_step != nullptr) *replay_step = (step + 1) % replay_steps;
  }
}

// The start of a policy step, by the whole block: the selection's keys to
// shared memory and to selected_keys, the outcome zeroed, then a barrier.
__device__ void begin_policy_step(int32_t layer, const int32_t* __restrict__ experts, int32_t k,
                                  int32_t n_expert, int32_t* keys,
                                  int32_t* __restrict__ selected_keys, StepOutcome* outcome) {
  for (int32_t r = threadIdx.x; r < k; r += blockDim.x) {
    keys[r] = residency_key(layer, experts[r], n_expert);
    selected_keys[r] = keys[r];
  }
  if (threadIdx.x == 0) *outcome = {0, 0, 0};
  __syncthreads();
}

// The end of a policy step, by one thread: its outcome into the counters.
__device__ void count_policy_step(const StepOutcome& outcome, DeviceCounters* counters) {
  atomicAdd(&counters->hits, static_cast<unsigned long long>(outcome.n_hits));
  atomicAdd(&counters->misses, static_cast<unsigned long long>(outcome.n_misses));
  atomicAdd(&counters->evictions, static_cast<unsigned long long>(outcome.n_evictions));
}

// Every miss of the step, in rank order, by the whole block. An admission puts
// its slot in the selection and changes no other slot's rank, so the j-th miss
// takes the j-th least rank: the first miss computes every rank with rank_of
// into rank_cache (one entry per slot of the pool), later ones take the least
// cached rank above the last victim's (ranks are unique). A thread reads back
// only the entries it wrote. Thread 0 admits each miss with admit(victim, r).
template <typename RankOf, typename Admit>
__device__ void admit_misses(int32_t slot_begin, int32_t n_slots, int32_t k,
                             const uint8_t* rank_missed, RankOf rank_of, Admit admit,
                             uint64_t* __restrict__ rank_cache, unsigned long long* rank_scratch,
                             int32_t* slot_scratch) {
  bool first_miss = true;
  unsigned long long last_victim_rank = 0;
  for (int32_t r = 0; r < k; ++r) {
    if (!rank_missed[r]) continue;
    unsigned long long best = ~0ull;
    int32_t best_slot = INT32_MAX;
    for (int32_t i = threadIdx.x; i < n_slots; i += blockDim.x) {
      unsigned long long rank;
      if (first_miss) {
        rank = rank_of(slot_begin + i);
        rank_cache[i] = rank;
      } else {
        rank = rank_cache[i];
        if (rank <= last_victim_rank) continue;
      }
      if (rank < best) {
        best = rank;
        best_slot = slot_begin + i;
      }
    }
    block_argmin(&best, &best_slot, rank_scratch, slot_scratch);
    first_miss = false;
    last_victim_rank = best;
    if (threadIdx.x == 0) admit(best_slot, r);
    __syncthreads();
  }
}

// One block. Thread 0 runs every state change in residency_step's order; the
// block finds the slot argmins (demotion on a promotion overflow, victim per
// miss) between barriers, so the result equals the sequential step exactly.
__global__ void __launch_bounds__(kResidencyStepThreads)
    residency_step_kernel(ResidencyState s, ResidencyPool pool, int32_t layer,
                          const int32_t* __restrict__ experts, int32_t k,
                          int32_t* __restrict__ selected_keys, int32_t* __restrict__ slot_of_rank,
                          uint8_t* __restrict__ missed, int32_t* __restrict__ evicted_keys,
                          uint64_t* __restrict__ rank_cache, DeviceCounters* counters) {
  wait_for_prior_grids();
  __shared__ int32_t keys[kMaxTopK];
  __shared__ uint8_t rank_missed[kMaxTopK];
  __shared__ bool demotion_due;
  __shared__ StepOutcome outcome;
  __shared__ unsigned long long rank_scratch[32];
  __shared__ int32_t slot_scratch[32];
  const int tid = threadIdx.x;
  const int32_t slot_end = pool.slot_begin + pool.n_slots;
  begin_policy_step(layer, experts, k, s.n_expert, keys, selected_keys, &outcome);

  // 1. Hits, in rank order.
  for (int32_t r = 0; r < k; ++r) {
    if (tid == 0) {
      const int32_t slot = s.table[keys[r]];
      rank_missed[r] = slot == kNoSlot ? 1 : 0;
      missed[r] = rank_missed[r];
      slot_of_rank[r] = slot;
      demotion_due = slot != kNoSlot && hit_refresh(s, pool, slot);
      if (slot != kNoSlot) ++outcome.n_hits;
    }
    __syncthreads();
    if (demotion_due) {
      unsigned long long best = ~0ull;
      int32_t best_slot = INT32_MAX;
      for (int32_t slot = pool.slot_begin + tid; slot < slot_end; slot += blockDim.x) {
        const unsigned long long rank = demotion_rank(s, slot);
        if (rank < best) {
          best = rank;
          best_slot = slot;
        }
      }
      block_argmin(&best, &best_slot, rank_scratch, slot_scratch);
      if (tid == 0) demote(s, pool, best_slot);
    }
    // Every thread has read demotion_due before thread 0 writes the next rank's.
    __syncthreads();
  }

  // 2. Misses, in rank order.
  admit_misses(
      pool.slot_begin, pool.n_slots, k, rank_missed,
      [&](int32_t slot) { return victim_rank(s, slot, keys, k); },
      [&](int32_t victim, int32_t r) {
        admit_miss(s, pool, victim, keys[r], evicted_keys, &outcome);
        slot_of_rank[r] = victim;
      },
      rank_cache, rank_scratch, slot_scratch);

  if (tid == 0) count_policy_step(outcome, counters);
}

// One block. A thread per expert observes the visit, the table rebuild runs in
// its phases (a thread per index), a thread per rank finds the hits, then each
// miss in rank order takes the block's argmin of hazard_victim_rank.
__global__ void __launch_bounds__(kHazardStepThreads)
    hazard_step_kernel(HazardState s, HazardPool pool, int32_t layer,
                       const int32_t* __restrict__ experts, int32_t k,
                       int32_t* __restrict__ selected_keys, int32_t* __restrict__ slot_of_rank,
                       uint8_t* __restrict__ missed, int32_t* __restrict__ evicted_keys,
                       uint64_t* __restrict__ rank_cache, DeviceCounters* counters) {
  wait_for_prior_grids();
  __shared__ int32_t keys[kMaxTopK];
  __shared__ uint8_t rank_missed[kMaxTopK];
  __shared__ StepOutcome outcome;
  __shared__ unsigned long long rank_scratch[32];
  __shared__ int32_t slot_scratch[32];
  const int tid = threadIdx.x;
  begin_policy_step(layer, experts, k, s.n_expert, keys, selected_keys, &outcome);

  // Observe: every expert of the layer counts in its cell before its update.
  for (int32_t e = tid; e < s.n_expert; e += blockDim.x) {
    const int32_t key = residency_key(layer, e, s.n_expert);
    const bool selected = key_in_selection(key, keys, k);
    const int32_t cell = hazard_observe_key(s, key, selected);
    atomicAdd(&s.cell_trials[cell], 1u);
    if (selected) atomicAdd(&s.cell_hits[cell], 1u);
  }
  __syncthreads();
  if (tid == 0) ++s.visits[layer];
  for (int32_t cell = tid; cell < kHazardCells; cell += blockDim.x) hazard_cell_rate(s, cell);
  __syncthreads();
  if (tid < kHazardFrequencyCols) hazard_project_recency(s, tid);
  __syncthreads();
  if (tid < kHazardRecencyRows) hazard_project_frequency(s, tid);
  __syncthreads();
  for (int32_t cell = tid; cell < kHazardCells; cell += blockDim.x) hazard_rate_to_cost(s, cell);

  // Hits change no state.
  for (int32_t r = tid; r < k; r += blockDim.x) {
    const int32_t slot = s.table[keys[r]];
    rank_missed[r] = slot == kNoSlot ? 1 : 0;
    missed[r] = rank_missed[r];
    slot_of_rank[r] = slot;
    if (slot != kNoSlot) atomicAdd(&outcome.n_hits, 1);
  }
  __syncthreads();

  // Misses, in rank order (admit_misses).
  admit_misses(
      pool.slot_begin, pool.n_slots, k, rank_missed,
      [&](int32_t slot) { return hazard_victim_rank(s, slot, layer, keys, k); },
      [&](int32_t victim, int32_t r) {
        hazard_admit(s, victim, keys[r], evicted_keys, &outcome);
        slot_of_rank[r] = victim;
      },
      rank_cache, rank_scratch, slot_scratch);

  if (tid == 0) count_policy_step(outcome, counters);
}

__global__ void stage_all_slots_kernel(int32_t k, int32_t* __restrict__ slot_of_rank,
                                       uint8_t* __restrict__ missed) {
  wait_for_prior_grids();
  const int32_t r = threadIdx.x;
  if (r >= k) return;
  slot_of_rank[r] = r;
  missed[r] = 1;
}

// Grid (kStageCopyBlocksPerExpert, k): the CTAs of rank r stride over the block's
// 16-byte chunks, kStageUnroll loads in flight per thread before the stores.
// The last CTA of a rank to finish (its ticket) marks the rank copied.
__global__ void stage_copy_kernel(const uint4* __restrict__ host_blocks, size_t block_bytes,
                                  const int32_t* __restrict__ experts,
                                  const int32_t* __restrict__ slot_of_rank, uint8_t* missed,
                                  uint4* __restrict__ slots, unsigned int* __restrict__ tickets,
                                  DeviceCounters* counters) {
  wait_for_prior_grids();
  __shared__ bool last;
  const int32_t r = blockIdx.y;
  if (missed[r] == kRankHit) return;
  const size_t n_chunks = block_bytes / 16;
  const uint4* src = host_blocks + static_cast<size_t>(experts[r]) * n_chunks;
  uint4* dst = slots + static_cast<size_t>(slot_of_rank[r]) * n_chunks;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < n_chunks;
       base += stride * kStageUnroll) {
    uint4 chunk[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const size_t i = base + u * stride;
      if (i < n_chunks) chunk[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const size_t i = base + u * stride;
      if (i < n_chunks) dst[i] = chunk[u];
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&tickets[r], 1u) == gridDim.x - 1;
    if (last) {
      tickets[r] = 0;
      __threadfence();  // every CTA's copy, seen through the tickets, before the flag
      mark_rank_copied(missed + r);
      atomicAdd(&counters->bytes_staged, static_cast<unsigned long long>(block_bytes));
    }
  }
}

}  // namespace

cudaError_t launch_routing_step_end(const int32_t* selection, int32_t n, int32_t* record,
                                    int64_t record_steps, int64_t* cursor, int64_t replay_steps,
                                    int64_t* replay_step, cudaStream_t stream) {
  if (selection == nullptr || n <= 0 || record_steps < 0 || cursor == nullptr ||
      (record == nullptr && record_steps > 0) || (replay_step != nullptr && replay_steps <= 0)) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = routing_step_end_launch_geometry();
  return launch_kernel<routing_step_end_kernel>(g.grid, g.block, stream, selection, n, record,
                                                record_steps, cursor, replay_steps, replay_step);
}

cudaError_t launch_residency_step(const ResidencyState& state, const ResidencyPool& pool,
                                  int32_t layer, const int32_t* experts, int32_t k,
                                  int32_t* selected_keys, int32_t* slot_of_rank, uint8_t* missed,
                                  int32_t* evicted_keys, uint64_t* rank_cache,
                                  DeviceCounters* counters, cudaStream_t stream) {
  if (state.table == nullptr || state.owner == nullptr || state.stamp == nullptr ||
      state.seg == nullptr || state.n_expert <= 0 || pool.n_protected == nullptr ||
      pool.clock == nullptr || pool.slot_begin < 0 || pool.n_slots < k || layer < 0 ||
      experts == nullptr || k <= 0 || k > kMaxTopK || selected_keys == nullptr ||
      slot_of_rank == nullptr || missed == nullptr || evicted_keys == nullptr ||
      rank_cache == nullptr || counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = residency_step_launch_geometry();
  return launch_kernel<residency_step_kernel>(g.grid, g.block, stream, state, pool, layer,
                                              experts, k, selected_keys, slot_of_rank, missed,
                                              evicted_keys, rank_cache, counters);
}

cudaError_t launch_hazard_step(const HazardState& state, const HazardPool& pool, int32_t layer,
                               const int32_t* experts, int32_t k, int32_t* selected_keys,
                               int32_t* slot_of_rank, uint8_t* missed, int32_t* evicted_keys,
                               uint64_t* rank_cache, DeviceCounters* counters,
                               cudaStream_t stream) {
  if (state.table == nullptr || state.owner == nullptr || state.last_visit == nullptr ||
      state.frequency == nullptr || state.long_frequency == nullptr || state.visits == nullptr ||
      state.cell_hits == nullptr ||
      state.cell_trials == nullptr || state.cell_cost == nullptr || state.n_expert <= 0 ||
      layer < 0 || layer >= state.n_layer || pool.slot_begin < 0 || pool.n_slots < k ||
      pool.slot_begin + pool.n_slots > kHazardMaxSlots || experts == nullptr || k <= 0 ||
      k > kMaxTopK || selected_keys == nullptr || slot_of_rank == nullptr || missed == nullptr ||
      evicted_keys == nullptr || rank_cache == nullptr || counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = hazard_step_launch_geometry();
  return launch_kernel<hazard_step_kernel>(g.grid, g.block, stream, state, pool, layer, experts,
                                           k, selected_keys, slot_of_rank, missed, evicted_keys,
                                           rank_cache, counters);
}

cudaError_t launch_stage_all_slots(int32_t k, int32_t* slot_of_rank, uint8_t* missed,
                                   cudaStream_t stream) {
  if (k <= 0 || k > kMaxTopK || slot_of_rank == nullptr || missed == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = rank_threads_launch_geometry();
  return launch_kernel<stage_all_slots_kernel>(g.grid, g.block, stream, k, slot_of_rank, missed);
}

cudaError_t launch_stage_copy(const uint8_t* host_blocks, const DeviceBlockLayout& layout,
                              const int32_t* experts, const int32_t* slot_of_rank, uint8_t* missed,
                              int32_t k, uint8_t* slots, unsigned int* tickets,
                              DeviceCounters* counters, cudaStream_t stream) {
  if (host_blocks == nullptr || layout.block_bytes == 0 || layout.block_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(host_blocks) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(slots) % 16 != 0 || experts == nullptr ||
      slot_of_rank == nullptr || missed == nullptr || k <= 0 || k > kMaxTopK || slots == nullptr ||
      tickets == nullptr || counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchGeometry g = stage_copy_launch_geometry(k);
  return launch_kernel<stage_copy_kernel>(
      g.grid, g.block, stream, reinterpret_cast<const uint4*>(host_blocks),
      layout.block_bytes, experts, slot_of_rank, missed, reinterpret_cast<uint4*>(slots), tickets,
      counters);
}

}  // namespace moegraph
