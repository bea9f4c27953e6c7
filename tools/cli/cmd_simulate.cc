// moegraph simulate: replays a routing trace through residency policies at
// several pool sizes and predicts decode speed with the cost model of
// residency/simulator.h. Output is deterministic to the digit (no timing).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "loader/status_util.h"
#include "residency/simulator.h"
#include "residency/trace.h"
#include "tools/cli/commands.h"


ABSL_FLAG(std::string, trace, "", "simulate: routing trace (.jsonl, or the binary form)");
ABSL_FLAG(std::string, policy, "lru,slru,default,opt",
          "simulate: residency policies, comma-separated (lru, slru, opt, default)");
ABSL_FLAG(std::string, slots, "",
          "expert slots: simulate: sizes to compare, comma-separated (default 16,32,64); "
          "run: N or auto (default auto)");
ABSL_FLAG(std::string, pool, "global",
          "simulate: global (one pool keyed by (layer, expert)) | per-layer (slots split "
          "evenly over the layers)");
ABSL_FLAG(double, protected_frac, moegraph::kDefaultProtectedFrac,
          "simulate: share of slots in SLRU's protected segment (0 is LRU)");
ABSL_FLAG(double, block_mib, 1.0, "simulate: bytes of one expert block (one slot), in MiB");
ABSL_FLAG(double, pcie_gbps, 50.0,
          "simulate: effective host-to-device bandwidth in GB/s (PCIe 5 x16 ~50, PCIe 4 x16 ~25)");
ABSL_FLAG(double, hbm_gbps, 4800.0, "simulate: device memory bandwidth in GB/s (H200: 4800)");
ABSL_FLAG(double, ram_gbps, 80.0, "simulate: host RAM bandwidth of a CPU expert pass, in GB/s");
ABSL_FLAG(double, resident_ms, 0.0,
          "simulate: step time with every expert resident, in ms (0: active expert bytes / HBM)");

namespace moegraph {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseSlots(const std::string& text) {
  std::vector<int32_t> slots;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t n = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--slots '%s': '%s' is not a positive slot count", text, std::string(part)));
    }
    slots.push_back(n);
  }
  return slots;
}

absl::StatusOr<std::vector<std::string>> ParsePolicies(const std::string& text) {
  const std::vector<std::string_view> known = SimPolicyNames();
  std::vector<std::string> policies;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::string name(absl::StripAsciiWhitespace(part));
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::vector<std::string> names(known.begin(), known.end());
      return absl::InvalidArgumentError(absl::StrFormat("--policy '%s': '%s' is not one of %s",
                                                        text, name, absl::StrJoin(names, ", ")));
    }
    policies.push_back(name);
  }
  return policies;
}

// A row of the report: the policy's result, its cost, and OPT's hits at the same size.
struct Row {
  SimResult result;
  CostPrediction cost;
  int64_t opt_hits = 0;

  std::optional<double> ratio_to_opt() const {
    if (opt_hits == 0) return std::nullopt;
    return static_cast<double>(result.hits) / opt_hits;
  }
};

std::string JsonString(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string PolicyLabel(const std::string& policy) {
  const std::string_view runs = ResolvePolicyName(policy);
  return runs == policy ? policy : absl::StrCat(policy, " (", Av(runs), ")");
}

constexpr char kFormula[] =
    "t_token = t_resident + MiB_per_token * 2^20 B / PCIe_BW; tok/s = 1 / t_token";

std::string ResidentLine(const CostModel& model, const RoutingTrace& trace) {
  const double resident_ms = ResidentMs(model, trace.k, trace.n_layer);
  if (model.resident_ms > 0) return absl::StrFormat("t_resident = %.4f ms (given)", resident_ms);
  return absl::StrFormat(
      "t_resident = %.4f ms = top-k %d x %d layers x %.2f MiB / HBM %.0f GB/s (expert bytes only)",
      resident_ms, trace.k, trace.n_layer, model.block_mib, model.hbm_gbps);
}

std::string Markdown(const std::string& path, const RoutingTrace& trace, int64_t accesses,
                     const CostModel& model, double protected_frac, const std::vector<Row>& rows) {
  std::string out = absl::StrFormat(
      "trace: %s (%d layers x %d experts, top-%d, %d steps, %d accesses)\n"
      "slru protected-frac %.2f, block %.2f MiB\n\n",
      path, trace.n_layer, trace.n_expert, trace.k, trace.n_steps, accesses, protected_frac,
      model.block_mib);
  out += "| policy | slots | pool | hits | misses | hit % | vs OPT | MiB/token | pred. tok/s |\n";
  out += "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const Row& row : rows) {
    const SimResult& r = row.result;
    const std::optional<double> ratio = row.ratio_to_opt();
    out += absl::StrFormat(
        "| %s | %d | %s | %d | %d | %.2f | %s | %.3f | %.1f |\n", PolicyLabel(r.policy), r.n_slots,
        Av(PoolModeName(r.pool_mode)), r.hits, r.misses, 100.0 * r.hit_rate(),
        ratio ? absl::StrFormat("%.3f", *ratio) : "n/a", row.cost.mib_per_token, row.cost.tok_s);
  }
  const double break_even = BreakEvenHitRate(model);
  out += absl::StrFormat(
      "\ncost model: %s\n"
      "  %s\n"
      "  PCIe_BW %.1f GB/s (1 GB = 1e9 B)\n"
      "  assumption: miss copies do not overlap the step, so each missed block adds\n"
      "  block_bytes / PCIe_BW to the token (the worst case for pass B)\n"
      "break-even: hit rate >= 1 - PCIe_BW / RAM_BW = 1 - %.1f / %.1f = %.1f%%\n"
      "  below it, copying the misses over PCIe takes longer than computing every routed\n"
      "  expert on the CPU from host RAM, so caching them on the GPU does not pay\n",
      kFormula, ResidentLine(model, trace), model.pcie_gbps, model.pcie_gbps, model.ram_gbps,
      100.0 * break_even);
  return out;
}

std::string Json(const std::string& path, const RoutingTrace& trace, int64_t accesses,
                 const CostModel& model, double protected_frac, const std::vector<Row>& rows) {
  std::string out = absl::StrFormat(
      "{\n  \"trace\": {\"path\": %s, \"n_layer\": %d, \"n_expert\": %d, \"k\": %d, "
      "\"n_steps\": %d, \"accesses\": %d},\n"
      "  \"protected_frac\": %.4f,\n"
      "  \"cost_model\": {\"formula\": %s, \"block_mib\": %.4f, \"pcie_gbps\": %.4f, "
      "\"hbm_gbps\": %.4f, \"ram_gbps\": %.4f, \"resident_ms\": %.6f, "
      "\"resident_ms_derived\": %s, \"break_even_hit_rate\": %.6f},\n"
      "  \"results\": [",
      JsonString(path), trace.n_layer, trace.n_expert, trace.k, trace.n_steps, accesses,
      protected_frac, JsonString(kFormula), model.block_mib, model.pcie_gbps, model.hbm_gbps,
      model.ram_gbps, ResidentMs(model, trace.k, trace.n_layer),
      model.resident_ms > 0 ? "false" : "true", BreakEvenHitRate(model));
  for (size_t i = 0; i < rows.size(); ++i) {
    const SimResult& r = rows[i].result;
    const std::optional<double> ratio = rows[i].ratio_to_opt();
    out += absl::StrFormat(
        "%s\n    {\"policy\": %s, \"runs\": %s, \"slots\": %d, \"pool\": \"%s\", \"hits\": %d, "
        "\"misses\": %d, \"evictions\": %d, \"hit_rate\": %.6f, \"ratio_to_opt\": %s, "
        "\"mib_per_token\": %.6f, \"predicted_tok_s\": %.3f}",
        i == 0 ? "" : ",", JsonString(r.policy), JsonString(ResolvePolicyName(r.policy)), r.n_slots,
        Av(PoolModeName(r.pool_mode)), r.hits, r.misses, r.evictions, r.hit_rate(),
        ratio ? absl::StrFormat("%.6f", *ratio) : "null", rows[i].cost.mib_per_token,
        rows[i].cost.tok_s);
  }
  return out + "\n  ]\n}\n";
}

absl::StatusOr<std::string> Simulate() {
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return absl::InvalidArgumentError("--trace FILE is required");
  const std::string format = absl::GetFlag(FLAGS_o).empty() ? "md" : absl::GetFlag(FLAGS_o);
  if (format != "md" && format != "json") {
    return absl::InvalidArgumentError(
        absl::StrFormat("-o '%s' is not one of md, json (simulate prints to stdout)", format));
  }
  MG_ASSIGN_OR_RETURN(const std::vector<std::string> policies,
                      ParsePolicies(absl::GetFlag(FLAGS_policy)));
  MG_ASSIGN_OR_RETURN(const std::vector<int32_t> slot_counts,
                      ParseSlots(absl::GetFlag(FLAGS_slots).empty() ? "16,32,64" : absl::GetFlag(FLAGS_slots)));
  MG_ASSIGN_OR_RETURN(const PoolMode pool_mode, ParsePoolMode(absl::GetFlag(FLAGS_pool)));
  CostModel model;
  model.block_mib = absl::GetFlag(FLAGS_block_mib);
  model.pcie_gbps = absl::GetFlag(FLAGS_pcie_gbps);
  model.hbm_gbps = absl::GetFlag(FLAGS_hbm_gbps);
  model.ram_gbps = absl::GetFlag(FLAGS_ram_gbps);
  model.resident_ms = absl::GetFlag(FLAGS_resident_ms);
  MG_RETURN_IF_ERROR(ValidateCostModel(model));

  TraceReadOptions read_options;
  read_options.n_expert_hint = absl::GetFlag(FLAGS_experts);
  if (read_options.n_expert_hint < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--experts %d must not be negative", read_options.n_expert_hint));
  }
  MG_ASSIGN_OR_RETURN(const RoutingTrace trace, ReadTrace(path, read_options));
  absl::StatusOr<SimTrace> sim_trace = SimTrace::Create(trace);
  if (!sim_trace.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", sim_trace.status().message()));
  }

  SimConfig config;
  config.pool_mode = pool_mode;
  config.protected_frac = absl::GetFlag(FLAGS_protected_frac);
  // OPT at every size first: the reference every row's ratio is taken against.
  std::vector<int64_t> opt_hits;
  for (const int32_t n_slots : slot_counts) {
    config.policy = "opt";
    config.n_slots = n_slots;
    MG_ASSIGN_OR_RETURN(const SimResult opt, moegraph::Simulate(*sim_trace, config));
    opt_hits.push_back(opt.hits);
  }
  std::vector<Row> rows;
  for (const std::string& policy : policies) {
    for (size_t i = 0; i < slot_counts.size(); ++i) {
      config.policy = policy;
      config.n_slots = slot_counts[i];
      Row row;
      MG_ASSIGN_OR_RETURN(row.result, moegraph::Simulate(*sim_trace, config));
      row.cost = PredictCost(model, row.result, trace.k, trace.n_layer);
      row.opt_hits = opt_hits[i];
      rows.push_back(std::move(row));
    }
  }
  const int64_t accesses = sim_trace->n_accesses();
  return format == "json" ? Json(path, trace, accesses, model, config.protected_frac, rows)
                          : Markdown(path, trace, accesses, model, config.protected_frac, rows);
}

}  // namespace

int RunSimulate(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr,
                 "moegraph simulate: unexpected argument '%s' (the trace goes in --trace FILE)\n",
                 args[0].c_str());
    return 1;
  }
  const absl::StatusOr<std::string> report = Simulate();
  if (!report.ok()) {
    std::fprintf(stderr, "moegraph simulate: %s\n", std::string(report.status().message()).c_str());
    return 1;
  }
  std::fputs(report->c_str(), stdout);
  return 0;
}

}  // namespace moegraph
