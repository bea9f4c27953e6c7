#include "gates/gate.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {

GateResult Pass(std::string detail) { return {Outcome::kPass, std::move(detail)}; }
GateResult Fail(std::string reason) { return {Outcome::kFail, std::move(reason)}; }
GateResult Skip(std::string reason) { return {Outcome::kSkip, std::move(reason)}; }

GateResult FailOn(const absl::Status& status) {
  MG_CHECK(!status.ok(), "FailOn: an OK status is not a failure");
  return Fail(std::string(status.message()));
}

absl::StatusOr<std::vector<const Gate*>> SelectGates(absl::Span<const Gate> gates,
                                                     std::string_view only) {
  std::vector<const Gate*> selected;
  if (absl::StripAsciiWhitespace(Av(only)).empty()) {
    for (const Gate& gate : gates) selected.push_back(&gate);
    return selected;
  }
  std::vector<std::string> wanted;
  for (absl::string_view part : absl::StrSplit(Av(only), ',', absl::SkipWhitespace())) {
    const std::string name(absl::StripAsciiWhitespace(part));
    bool known = false;
    for (const Gate& gate : gates) known = known || gate.name == name;
    if (!known) {
      std::vector<std::string> names;
      for (const Gate& gate : gates) names.push_back(gate.name);
      return absl::InvalidArgumentError(absl::StrFormat("--only: no gate named '%s' (gates: %s)",
                                                        name, absl::StrJoin(names, ", ")));
    }
    wanted.push_back(name);
  }
  for (const Gate& gate : gates) {
    for (const std::string& name : wanted) {
      if (gate.name == name) {
        selected.push_back(&gate);
        break;
      }
    }
  }
  return selected;
}

std::string ListGates(absl::Span<const Gate> gates) {
  size_t width = 0;
  for (const Gate& gate : gates) width = std::max(width, gate.name.size());
  std::string out;
  for (const Gate& gate : gates) {
    absl::StrAppendFormat(&out, "%-*s  %-8s  %s\n", width, gate.name,
                          gate.needs_cuda ? "cuda" : "cpu,cuda", gate.description);
  }
  return out;
}

std::string ResultLine(std::string_view name, const GateResult& result) {
  const char* word = result.outcome == Outcome::kPass   ? "PASS"
                     : result.outcome == Outcome::kFail ? "FAIL"
                                                        : "SKIP";
  return absl::StrCat(word, " ", Av(name), ": ", result.detail);
}

std::string SummaryLine(const RunSummary& summary) {
  return absl::StrFormat("%d passed, %d failed, %d skipped", summary.passed, summary.failed,
                         summary.skipped);
}

RunSummary RunGates(absl::Span<const Gate* const> gates, GateContext& context,
                    const std::function<void(const std::string& line)>& emit) {
  RunSummary summary;
  for (const Gate* gate : gates) {
    const GateResult result = gate->needs_cuda && context.backend != Backend::kCuda
                                  ? Skip(context.cuda_skip_reason)
                                  : gate->run(context);
    switch (result.outcome) {
      case Outcome::kPass:
        ++summary.passed;
        break;
      case Outcome::kFail:
        ++summary.failed;
        break;
      case Outcome::kSkip:
        ++summary.skipped;
        break;
    }
    emit(ResultLine(gate->name, result));
  }
  emit(SummaryLine(summary));
  return summary;
}

}  // namespace moegraph
