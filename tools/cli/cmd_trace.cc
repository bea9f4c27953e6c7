// moegraph trace: statistics, synthesis and conversion of routing traces
// (residency/trace.h). The format of a file follows its extension.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "loader/status_util.h"
#include "residency/trace.h"
#include "residency/trace_stats.h"
#include "residency/trace_synth.h"
#include "tools/cli/commands.h"

ABSL_FLAG(int64_t, steps, 1000, "trace synth: decode steps to generate");
ABSL_FLAG(double, zipf, 1.0, "trace synth: Zipf exponent of expert popularity (0: uniform)");
ABSL_FLAG(double, reuse, 0.45,
          "trace synth: next-token reuse, the chance that each expert of a step is kept at the "
          "next step");
ABSL_FLAG(int64_t, drift, 0,
          "trace synth: every N steps each layer swaps two adjacent popularity ranks (0: never)");
ABSL_FLAG(bool, weights, false, "trace synth: also write router weights");

namespace moegraph {
namespace {

constexpr char kUsage[] =
    "usage: moegraph trace stats FILE [-o md|json]\n"
    "       moegraph trace synth [--layers 48 --experts 128 --top-k 8 --steps 1000 --zipf 1.0\n"
    "                            --reuse 0.45 --drift 0 --seed 1 --weights] -o FILE\n"
    "       moegraph trace convert IN OUT\n"
    "(.jsonl files are the JSONL interchange form, others the binary form)";

int Usage() {
  std::fprintf(stderr, "%s\n", kUsage);
  return 2;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "moegraph trace: %s\n", std::string(status.message()).c_str());
  return 1;
}

void Print(const std::string& text) { std::fwrite(text.data(), 1, text.size(), stdout); }

TraceReadOptions ReadOptions() {
  TraceReadOptions options;
  options.n_expert_hint = absl::GetFlag(FLAGS_experts);
  return options;
}

int RunStats(const std::vector<std::string>& args) {
  if (args.size() != 1) return Usage();
  const std::string format = absl::GetFlag(FLAGS_o);
  if (format != "" && format != "md" && format != "json") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("-o ", format, ": trace stats prints md or json")));
  }
  absl::StatusOr<RoutingTrace> trace = ReadTrace(args[0], ReadOptions());
  if (!trace.ok()) return Fail(trace.status());
  const TraceStats stats = ComputeTraceStats(*trace);
  Print(format == "json" ? FormatTraceStatsJson(stats) : FormatTraceStatsMarkdown(stats));
  return 0;
}

int RunSynth(const std::vector<std::string>& args) {
  const std::string path = absl::GetFlag(FLAGS_o);
  if (!args.empty() || path.empty()) return Usage();
  SynthSpec spec;
  spec.n_layer = FlagOr(FLAGS_layers, spec.n_layer);
  spec.n_expert = FlagOr(FLAGS_experts, spec.n_expert);
  spec.k = TopKFlagOr(spec.k);
  absl::StatusOr<uint64_t> seed = SeedFlagOr(1);
  if (!seed.ok()) return Fail(seed.status());
  spec.seed = *seed;
  spec.n_steps = absl::GetFlag(FLAGS_steps);
  spec.zipf_s = absl::GetFlag(FLAGS_zipf);
  spec.reuse = absl::GetFlag(FLAGS_reuse);
  spec.drift_period = absl::GetFlag(FLAGS_drift);
  spec.weights = absl::GetFlag(FLAGS_weights);
  absl::StatusOr<RoutingTrace> trace = SynthesizeTrace(spec);
  if (!trace.ok()) return Fail(trace.status());
  if (absl::Status written = WriteTrace(*trace, path); !written.ok()) return Fail(written);
  Print(absl::StrCat("wrote ", path, "\n", FormatTraceStatsSummary(ComputeTraceStats(*trace)),
                     "\n"));
  return 0;
}

int RunConvert(const std::vector<std::string>& args) {
  if (args.size() != 2) return Usage();
  absl::StatusOr<RoutingTrace> trace = ReadTrace(args[0], ReadOptions());
  if (!trace.ok()) return Fail(trace.status());
  if (absl::Status written = WriteTrace(*trace, args[1]); !written.ok()) return Fail(written);
  Print(absl::StrCat("wrote ", args[1], ": ", trace->n_steps, " steps x ", trace->n_layer,
                     " layers, ", trace->n_expert, " experts, top-", trace->k,
                     trace->weights.empty() ? "" : ", with weights", "\n"));
  return 0;
}

}  // namespace

int RunTrace(const std::vector<std::string>& args) {
  if (args.empty()) return Usage();
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "stats") return RunStats(rest);
  if (args[0] == "synth") return RunSynth(rest);
  if (args[0] == "convert") return RunConvert(rest);
  return Usage();
}

}  // namespace moegraph
