// The residency policy in array form: the canonical spec of the design (SLRU
// with a protected segment of P slots; P = 0 is LRU), as state arrays plus a
// step over one layer's selection. The same code runs on the CPU (simulator,
// CPU backend) and in the CUDA residency kernel.
//
// The victim search is an argmin of victim_rank() over the pool's slots: a loop
// here, a block-wide reduction on the GPU. Ranks are unique (empty slots by
// index, occupied ones by their unique stamps), so both give the same slot.
// Light on purpose: .cu files include it.
#pragma once

#include <cstdint>

#include "loader/host_device.h"

namespace moegraph {

inline constexpr int32_t kNoSlot = -1;
inline constexpr int32_t kNoKey = -1;
// In a selection: a rank whose routing was dropped (--drop-cold-experts): no
// key, no hit, no admission; its slot_of_rank is kNoSlot. The CPU backend's
// only; the CUDA engine never drops.
inline constexpr int32_t kNoExpert = -1;
inline constexpr uint8_t kProbation = 0;
inline constexpr uint8_t kProtected = 1;
inline constexpr uint64_t kNotAVictim = ~uint64_t{0};

// Key of (layer, expert) in the table.
MG_HD inline int32_t residency_key(int32_t layer, int32_t expert, int32_t n_expert) {
  return layer * n_expert + expert;
}

// One pool: slots [slot_begin, slot_begin + n_slots) of the shared slot arrays,
// with its own protected segment, count and clock. A global pool covers every
// slot; a per-layer partition has one pool per layer.
struct ResidencyPool {
  int32_t slot_begin;
  int32_t n_slots;
  int32_t protected_cap;  // P = floor(n_slots * protected_frac)
  int32_t* n_protected;   // one value in memory
  uint64_t* clock;        // one value in memory
};

// The state every pool shares. Pointers, so host or device memory can back it.
struct ResidencyState {
  int32_t* table;   // [n_layer * n_expert]: slot holding the key, or kNoSlot
  int32_t* owner;   // [n_slots total]: key held, or kNoKey
  uint64_t* stamp;  // [n_slots total]: recency; larger is more recent
  uint8_t* seg;     // [n_slots total]: kProbation or kProtected
  int32_t n_expert;
};

// What one step did, rank by rank, for the expert passes and the stage copy.
struct StepOutcome {
  int32_t n_hits;
  int32_t n_misses;
  int32_t n_evictions;
};

MG_HD inline bool key_in_selection(int32_t key, const int32_t* selected_keys, int32_t k) {
  for (int32_t r = 0; r < k; ++r) {
    if (selected_keys[r] == key) return true;
  }
  return false;
}

// Eviction order of a slot for the current selection: empty slots first (lowest
// index first), then probation by stamp, then protected by stamp; a slot holding
// a key of the selection is never a victim.
MG_HD inline uint64_t victim_rank(const ResidencyState& s, int32_t slot,
                                  const int32_t* selected_keys, int32_t k) {
  const int32_t key = s.owner[slot];
  if (key == kNoKey) return static_cast<uint64_t>(slot);
  if (key_in_selection(key, selected_keys, k)) return kNotAVictim;
  // Stamps stay below 2^62 (a clock tick per key touch), so the classes never mix.
  const uint64_t segment_class = s.seg[slot] == kProbation ? 1 : 2;
  return (segment_class << 62) | s.stamp[slot];
}

MG_HD inline int32_t find_victim(const ResidencyState& s, const ResidencyPool& pool,
                                 const int32_t* selected_keys, int32_t k) {
  int32_t best = kNoSlot;
  uint64_t best_rank = kNotAVictim;
  for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
    const uint64_t rank = victim_rank(s, slot, selected_keys, k);
    if (rank < best_rank) {
      best_rank = rank;
      best = slot;
    }
  }
  return best;
}

// The protected slot with the least stamp (the one demoted when the protected
// segment overflows); kNoSlot when none is protected.
MG_HD inline int32_t oldest_protected(const ResidencyState& s, const ResidencyPool& pool) {
  int32_t best = kNoSlot;
  for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
    if (s.owner[slot] == kNoKey || s.seg[slot] != kProtected) continue;
    if (best == kNoSlot || s.stamp[slot] < s.stamp[best]) best = slot;
  }
  return best;
}

// A hit on slot: promote from probation (demoting the oldest protected slot if
// the segment overflows) or refresh in the protected segment.
MG_HD inline void touch_hit(const ResidencyState& s, const ResidencyPool& pool, int32_t slot) {
  s.stamp[slot] = (*pool.clock)++;
  if (s.seg[slot] == kProtected) return;
  s.seg[slot] = kProtected;
  if (++*pool.n_protected > pool.protected_cap) {
    const int32_t demoted = oldest_protected(s, pool);
    s.seg[demoted] = kProbation;
    s.stamp[demoted] = (*pool.clock)++;
    --*pool.n_protected;
  }
}

// The key of rank r's expert in a selection, kNoKey for a dropped rank.
MG_HD inline int32_t selected_key(int32_t layer, int32_t expert, int32_t n_expert) {
  return expert == kNoExpert ? kNoKey : residency_key(layer, expert, n_expert);
}

// One layer's step. experts: the k distinct selected ids in router rank order
// (kNoExpert for a dropped rank).
// Writes, per rank r: slot_of_rank[r] (where expert r lives after the step) and
// missed[r] (1 when it was admitted this step and must be staged), and the keys
// evicted (evicted_keys[0 .. n_evictions)). Requires pool.n_slots >= k.
MG_HD inline StepOutcome residency_step(const ResidencyState& s, const ResidencyPool& pool,
                                        int32_t layer, const int32_t* experts, int32_t k,
                                        int32_t* selected_keys, int32_t* slot_of_rank,
                                        uint8_t* missed, int32_t* evicted_keys) {
  StepOutcome out = {0, 0, 0};
  for (int32_t r = 0; r < k; ++r) selected_keys[r] = selected_key(layer, experts[r], s.n_expert);
  // 1. Hits, in rank order.
  for (int32_t r = 0; r < k; ++r) {
    const int32_t slot = selected_keys[r] == kNoKey ? kNoSlot : s.table[selected_keys[r]];
    if (selected_keys[r] == kNoKey) {  // dropped: neither a hit nor a miss
      missed[r] = 0;
      slot_of_rank[r] = kNoSlot;
      continue;
    }
    missed[r] = slot == kNoSlot ? 1 : 0;
    slot_of_rank[r] = slot;
    if (slot == kNoSlot) continue;
    touch_hit(s, pool, slot);
    ++out.n_hits;
  }
  // 2. Misses, in rank order.
  for (int32_t r = 0; r < k; ++r) {
    if (!missed[r]) continue;
    const int32_t victim = find_victim(s, pool, selected_keys, k);
    const int32_t old_key = s.owner[victim];
    if (old_key != kNoKey) {
      s.table[old_key] = kNoSlot;
      if (s.seg[victim] == kProtected) --*pool.n_protected;
      evicted_keys[out.n_evictions++] = old_key;
    }
    s.owner[victim] = selected_keys[r];
    s.table[selected_keys[r]] = victim;
    s.seg[victim] = kProbation;
    s.stamp[victim] = (*pool.clock)++;
    slot_of_rank[r] = victim;
    ++out.n_misses;
  }
  return out;
}

}  // namespace moegraph
