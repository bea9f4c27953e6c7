// Routing traces: which experts each layer selected at each decode step.
//
// Two forms: the JSONL interchange form (one object per (layer, token) row, see
// the shared traces' README) and a compact binary form for large traces:
//   header: magic "MGTR", u32 version (1), u32 n_layer, u32 n_expert, u32 k,
//           u64 n_steps, u32 flags (bit 0: f16 weights follow the ids)
//   then n_steps * n_layer * k u16 expert ids (kMissingExpert for a missing row),
//   then, with flag bit 0, as many f16 router weights (0 in a missing row).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moegraph {

inline constexpr uint16_t kMissingExpert = 0xffff;

struct RoutingTrace {
  int32_t n_layer = 0;
  int32_t n_expert = 0;
  int32_t k = 0;
  int64_t n_steps = 0;
  std::vector<uint16_t> ids;      // [n_steps][n_layer][k], rank order
  std::vector<uint16_t> weights;  // f16, same shape as ids; empty when the trace has none

  size_t row_offset(int64_t step, int32_t layer) const {
    return (static_cast<size_t>(step) * n_layer + layer) * k;
  }
  const uint16_t* row(int64_t step, int32_t layer) const { return &ids[row_offset(step, layer)]; }
  // False for a (step, layer) pair the source did not record: skip it.
  bool present(int64_t step, int32_t layer) const { return row(step, layer)[0] != kMissingExpert; }
};

struct TraceReadOptions {
  // The interchange form has no expert count. 0: take the "n_expert" key that
  // WriteTraceJsonl adds, else infer max id + 1. > 0: the model's count (8 for
  // Mixtral); ids must be below it, and a binary file's header must agree.
  int32_t n_expert_hint = 0;
};

// Reads the JSONL form, ordering steps by (dataset, problem_id, token index) and
// layers ascending; a (step, layer) row the file lacks stays missing. n_layer is
// max layer + 1 (or the "n_layer" key WriteTraceJsonl adds). Strict: a line that
// is not one JSON object, a missing or mistyped field, an id out of range, a k
// that changes, a repeated (step, layer) row or id, or gating_probs whose length
// differs from experts is an error naming the file and line. Router weights
// become f16; gating_probs must be on every row or on none.
absl::StatusOr<RoutingTrace> ReadTraceJsonl(const std::string& path,
                                            const TraceReadOptions& options = {});
// Validates the header, the sizes against the file length, and each row (all
// missing with zero weights, or distinct ids below n_expert). Errors name the
// file and byte offset.
absl::StatusOr<RoutingTrace> ReadTraceBinary(const std::string& path,
                                             const TraceReadOptions& options = {});
// By extension: ".jsonl" is JSONL, anything else the binary form.
absl::StatusOr<RoutingTrace> ReadTrace(const std::string& path,
                                       const TraceReadOptions& options = {});
// One line per present row: dataset "moegraph", problem_id 0, token_idx = step,
// plus "n_layer" and "n_expert" keys so that ReadTraceJsonl gives back the same
// trace (steps with no present row are not representable and are dropped).
absl::Status WriteTraceJsonl(const RoutingTrace& trace, const std::string& path);
absl::Status WriteTraceBinary(const RoutingTrace& trace, const std::string& path);
// By extension, as ReadTrace.
absl::Status WriteTrace(const RoutingTrace& trace, const std::string& path);

}  // namespace moegraph
