// The slot budget: how many expert slots the GPU pool gets. Pure arithmetic, so
// the start-up banner and the tests see exactly what the engine decides:
//   slots = min(requested, total experts,
//               (free VRAM - dense - KV at max context - scratch - rail) / block bytes)
// (with n engines sharing the device, (free VRAM - rail) / n in place of free VRAM - rail).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moegraph {

struct BudgetInputs {
  uint64_t free_vram_bytes = 0;
  uint64_t dense_bytes = 0;     // non-expert weights on the device
  uint64_t kv_bytes = 0;        // KV cache at max context (and a Gated DeltaNet state)
  uint64_t scratch_bytes = 0;   // activations and other per-step buffers
  uint64_t rail_bytes = 0;      // safety margin left free
  uint64_t block_bytes = 0;     // one slot: one expert of one layer, padded
  int64_t total_experts = 0;    // n_layer * n_expert
  int32_t k = 0;                // experts per step of one layer: the least a pool can hold
  int64_t requested_slots = 0;  // --slots; 0 = auto (as many as fit)
  // Engines that hold their pools at the same time (moegraph bench runs its arms
  // side by side): the free memory above the rail is split evenly among them, and
  // each pays its own dense weights, KV and scratch out of its share.
  int32_t sharing_engines = 1;
};

struct SlotBudget {
  int64_t slots = 0;
  std::string warning;  // empty, or why slots differs from a request
  std::string banner;   // one line showing the arithmetic
};

// Over-request scales down to what fits, with a warning; when every expert fits
// the pool holds them all. Errors: a request below k or a negative one (naming
// --slots), fewer than one sharing engine, a zero block size or bad counts, and
// memory for fewer than k slots (ResourceExhausted, naming the shortfall). Exact
// for any u64 inputs.
absl::StatusOr<SlotBudget> PlanSlots(const BudgetInputs& in);

}  // namespace moegraph
