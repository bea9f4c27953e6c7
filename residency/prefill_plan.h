// Where a prompt's experts come from (issue 20): one ubatch of T tokens through
// one MoE layer. The ubatch's routing (k experts per token, read back once per
// layer) is grouped by expert, each expert's tokens in ascending order; an
// expert resident in a slot is read in place, every other routed expert is
// streamed through a ring of staging buffers, each once. The plan reads the
// layer's slot table and never writes it: prefill admits nothing, evicts
// nothing and stamps nothing, so the decode set survives any prompt.
//
// The experts' outputs land per (token, rank) and are combined per token in
// rank order, so the floats do not depend on the grouping or on which experts
// were in place.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moegraph {

struct PrefillGroup {
  int32_t expert = 0;
  int32_t slot = -1;         // the slot it is read from in place, or kNoSlot
  int32_t ring_buffer = -1;  // streamed: the ring buffer it is copied into; -1 in place
  int32_t first = 0;         // its entries in PrefillLayerPlan::entries
  int32_t count = 0;
};

struct PrefillLayerPlan {
  // The routed experts in ascending id, in place or streamed.
  std::vector<PrefillGroup> groups;
  // token * k + rank per group, each group's in ascending token order: every
  // (token, rank) of the ubatch exactly once.
  std::vector<int32_t> entries;
  int32_t in_place = 0;
  int32_t streamed = 0;
  uint64_t bytes_streamed = 0;  // streamed x block_bytes
};

// The plan of one layer: selection holds tokens x k expert ids in router rank
// order, slot_of the layer's slot table (expert -> slot or kNoSlot, read
// only), ring_buffers how many staging buffers the ring has (streamed expert
// i uses buffer i % ring_buffers, so with 2 the next one copies while this one
// computes). Errors name the token and rank of an id outside [0, experts) and
// a ring of no buffers.
absl::StatusOr<PrefillLayerPlan> PlanPrefillLayer(absl::Span<const int32_t> selection, int32_t k,
                                                  absl::Span<const int32_t> slot_of,
                                                  int32_t ring_buffers, uint64_t block_bytes);

}  // namespace moegraph
