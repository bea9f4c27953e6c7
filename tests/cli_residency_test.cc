// `moegraph trace` and `moegraph simulate` as a user runs them: the binary in a
// subprocess, its output parsed, its files read back.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "residency/simulator.h"
#include "residency/trace.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::JsonChecker;
using testing_util::ProcessResult;
using testing_util::ReadFileToString;
using testing_util::RunProcessWithArgs;
using testing_util::SharedPath;
using testing_util::TempPath;

// ---- CliTrace: moegraph trace stats | synth | convert ----

// `moegraph SUBCOMMAND ARGS` (ARGS split at spaces) with stdout and stderr apart.
ProcessResult RunMoegraph(const std::string& subcommand, const std::string& args) {
  return RunProcessWithArgs({MOEGRAPH_BIN, subcommand}, args);
}

ProcessResult MoegraphTrace(const std::string& args) { return RunMoegraph("trace", args); }

std::string SharedTrace() { return SharedPath("traces/mixtral-8x7b-humaneval.jsonl"); }

TEST(CliTrace, StatsMarkdownOnTheSharedTrace) {
  const ProcessResult r = MoegraphTrace("stats " + SharedTrace());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("32 layers, 8 experts, top-2, 83 steps, 2579 rows present, 77 missing"),
            std::string::npos)
      << r.out;
  // Header, separator, 32 layer rows and the "all" row.
  int table_rows = 0;
  std::stringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| ", 0) == 0 && line.back() == '|') ++table_rows;
  }
  EXPECT_EQ(table_rows, 2 + 32 + 1);
  EXPECT_NE(r.out.find("| all | 2579 | 2.914 | 0.971 | 0.180 | 0.196 | 0.359 |"),
            std::string::npos)
      << r.out;
}

TEST(CliTrace, StatsJsonParses) {
  const ProcessResult r = MoegraphTrace("stats -o json --experts 8 " + SharedTrace());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(JsonChecker(r.out).Valid()) << r.out;
  EXPECT_NE(r.out.find("\"n_expert\": 8, \"k\": 2, \"n_steps\": 83"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"reuse\": 0.359050"), std::string::npos) << r.out;
  EXPECT_FALSE(JsonChecker(r.out.substr(0, r.out.size() / 2)).Valid());

  const ProcessResult wider = MoegraphTrace("stats -o json --experts 16 " + SharedTrace());
  ASSERT_EQ(wider.exit_code, 0) << wider.err;
  EXPECT_NE(wider.out.find("\"n_expert\": 16,"), std::string::npos);
}

TEST(CliTrace, SynthAndConvertRoundTrip) {
  const std::string bin = TempPath("synth.mgtr");
  const std::string jsonl = TempPath("synth.jsonl");
  const std::string back = TempPath("back.mgtr");
  const ProcessResult synth = MoegraphTrace(
      "synth --layers 4 --experts 16 --top-k 2 --steps 300 --zipf 0.8 --reuse 0.5 --drift 10 "
      "--seed 7 --weights -o " + bin);
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  EXPECT_NE(synth.out.find(bin), std::string::npos) << synth.out;
  EXPECT_NE(synth.out.find("300 steps x 4 layers, 16 experts, top-2"), std::string::npos)
      << synth.out;
  EXPECT_NE(synth.out.find("next-token reuse 0."), std::string::npos) << synth.out;

  absl::StatusOr<RoutingTrace> original = ReadTrace(bin);
  ASSERT_TRUE(original.ok()) << original.status();
  EXPECT_EQ(original->n_layer, 4);
  EXPECT_EQ(original->n_expert, 16);
  EXPECT_EQ(original->k, 2);
  EXPECT_EQ(original->n_steps, 300);
  EXPECT_EQ(original->weights.size(), original->ids.size());

  const ProcessResult to_jsonl = MoegraphTrace("convert " + bin + " " + jsonl);
  ASSERT_EQ(to_jsonl.exit_code, 0) << to_jsonl.err;
  const ProcessResult to_bin = MoegraphTrace("convert " + jsonl + " " + back);
  ASSERT_EQ(to_bin.exit_code, 0) << to_bin.err;
  const std::string bytes = ReadFileToString(bin);
  EXPECT_EQ(bytes.size(), 32u + 4u * 300 * 4 * 2);
  EXPECT_TRUE(bytes == ReadFileToString(back));

  // The same seed writes the same bytes; geometry flags not given take the
  // synth defaults (48 x 128, top-8), not make-fixture's.
  const ProcessResult again = MoegraphTrace(
      "synth --layers=4 --experts=16 --top_k=2 --steps=300 --zipf=0.8 --reuse=0.5 --drift=10 "
      "--seed=7 --weights -o " + back);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(bytes == ReadFileToString(back));
  const ProcessResult defaults = MoegraphTrace("synth --steps 3 -o " + back);
  ASSERT_EQ(defaults.exit_code, 0) << defaults.err;
  absl::StatusOr<RoutingTrace> d = ReadTrace(back);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->n_layer, 48);
  EXPECT_EQ(d->n_expert, 128);
  EXPECT_EQ(d->k, 8);
  EXPECT_TRUE(d->weights.empty());
  for (const std::string& path : {bin, jsonl, back}) std::remove(path.c_str());
}

TEST(CliTrace, ErrorsNameTheFileLineOrFlag) {
  const std::string missing = TempPath("absent.jsonl");
  ProcessResult r = MoegraphTrace("stats " + missing);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;

  const std::string bad = TempPath("bad.jsonl");
  {
    std::ofstream out(bad);
    out << R"({"dataset": "d", "problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]})"
        << "\n{\"dataset\": \"d\", \"problem_id\": 0, \"layer\": 0, \"token_idx\": 1}\n";
  }
  r = MoegraphTrace("stats " + bad);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(bad + ":2: missing field \"experts\""), std::string::npos) << r.err;
  r = MoegraphTrace("convert " + bad + " " + TempPath("never.mgtr"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(bad + ":2:"), std::string::npos) << r.err;
  std::remove(bad.c_str());

  r = MoegraphTrace("stats -o xml " + SharedTrace());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("-o xml"), std::string::npos) << r.err;
  r = MoegraphTrace("synth --reuse 1.5 -o " + TempPath("never.mgtr"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--reuse 1.5"), std::string::npos) << r.err;
  r = MoegraphTrace("synth --experts 4 --top-k 6 -o " + TempPath("never.mgtr"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--top-k 6"), std::string::npos) << r.err;

  // Usage errors: no subcommand, an unknown one, wrong arguments, synth without -o.
  for (const std::string& args : {std::string(""), std::string("frobnicate"),
                                  std::string("stats"), std::string("convert a.jsonl"),
                                  std::string("synth --steps 3")}) {
    r = MoegraphTrace(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_NE(r.err.find("usage: moegraph trace"), std::string::npos) << r.err;
  }
}

// ---- CliSimulate: moegraph simulate ----

ProcessResult MoegraphSimulate(const std::string& args) { return RunMoegraph("simulate", args); }

// The in-process simulator's result for one (policy, slots) on the shared trace:
// what the binary must print.
SimResult SimulateInProcess(const std::string& policy, int32_t n_slots) {
  TraceReadOptions options;
  options.n_expert_hint = 8;
  absl::StatusOr<RoutingTrace> trace = ReadTraceJsonl(SharedTrace(), options);
  EXPECT_TRUE(trace.ok()) << trace.status();
  if (!trace.ok()) return {};
  absl::StatusOr<SimTrace> sim = SimTrace::Create(*trace);
  EXPECT_TRUE(sim.ok()) << sim.status();
  if (!sim.ok()) return {};
  SimConfig config;
  config.policy = policy;
  config.n_slots = n_slots;
  absl::StatusOr<SimResult> result = Simulate(*sim, config);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : SimResult{};
}

// The cells of the markdown table row that starts "| policy | slots |", or none.
std::vector<std::string> TableRow(const std::string& out, const std::string& policy,
                                  int32_t n_slots) {
  const std::string prefix = "| " + policy + " | " + std::to_string(n_slots) + " |";
  std::stringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) != 0) continue;
    std::vector<std::string> cells;
    std::stringstream fields(line.substr(1));
    for (std::string cell; std::getline(fields, cell, '|');) {
      const size_t begin = cell.find_first_not_of(' ');
      const size_t end = cell.find_last_not_of(' ');
      cells.push_back(begin == std::string::npos ? "" : cell.substr(begin, end - begin + 1));
    }
    return cells;
  }
  return {};
}

// The integer after "\"key\": " in text, or -1.
int64_t JsonInt(const std::string& text, const std::string& key) {
  const size_t at = text.find("\"" + key + "\": ");
  if (at == std::string::npos) return -1;
  return std::strtoll(text.c_str() + at + key.size() + 4, nullptr, 10);
}

// The string after "\"key\": \"" in text, up to the closing quote.
std::string JsonText(const std::string& text, const std::string& key) {
  const size_t at = text.find("\"" + key + "\": \"");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 5;
  return text.substr(begin, text.find('"', begin) - begin);
}

TEST(CliSimulate, MarkdownMatchesTheSimulator) {
  const ProcessResult r =
      MoegraphSimulate("--trace " + SharedTrace() + " --policy lru,slru,default,opt --slots 32,64");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("32 layers x 8 experts, top-2, 83 steps"), std::string::npos) << r.out;
  for (const std::string policy : {"lru", "slru", "opt"}) {
    for (const int32_t n_slots : {32, 64}) {
      const std::vector<std::string> cells = TableRow(r.out, policy, n_slots);
      ASSERT_EQ(cells.size(), 9u) << policy << " " << n_slots << "\n" << r.out;
      const SimResult expected = SimulateInProcess(policy, n_slots);
      EXPECT_EQ(cells[2], "global");
      EXPECT_EQ(cells[3], std::to_string(expected.hits)) << policy << " " << n_slots;
      EXPECT_EQ(cells[4], std::to_string(expected.misses)) << policy << " " << n_slots;
    }
  }
  // The README's OPT hit rate, and OPT's ratio to itself.
  EXPECT_EQ(TableRow(r.out, "opt", 32)[5], "39.10");
  EXPECT_EQ(TableRow(r.out, "opt", 32)[6], "1.000");
  EXPECT_FALSE(TableRow(r.out, "default (hazard)", 64).empty()) << r.out;
  EXPECT_NE(r.out.find("tok/s = 1 / t_token"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 - PCIe_BW / RAM_BW = 1 - 50.0 / 80.0 = 37.5%"), std::string::npos)
      << r.out;
}

TEST(CliSimulate, JsonHasEveryResult) {
  const ProcessResult r = MoegraphSimulate("--trace " + SharedTrace() +
                                      " --policy lru,opt --slots 16,128 --pool global -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(JsonChecker(r.out).Valid()) << r.out;
  EXPECT_EQ(JsonInt(r.out, "n_layer"), 32);
  EXPECT_EQ(JsonInt(r.out, "n_steps"), 83);
  EXPECT_NE(r.out.find("\"pcie_gbps\": 50.0000"), std::string::npos) << r.out;
  // One object per result, in (policy, slots) order.
  std::vector<std::string> objects;
  for (size_t at = r.out.find("{\"policy\""); at != std::string::npos;
       at = r.out.find("{\"policy\"", at + 1)) {
    objects.push_back(r.out.substr(at, r.out.find('}', at) - at));
  }
  ASSERT_EQ(objects.size(), 4u) << r.out;
  size_t i = 0;
  for (const std::string policy : {"lru", "opt"}) {
    for (const int32_t n_slots : {16, 128}) {
      const std::string& object = objects[i++];
      const SimResult expected = SimulateInProcess(policy, n_slots);
      EXPECT_EQ(JsonText(object, "policy"), policy) << object;
      EXPECT_EQ(JsonText(object, "pool"), "global") << object;
      EXPECT_EQ(JsonInt(object, "slots"), n_slots) << object;
      EXPECT_EQ(JsonInt(object, "hits"), expected.hits) << object;
      EXPECT_EQ(JsonInt(object, "misses"), expected.misses) << object;
    }
  }
}

TEST(CliSimulate, OutputIsDeterministic) {
  for (const std::string format : {"md", "json"}) {
    const std::string args = "--trace " + SharedTrace() +
                             " --policy lru,slru,opt --slots 64,100,192 --pool per-layer -o " +
                             format;
    const ProcessResult first = MoegraphSimulate(args);
    const ProcessResult second = MoegraphSimulate(args);
    ASSERT_EQ(first.exit_code, 0) << first.err;
    EXPECT_FALSE(first.out.empty());
    EXPECT_TRUE(first.out == second.out) << format;
  }
}

TEST(CliSimulate, BadFlagsAreErrorsNamingTheFlag) {
  const std::string trace = "--trace " + SharedTrace();
  const struct {
    std::string args;
    std::string named;
  } kCases[] = {
      {trace + " --slots 1", "--slots 1"},  // below top-2
      {trace + " --slots 32,1 --policy opt", "--slots 1"},
      {trace + " --slots 40 --pool per-layer", "--slots 40"},  // 1 slot for some layers
      {trace + " --slots 16,abc", "--slots"},
      {trace + " --slots 0", "--slots"},
      {trace + " --policy lru,fifo", "--policy"},
      {trace + " --pool sideways", "--pool"},
      {trace + " --pcie-gbps 0", "--pcie-gbps"},
      {trace + " -o xml", "-o 'xml'"},
      {"--slots 32", "--trace"},
      {"--trace " + TempPath("absent.jsonl"), TempPath("absent.jsonl")},
  };
  for (const auto& c : kCases) {
    const ProcessResult r = MoegraphSimulate(c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args;
    EXPECT_TRUE(r.out.empty()) << c.args << "\n" << r.out;
    EXPECT_NE(r.err.find(c.named), std::string::npos) << c.args << "\n" << r.err;
  }
}

}  // namespace
}  // namespace moegraph
