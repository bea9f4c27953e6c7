// The "hazard" residency policy in array form: victims by predicted reuse, for
// a pool shared by every layer of a layer-cyclic decode (docs/POLICY.md).
//
// A decode step visits layers 0..L-1 in order, so a key (layer, expert) can only
// be used again at its layer's next visit. For every key the policy keeps how
// many visits of its layer passed since it was last selected (recency), a short
// EWMA of its selections (frequency, a memory of about 20 visits) and a long one
// (long_frequency, the mean over the last 256 visits). A 12 x 10 table of
// (recency row, frequency column) cells learns online, from every key of a layer
// at every visit, the chance h that a key in that cell is selected at the next
// visit (an empty cell predicts the base rate k / E). The column reads the short
// EWMA while the key was selected recently enough for it to hold information,
// and the long one from kHazardLongFrequencyRow on, where the short EWMA of
// every key has decayed into the first column. The table is projected to be
// non-increasing in recency and non-decreasing in frequency, so recency and
// frequency can only help (this is what keeps LRU's behaviour where LRU is
// right). A resident key's expected steps to its next use are
//   d + L * (1 - h) / h,  d = steps until its layer's next visit (1..L),
// the mean of a geometric wait; the victim is the slot that maximises it (Belady
// with a prediction), found as an argmin of a packed 64-bit rank. On the GPU the
// observation is one thread per expert (atomicAdd on the cell counters), the
// table rebuild one block (four phases), the victim search a block-wide min
// (or atomicMin).
//
// Integer state and round-to-nearest float ops only (no contraction-prone
// multiply-add), so the CPU and the device pick the same victims; the kernel must
// not be built with fast math. Light on purpose: .cu files include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "loader/host_device.h"
#include "residency/policy.h"

// The device must divide and round as the host does (see above).
#if defined(__CUDA_ARCH__) && defined(__USE_FAST_MATH__)
#error "residency/hazard_policy.h needs IEEE float ops: do not build it with --use_fast_math"
#endif

namespace moegraph {

inline constexpr int32_t kHazardRecencyRows = 12;
inline constexpr int32_t kHazardFrequencyCols = 10;
inline constexpr int32_t kHazardCells = kHazardRecencyRows * kHazardFrequencyCols;
// Frequency is Q16 fixed point: 1 << 16 is "selected at every visit".
inline constexpr uint32_t kHazardFrequencyOne = 1u << 16;
// Long frequency is Q24, so that its slow decay does not stall in the rounding.
inline constexpr uint32_t kHazardLongFrequencyOne = 1u << 24;
// The long frequency averages the last this many visits of the key's layer.
inline constexpr uint32_t kHazardLongFrequencyVisits = 256;
// First recency row (31-60 visits) whose column reads the long frequency. One
// selection adds 1/20 to the short EWMA, which falls below the first column
// edge (0.01) after 31 visits: from there on the short EWMA puts almost every
// key in column 0, the table cannot tell cold keys apart, and the victim among
// them would be picked by layer position alone.
inline constexpr int32_t kHazardLongFrequencyRow = 8;
// A cell's counts are halved when its trials reach this, so the table follows
// drift over about a million observations per cell and never overflows.
inline constexpr uint32_t kHazardCountCap = 1u << 20;
// The rank packs the slot index into 15 bits: 32768 slots, more than any
// current MoE has keys (Kimi K2: 60 x 384 = 23040).
inline constexpr int32_t kHazardMaxSlots = 1 << 15;

// State shared by every pool. Pointers, so host or device memory can back it.
struct HazardState {
  int32_t* table;            // [n_layer * n_expert]: slot holding the key, or kNoSlot
  int32_t* owner;            // [n_slots]: key held, or kNoKey
  int32_t* last_visit;       // [n_layer * n_expert]: visit of its layer that last chose it, or -1
  uint32_t* frequency;       // [n_layer * n_expert]: EWMA of selection, Q16
  uint32_t* long_frequency;  // [n_layer * n_expert]: mean of selection, Q24 (see below)
  int32_t* visits;           // [n_layer]: visits of each layer so far
  uint32_t* cell_hits;       // [kHazardCells]: observations selected at the visit
  uint32_t* cell_trials;     // [kHazardCells]: observations
  float* cell_cost;          // [kHazardCells]: L * (1 - h) / h, the expected extra wait
  int32_t n_layer;
  int32_t n_expert;
  int32_t k;  // experts selected per layer visit
};

// Slots [slot_begin, slot_begin + n_slots): every slot for one global pool, or
// one layer's share when pools are per layer.
struct HazardPool {
  int32_t slot_begin;
  int32_t n_slots;
};

// Recency row of a key whose layer had `visits_since` visits since its last
// selection (>= 1), or -1 when never selected. Rows: 1, 2, 3, 4, 5-6, 7-9,
// 10-15, 16-30, 31-60, 61-120, 121-250, then "longer or never": fine where
// reuse is likely, coarse (about doubling) where it is rare.
MG_HD inline int32_t hazard_recency_row(int32_t visits_since) {
  constexpr int32_t kUpper[kHazardRecencyRows - 1] = {1, 2, 3, 4, 6, 9, 15, 30, 60, 120, 250};
  if (visits_since < 0) return kHazardRecencyRows - 1;
  for (int32_t row = 0; row < kHazardRecencyRows - 1; ++row) {
    if (visits_since <= kUpper[row]) return row;
  }
  return kHazardRecencyRows - 1;
}

// Frequency column: Q16 upper bounds 0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.45, 0.65.
MG_HD inline int32_t hazard_frequency_col(uint32_t frequency) {
  constexpr uint32_t kBelow[kHazardFrequencyCols - 1] = {655,   1966,  3932,  6554, 9830,
                                                         13107, 19661, 29491, 42598};
  for (int32_t col = 0; col < kHazardFrequencyCols - 1; ++col) {
    if (frequency < kBelow[col]) return col;
  }
  return kHazardFrequencyCols - 1;
}

// EWMA with weight 1/20 on the newest visit (a memory of about 20 tokens).
MG_HD inline uint32_t hazard_next_frequency(uint32_t frequency, bool selected) {
  constexpr uint32_t kStep = (kHazardFrequencyOne + 10) / 20;
  return frequency - frequency / 20 + (selected ? kStep : 0u);
}

// The long frequency after the layer's visit number `visit` (0 for its first):
// weight 1 / min(visit + 1, kHazardLongFrequencyVisits) on the newest visit, so
// it is the plain mean of the visits so far until it becomes an EWMA, and it is
// never biased toward 0 early in a run. Stays <= kHazardLongFrequencyOne.
MG_HD inline uint32_t hazard_next_long_frequency(uint32_t long_frequency, bool selected,
                                                 int32_t visit) {
  const uint32_t n = static_cast<uint32_t>(visit) + 1u < kHazardLongFrequencyVisits
                         ? static_cast<uint32_t>(visit) + 1u
                         : kHazardLongFrequencyVisits;
  return long_frequency - long_frequency / n + (selected ? kHazardLongFrequencyOne / n : 0u);
}

// The cell whose hazard predicts the key's next visit.
MG_HD inline int32_t hazard_cell(const HazardState& s, int32_t key) {
  const int32_t layer = key / s.n_expert;
  const int32_t last = s.last_visit[key];
  const int32_t row = hazard_recency_row(last < 0 ? -1 : s.visits[layer] - last);
  // The long frequency is Q24; >> 8 puts it on the Q16 column edges.
  const uint32_t frequency =
      row < kHazardLongFrequencyRow ? s.frequency[key] : s.long_frequency[key] >> 8;
  return row * kHazardFrequencyCols + hazard_frequency_col(frequency);
}

// One key at its layer's visit: returns the cell the outcome counts in (add 1
// to its trials, and to its hits when selected), then advances the key's state.
// Call for every expert of the layer, then increment visits[layer] and rebuild.
MG_HD inline int32_t hazard_observe_key(const HazardState& s, int32_t key, bool selected) {
  const int32_t cell = hazard_cell(s, key);
  const int32_t visit = s.visits[key / s.n_expert];
  s.frequency[key] = hazard_next_frequency(s.frequency[key], selected);
  s.long_frequency[key] = hazard_next_long_frequency(s.long_frequency[key], selected, visit);
  if (selected) s.last_visit[key] = visit;
  return cell;
}

// The table rebuild in four phases. Each phase is independent across its
// index, so a GPU block runs one thread per index with a barrier between phases
// and gets the bits of the sequential hazard_rebuild_costs.

// Phase 1, per cell: halves a full cell and writes its hazard to cell_cost, with
// a prior of two observations at the base rate k / E: an empty cell predicts
// the average expert, and no cell predicts 0 or 1.
MG_HD inline void hazard_cell_rate(const HazardState& s, int32_t cell) {
  if (s.cell_trials[cell] >= kHazardCountCap) {
    s.cell_trials[cell] /= 2;
    s.cell_hits[cell] /= 2;
  }
  const float base_rate_twice = static_cast<float>(2 * s.k) / static_cast<float>(s.n_expert);
  s.cell_cost[cell] = (static_cast<float>(s.cell_hits[cell]) + base_rate_twice) /
                      static_cast<float>(s.cell_trials[cell] + 2);
}

// Phase 2, per frequency column: hazards non-increasing down the recency rows.
MG_HD inline void hazard_project_recency(const HazardState& s, int32_t col) {
  for (int32_t row = 1; row < kHazardRecencyRows; ++row) {
    float& h = s.cell_cost[row * kHazardFrequencyCols + col];
    const float above = s.cell_cost[(row - 1) * kHazardFrequencyCols + col];
    if (above < h) h = above;
  }
}

// Phase 3, per recency row: hazards non-decreasing along frequency.
MG_HD inline void hazard_project_frequency(const HazardState& s, int32_t row) {
  for (int32_t col = 1; col < kHazardFrequencyCols; ++col) {
    float& h = s.cell_cost[row * kHazardFrequencyCols + col];
    const float left = s.cell_cost[row * kHazardFrequencyCols + col - 1];
    if (left > h) h = left;
  }
}

// Phase 4, per cell: the hazard h becomes the expected extra wait L * (1 - h) / h.
MG_HD inline void hazard_rate_to_cost(const HazardState& s, int32_t cell) {
  const float h = s.cell_cost[cell];
  const float wait = static_cast<float>(s.n_layer) * (1.0f - h);
  s.cell_cost[cell] = wait / h;
}

// Halves full cells, projects the hazards to be monotone and writes the costs.
MG_HD inline void hazard_rebuild_costs(const HazardState& s) {
  for (int32_t cell = 0; cell < kHazardCells; ++cell) hazard_cell_rate(s, cell);
  for (int32_t col = 0; col < kHazardFrequencyCols; ++col) hazard_project_recency(s, col);
  for (int32_t row = 0; row < kHazardRecencyRows; ++row) hazard_project_frequency(s, row);
  for (int32_t cell = 0; cell < kHazardCells; ++cell) hazard_rate_to_cost(s, cell);
}

// The whole observation of one layer's visit, sequentially.
MG_HD inline void hazard_observe_layer(const HazardState& s, int32_t layer,
                                       const int32_t* selected_keys, int32_t k) {
  for (int32_t e = 0; e < s.n_expert; ++e) {
    const int32_t key = residency_key(layer, e, s.n_expert);
    const bool selected = key_in_selection(key, selected_keys, k);
    const int32_t cell = hazard_observe_key(s, key, selected);
    ++s.cell_trials[cell];
    if (selected) ++s.cell_hits[cell];
  }
  ++s.visits[layer];
  hazard_rebuild_costs(s);
}

// Expected steps from the visit of `current_layer` to the key's next use.
MG_HD inline float hazard_expected_wait(const HazardState& s, int32_t key,
                                        int32_t current_layer) {
  const int32_t layer = key / s.n_expert;
  const int32_t steps_to_visit = (layer - current_layer - 1 + s.n_layer) % s.n_layer + 1;
  return static_cast<float>(steps_to_visit) + s.cell_cost[hazard_cell(s, key)];
}

// Mantissa bits of the expected wait the rank keeps: waits within about 0.4% of
// each other tie. The table's cells are coarse in age (rows up to 130 visits
// wide), so for a far key the d term is finer than the prediction it is added to;
// such near-ties are better broken by the key's own long frequency and age.
inline constexpr uint32_t kHazardWaitMantissaBits = 8;

// Eviction order for the current selection, unique per slot: empty slots first
// (lowest index first); then occupied slots by expected wait rounded down to
// kHazardWaitMantissaBits, longest first, then by long frequency, lowest first,
// then by visits since the last selection, most first, then by slot index; a slot
// holding a key of the selection is never a victim. Bits: 63 class, 47..62
// inverted rounded wait (a positive float's bits order like its value), 23..46
// long frequency (24 bits), 15..22 inverted age, 0..14 slot. A wait is at least
// 1, so the wait field is below 0x8100 and no rank reaches kNotAVictim.
MG_HD inline uint64_t hazard_victim_rank(const HazardState& s, int32_t slot,
                                         int32_t current_layer, const int32_t* selected_keys,
                                         int32_t k) {
  const int32_t key = s.owner[slot];
  if (key == kNoKey) return static_cast<uint64_t>(slot);
  if (key_in_selection(key, selected_keys, k)) return kNotAVictim;
  const float wait = hazard_expected_wait(s, key, current_layer);
  uint32_t wait_bits;
  memcpy(&wait_bits, &wait, sizeof(wait_bits));
  const uint32_t long_frequency = s.long_frequency[key];
  const uint32_t frequency_bits = long_frequency < 0xffffffu ? long_frequency : 0xffffffu;
  // A resident key was selected when it was admitted, so last_visit is set.
  const int32_t age = s.visits[key / s.n_expert] - s.last_visit[key];
  const uint32_t age_byte = age < 255 ? static_cast<uint32_t>(age) : 255u;
  const uint32_t rounded_wait = (0x7fffffffu - wait_bits) >> (23 - kHazardWaitMantissaBits);
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(rounded_wait) << 47) |
         (static_cast<uint64_t>(frequency_bits) << 23) |
         (static_cast<uint64_t>(255u - age_byte) << 15) | static_cast<uint64_t>(slot);
}

MG_HD inline int32_t hazard_find_victim(const HazardState& s, const HazardPool& pool,
                                        int32_t current_layer, const int32_t* selected_keys,
                                        int32_t k) {
  int32_t best = kNoSlot;
  uint64_t best_rank = kNotAVictim;
  for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
    const uint64_t rank = hazard_victim_rank(s, slot, current_layer, selected_keys, k);
    if (rank < best_rank) {
      best_rank = rank;
      best = slot;
    }
  }
  return best;
}

// A miss of `key` takes slot `victim`: its key (if any) is evicted and recorded.
MG_HD inline void hazard_admit(const HazardState& s, int32_t victim, int32_t key,
                               int32_t* evicted_keys, StepOutcome* out) {
  const int32_t old_key = s.owner[victim];
  if (old_key != kNoKey) {
    s.table[old_key] = kNoSlot;
    evicted_keys[out->n_evictions++] = old_key;
  }
  s.owner[victim] = key;
  s.table[key] = victim;
  ++out->n_misses;
}

// One layer's step, with the outputs of residency_step: per rank r,
// slot_of_rank[r] and missed[r] (admitted now, to be staged), and the evicted
// keys. First-miss admit: a miss always takes a slot, so the engine needs no
// bypass area. Requires pool.n_slots >= k and pool.n_slots <= kHazardMaxSlots.
MG_HD inline StepOutcome hazard_step(const HazardState& s, const HazardPool& pool, int32_t layer,
                                     const int32_t* experts, int32_t k, int32_t* selected_keys,
                                     int32_t* slot_of_rank, uint8_t* missed,
                                     int32_t* evicted_keys) {
  StepOutcome out = {0, 0, 0};
  for (int32_t r = 0; r < k; ++r) selected_keys[r] = selected_key(layer, experts[r], s.n_expert);
  hazard_observe_layer(s, layer, selected_keys, k);
  for (int32_t r = 0; r < k; ++r) {
    const int32_t slot = selected_keys[r] == kNoKey ? kNoSlot : s.table[selected_keys[r]];
    missed[r] = slot == kNoSlot && selected_keys[r] != kNoKey ? 1 : 0;
    slot_of_rank[r] = slot;
    if (slot != kNoSlot) ++out.n_hits;
  }
  // Ranks do not change within a step, so these victims are the lowest ranks
  // of the step: one top-m pass on the GPU.
  for (int32_t r = 0; r < k; ++r) {
    if (!missed[r]) continue;
    const int32_t victim = hazard_find_victim(s, pool, layer, selected_keys, k);
    hazard_admit(s, victim, selected_keys[r], evicted_keys, &out);
    slot_of_rank[r] = victim;
  }
  return out;
}

}  // namespace moegraph
