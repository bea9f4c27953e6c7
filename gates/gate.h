// The gate harness: a gate sets up engines, snapshots their counters, runs a
// workload, snapshots again and asserts on the delta and on the outputs. The
// runner prints one line per gate (PASS, FAIL or SKIP with the detail) and a
// summary line; any FAIL makes the exit status non-zero.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gates/engines.h"
#include "loader/model_config.h"

namespace moegraph {

enum class Outcome { kPass, kFail, kSkip };

struct GateResult {
  Outcome outcome = Outcome::kFail;
  std::string detail;  // what was shown (PASS), what broke (FAIL), why not run (SKIP)
};

GateResult Pass(std::string detail);
GateResult Fail(std::string reason);
GateResult Skip(std::string reason);
// A FAIL carrying the status message; status must not be OK.
GateResult FailOn(const absl::Status& status);

// A model a gate runs on, with the name it goes by in result lines.
struct NamedModel {
  std::string name;
  const Model* model = nullptr;
};

// What the gates run on. The models must outlive the context.
struct GateContext {
  Backend backend = Backend::kCpu;
  // Why the CUDA-only gates skip on this run (the backend is cpu).
  std::string cuda_skip_reason;
  NamedModel model;                       // every gate's model
  std::vector<NamedModel> oracle_models;  // oracle-nmse's: one per expert quant type
  // Slots over all size classes: few enough that a decode hits, misses and evicts.
  int32_t n_slots = 0;
  EngineFactory make_engine;
};

struct Gate {
  std::string name;
  std::string description;  // one line: what passing proves
  bool needs_cuda = false;  // SKIP (with the context's reason) on the CPU backend
  std::function<GateResult(GateContext&)> run;
};

// The gates named in a comma-separated list (empty: all), in registry order. An
// unknown name is an error naming --only and the gates there are.
absl::StatusOr<std::vector<const Gate*>> SelectGates(absl::Span<const Gate> gates,
                                                     std::string_view only);

// "name  backends  description" per gate, for --list.
std::string ListGates(absl::Span<const Gate> gates);

struct RunSummary {
  int passed = 0;
  int failed = 0;
  int skipped = 0;
  int exit_code() const { return failed > 0 ? 1 : 0; }
};

// "PASS name: detail" / "FAIL name: reason" / "SKIP name: reason".
std::string ResultLine(std::string_view name, const GateResult& result);
// "N passed, N failed, N skipped".
std::string SummaryLine(const RunSummary& summary);

// Runs the gates in order, handing each result line, then the summary line, to
// emit as it is known.
RunSummary RunGates(absl::Span<const Gate* const> gates, GateContext& context,
                    const std::function<void(const std::string& line)>& emit);

}  // namespace moegraph
