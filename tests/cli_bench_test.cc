// `moegraph bench` as a user runs it: the binary in a subprocess on a fixture
// file (the CPU backend: the test machine may have no device), its table and
// JSON parsed, its routing record read back and replayed.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "loader/fixture.h"
#include "residency/trace.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BenchJsonRows;
using testing_util::BenchTableRows;
using testing_util::JsonChecker;
using testing_util::ProcessResult;
using testing_util::ReadFileToString;
using testing_util::RunProcessWithArgs;
using testing_util::TempPath;

constexpr int kLayers = 2;
constexpr int kExperts = 8;
constexpr int kTopK = 2;

// `moegraph bench -m FIXTURE --backend cpu ARGS` (ARGS split at spaces).
ProcessResult Bench(const std::string& fixture, const std::string& args) {
  return RunProcessWithArgs({MOEGRAPH_BIN, "bench", "-m", fixture, "--backend", "cpu"}, args);
}

class CliBenchTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() {
    FixtureSpec spec;
    spec.n_layer = kLayers;
    spec.n_expert = kExperts;
    spec.n_expert_used = kTopK;
    spec.router_skew = 1.0f;
    spec.seed = 5;
    WriteSuiteFixture(spec, "cli_bench.gguf");
  }
};

TEST_F(CliBenchTest, MarkdownHasOneRowPerArmSlotsAndTest) {
  const ProcessResult r =
      Bench(fixture_path(), "--arms resident,graph,host,stage --slots 4,8 -p 3 -n 5 -r 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Notes go to stderr, so stdout is the table alone.
  EXPECT_TRUE(testing_util::Contains(r.err, "note: backend cpu"));
  EXPECT_TRUE(r.out.starts_with("| model |")) << r.out;
  // resident and stage ignore --slots: the CPU's resident arm reads every expert
  // in place (no slots), stage has k scratch slots.
  const std::vector<std::string> expected = {"resident 0 pp3", "resident 0 tg5", "graph 4 pp3",
                                             "graph 4 tg5",    "graph 8 pp3",    "graph 8 tg5",
                                             "host 4 pp3",     "host 4 tg5",     "host 8 pp3",
                                             "host 8 tg5",     "stage 2 pp3",    "stage 2 tg5"};
  const std::vector<std::vector<std::string>> rows = BenchTableRows(r.out);
  ASSERT_EQ(rows.size(), expected.size()) << r.out;
  for (size_t i = 0; i < rows.size(); ++i) {
    ASSERT_EQ(rows[i].size(), 14u) << r.out;
    EXPECT_EQ(rows[i][3], "cpu");
    EXPECT_EQ(rows[i][5] + " " + rows[i][6] + " " + rows[i][7], expected[i]) << r.out;
    // The CPU backend makes no host syncs and no launches.
    EXPECT_EQ(rows[i][12], "0.00");
    EXPECT_EQ(rows[i][13], "0.00");
  }
}

TEST_F(CliBenchTest, JsonParsesWithEveryFieldAndOneSamplePerRepetition) {
  constexpr int kReps = 3;
  const ProcessResult r = Bench(
      fixture_path(),
      "--arms graph,stage --slots 4,auto -p 0 -n 4 -o json -r " + std::to_string(kReps));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(JsonChecker(r.out).Valid()) << r.out;
  const std::vector<std::map<std::string, std::string>> rows = BenchJsonRows(r.out);
  ASSERT_EQ(rows.size(), 3u) << r.out;  // graph at 4 and auto, stage once
  for (const auto& row : rows) {
    for (const char* key : {"arm", "slots", "test", "samples_ts", "avg_ts", "stddev_ts", "hit_rate",
                            "mib_staged_per_token", "host_syncs_per_token", "backend"}) {
      EXPECT_EQ(row.count(key), 1u) << key << " missing in " << r.out;
    }
    EXPECT_EQ(row.at("backend"), "\"cpu\"");
    EXPECT_EQ(row.at("test"), "\"tg4\"");
    const std::string samples = row.at("samples_ts");
    const std::vector<std::string> values =
        absl::StrSplit(samples.substr(1, samples.size() - 2), ',', absl::SkipEmpty());
    ASSERT_EQ(values.size(), static_cast<size_t>(kReps)) << samples;
    for (const std::string& v : values) {
      double ts = 0;
      ASSERT_TRUE(absl::SimpleAtod(v, &ts)) << v;
      EXPECT_GT(ts, 0.0);
    }
  }
  EXPECT_EQ(rows[0].at("slots"), "4");
  // auto on the CPU backend: every expert.
  EXPECT_EQ(rows[1].at("slots"), std::to_string(kLayers * kExperts));
  EXPECT_EQ(rows[2].at("arm"), "\"stage\"");
  // Stage-every-token stages every selected expert and hits none.
  EXPECT_EQ(rows[2].at("hit_rate"), "0");
  EXPECT_EQ(rows[2].at("hits"), "0");
}

// --host-cache: the arms with slots read their misses from the file, at the
// slot count the budget holds: the same hits and misses as those slots over
// a copy in memory; stage reads every selected expert.
TEST_F(CliBenchTest, TheHostCacheRunsTheArmsOverTheFile) {
  const ProcessResult disk =
      Bench(fixture_path(), "--arms graph,stage --host-cache 150K -p 0 -n 16 -r 1 -t 1 -o json");
  ASSERT_EQ(disk.exit_code, 0) << disk.err;
  EXPECT_TRUE(testing_util::Contains(disk.err, "the arms with slots read each miss from"))
      << disk.err;
  const std::vector<std::map<std::string, std::string>> rows = BenchJsonRows(disk.out);
  ASSERT_EQ(rows.size(), 2u) << disk.out;
  const std::string slots = rows[0].at("slots");
  EXPECT_LT(std::stoi(slots), kLayers * kExperts);  // a cache under the experts
  EXPECT_GE(std::stoi(slots), kLayers * kTopK);     // at least one token's
  EXPECT_NE(rows[0].at("misses"), "0");
  EXPECT_EQ(rows[1].at("hits"), "0");  // stage
  const ProcessResult memory = Bench(
      fixture_path(), "--arms graph --slots " + slots + " -p 0 -n 16 -r 1 -t 1 -o json");
  ASSERT_EQ(memory.exit_code, 0) << memory.err;
  const std::vector<std::map<std::string, std::string>> in_memory = BenchJsonRows(memory.out);
  ASSERT_EQ(in_memory.size(), 1u);
  EXPECT_EQ(in_memory[0].at("hits"), rows[0].at("hits"));
  EXPECT_EQ(in_memory[0].at("misses"), rows[0].at("misses"));

  const ProcessResult both = Bench(fixture_path(), "--host-cache 150K --slots 4 -n 2 -r 1");
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(both.err, "--host-cache sizes the expert cache")) << both.err;
}

TEST_F(CliBenchTest, BadFlagsExitNonZeroNamingTheFlag) {
  struct Case {
    std::string args;
    std::string named;
  };
  const std::vector<Case> cases = {{"--arms graph,warp", "--arms"},
                                   {"--arms graph,graph", "--arms"},
                                   {"--slots 4,x", "--slots"},
                                   {"--slots 0", "--slots"},
                                   {"--slots 1 --arms graph", "--slots"},
                                   {"-r 0", "-r"},
                                   {"-o xml", "-o"},
                                   {"-p 4,x", "-p"},
                                   {"-n 4,-4", "-n"},
                                   {"-t 1,-1", "-t"},
                                   {"-pg 4", "-pg"},
                                   {"-pg 0,4", "-pg"},
                                   {"-pg 4,4 -pg 4", "-pg"},
                                   {"--mmap=2", "--mmap"},
                                   {"--steps-per-launch 5000", "--steps-per-launch"},
                                   {"-p 0 -n 0", "-n"},
                                   {"--routing-trace /nonexistent/t.mgtr", "/nonexistent/t.mgtr"}};
  for (const Case& c : cases) {
    // -r: the case's own wins; -n: a list that grows, so only where the case has none.
    const ProcessResult r = Bench(
        fixture_path(),
        (testing_util::Contains(c.args, "-n ") ? "-r 1 " : "-n 2 -r 1 ") + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_TRUE(testing_util::Contains(r.err, c.named)) << c.args;
  }
}

TEST_F(CliBenchTest, TraceOfAnotherGeometryIsAnErrorNamingTheFile) {
  RoutingTrace wrong;
  wrong.n_layer = kLayers + 1;
  wrong.n_expert = kExperts;
  wrong.k = kTopK;
  wrong.n_steps = 1;
  wrong.ids.assign(static_cast<size_t>(wrong.n_layer * wrong.k), 0);
  for (size_t i = 0; i < wrong.ids.size(); ++i) wrong.ids[i] = static_cast<uint16_t>(i % 2);
  const std::string path = TempPath("wrong_layers.mgtr");
  ASSERT_TRUE(WriteTraceBinary(wrong, path).ok());
  ProcessResult r = Bench(fixture_path(), "--routing-trace " + path + " -n 2 -r 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(testing_util::Contains(r.err, path));
  EXPECT_TRUE(testing_util::Contains(r.err, "layers"));

  // Right layers and k, but an id past the model's experts.
  RoutingTrace wide = wrong;
  wide.n_layer = kLayers;
  wide.n_expert = kExperts * 2;
  wide.ids = {0, kExperts, 1, 2};
  ASSERT_TRUE(WriteTraceBinary(wide, path).ok());
  r = Bench(fixture_path(), "--routing-trace " + path + " -n 2 -r 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(testing_util::Contains(r.err, path));
  EXPECT_TRUE(testing_util::Contains(r.err, "selects expert 8"));
  std::remove(path.c_str());
}

TEST_F(CliBenchTest, RecordedRoutingReplaysToTheSameHitsAndMisses) {
  // 6 slots for 2 layers x 8 experts, top-2: a mix of hits and misses.
  const std::string flags = "--arms graph,eager --slots 6 -p 0 -n 6 -r 2 -o json";
  const std::string first = TempPath("routing_a.mgtr");
  const std::string again = TempPath("routing_b.mgtr");
  const std::string replayed = TempPath("routing_c.jsonl");
  const ProcessResult a = Bench(fixture_path(), flags + " --record-routing " + first);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const ProcessResult b = Bench(fixture_path(), flags + " --record-routing " + again);
  ASSERT_EQ(b.exit_code, 0) << b.err;
  // Recording is bit-stable: the same run writes the same bytes.
  const std::string recorded = ReadFileToString(first);
  ASSERT_FALSE(recorded.empty());
  EXPECT_EQ(recorded, ReadFileToString(again));

  const ProcessResult c =
      Bench(fixture_path(), flags + " --routing-trace " + first + " --record-routing " + replayed);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  const auto original = BenchJsonRows(a.out);
  const auto replay = BenchJsonRows(c.out);
  ASSERT_EQ(original.size(), 2u) << a.out;
  ASSERT_EQ(replay.size(), original.size()) << c.out;
  for (size_t i = 0; i < original.size(); ++i) {
    EXPECT_NE(original[i].at("hits"), "0") << a.out;
    EXPECT_NE(original[i].at("misses"), "0") << a.out;
    EXPECT_EQ(replay[i].at("hits"), original[i].at("hits"));
    EXPECT_EQ(replay[i].at("misses"), original[i].at("misses"));
  }
  // The replay used exactly the recorded routing (written here as JSONL).
  absl::StatusOr<RoutingTrace> from_binary = ReadTrace(first);
  absl::StatusOr<RoutingTrace> from_replay = ReadTrace(replayed);
  ASSERT_TRUE(from_binary.ok()) << from_binary.status();
  ASSERT_TRUE(from_replay.ok()) << from_replay.status();
  // The first engine's steps: one untimed and r = 2 timed runs of tg6.
  EXPECT_EQ(from_binary->n_steps, (1 + 2) * 6);
  EXPECT_EQ(from_binary->ids, from_replay->ids);
  for (const std::string& p : {first, again, replayed}) std::remove(p.c_str());
}

// llama-bench's lists: -p, -n and -t each a row per value, -pg a pp+tg row, in
// llama-bench's order (pp, tg, pp+tg) within each thread count.
TEST_F(CliBenchTest, ListsExpandToARowPerCombination) {
  const ProcessResult r =
      Bench(fixture_path(), "--arms resident -p 2,3 -n 4,5 -pg 2,3 -t 1,2 -r 1 -o jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> got;
  for (absl::string_view line : absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    ASSERT_TRUE(JsonChecker(std::string(line)).Valid()) << line;  // jsonl: an object a line
    const std::vector<std::map<std::string, std::string>> rows =
        BenchJsonRows("[\n  " + std::string(line) + "\n]\n");
    ASSERT_EQ(rows.size(), 1u) << line;
    got.push_back(rows[0].at("n_threads") + " " + rows[0].at("test") + " " +
                  rows[0].at("n_prompt") + " " + rows[0].at("n_gen"));
  }
  const std::vector<std::string> want = {
      "1 \"pp2\" 2 0", "1 \"pp3\" 3 0", "1 \"tg4\" 0 4", "1 \"tg5\" 0 5", "1 \"pp2+tg3\" 2 3",
      "2 \"pp2\" 2 0", "2 \"pp3\" 3 0", "2 \"tg4\" 0 4", "2 \"tg5\" 0 5", "2 \"pp2+tg3\" 2 3"};
  EXPECT_EQ(got, want) << r.out;
}

// llama-bench's command line as its users type it: a repeated -p, -n, -pg or
// -t adds to its list (a value twice is a row twice), -pg 512,512 is a pair,
// -fa takes a list (ignored), --mmap 0 reads the file, -ub takes a list;
// -p defaults to 512;
// the rows carry llama-bench's field names, a tg row n_prompt 0.
TEST_F(CliBenchTest, LlamaBenchsCommandLineGivesItsRowsAndFields) {
  const ProcessResult r = Bench(fixture_path(),
                                "--arms resident -p 512,1024 -n 0 -pg 512,128 -p 64 -t 1,2 -r 1 "
                                "-fa 0,1 --mmap 0 -pg 8,8 -ub 512 -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(testing_util::Contains(r.err, "-fa is ignored")) << r.err;
  EXPECT_TRUE(testing_util::Contains(r.err, "read into memory")) << r.err;  // --mmap 0
  const std::vector<std::map<std::string, std::string>> rows = BenchJsonRows(r.out);
  std::vector<std::string> got;
  for (const auto& row : rows) {
    for (const char* key :
         {"model_filename", "model_type", "model_size", "model_n_params", "n_threads", "n_prompt",
          "n_gen", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts"}) {
      EXPECT_EQ(row.count(key), 1u) << key << " missing in " << r.out;
    }
    got.push_back(row.at("n_threads") + " " + row.at("n_prompt") + " " + row.at("n_gen"));
    // One sample: avg_ns is it, and avg_ts is the tokens over it.
    const std::string ns = row.at("samples_ns");
    EXPECT_EQ(ns, "[" + row.at("avg_ns") + "]");
    double avg_ns = 0, avg_ts = 0;
    ASSERT_TRUE(absl::SimpleAtod(row.at("avg_ns"), &avg_ns));
    ASSERT_TRUE(absl::SimpleAtod(row.at("avg_ts"), &avg_ts));
    int n_prompt = 0, n_gen = 0;
    ASSERT_TRUE(absl::SimpleAtoi(row.at("n_prompt"), &n_prompt));
    ASSERT_TRUE(absl::SimpleAtoi(row.at("n_gen"), &n_gen));
    EXPECT_NEAR(avg_ts, (n_prompt + n_gen) / (avg_ns * 1e-9), avg_ts * 1e-3) << row.at("avg_ns");
  }
  const std::vector<std::string> want = {"1 512 0", "1 1024 0", "1 64 0", "1 512 128", "1 8 8",
                                         "2 512 0", "2 1024 0", "2 64 0", "2 512 128", "2 8 8"};
  EXPECT_EQ(got, want) << r.out;

  // -ub lists too: a row group each, inside each thread count.
  const ProcessResult ub = Bench(fixture_path(), "--arms resident -p 64 -n 0 -t 1 -ub 8,16 "
                                                 "-ub 32 -r 1 -o json");
  ASSERT_EQ(ub.exit_code, 0) << ub.err;
  std::vector<std::string> ubatches;
  for (const auto& row : BenchJsonRows(ub.out)) ubatches.push_back(row.at("n_ubatch"));
  EXPECT_EQ(ubatches, (std::vector<std::string>{"8", "16", "32"})) << ub.out;

  // The defaults are llama-bench's: pp512 and tg128 (tg rows' n_prompt 0).
  const ProcessResult d = Bench(fixture_path(), "--arms resident -r 1 -o json");
  ASSERT_EQ(d.exit_code, 0) << d.err;
  const std::vector<std::map<std::string, std::string>> defaults = BenchJsonRows(d.out);
  ASSERT_EQ(defaults.size(), 2u) << d.out;
  EXPECT_EQ(defaults[0].at("test"), "\"pp512\"");
  EXPECT_EQ(defaults[1].at("test"), "\"tg128\"");
  EXPECT_EQ(defaults[1].at("n_prompt"), "0");
}

// -o csv: a header and a row per test that Python's csv module reads back, with
// the values of the JSON rows.
TEST_F(CliBenchTest, CsvParsesWithPythonsCsvModule) {
  const ProcessResult csv =
      Bench(fixture_path(), "--arms resident,graph --slots 4 -p 0 -n 3 -r 2 -o csv");
  ASSERT_EQ(csv.exit_code, 0) << csv.err;
  const std::string path = TempPath("bench.csv");
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fwrite(csv.out.data(), 1, csv.out.size(), f);
    std::fclose(f);
  }
  // Python prints each row's arm, test, slots and sample count, and the column count.
  const ProcessResult py = testing_util::RunProcess(
      {"/usr/bin/env", "python3", "-c",
       "import csv, sys\n"
       "rows = list(csv.DictReader(open(sys.argv[1], newline='')))\n"
       "for r in rows: print(r['arm'], r['test'], r['slots'], len(r['samples_ts'].split()), "
       "float(r['avg_ts']) > 0, r['model_type'])\n",
       path});
  ASSERT_EQ(py.exit_code, 0) << py.err;
  EXPECT_EQ(py.out,
            "resident tg3 0 2 True qwen3moe 2L 8x top-2 f32\n"
            "graph tg3 4 2 True qwen3moe 2L 8x top-2 f32\n")
      << csv.out;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace moegraph
