// Every value a user can get wrong, on the binary as a user runs it: each bad
// value of every command's flags exits 1 or 2 with a message naming the flag
// (or the file), never a signal, and fails before it allocates (the README's
// fixture with --ctx 100000000 asks for a 190 GiB KV cache; the process stays
// under 100 MB).
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;
using testing_util::ProcessResult;
using testing_util::RunProcess;

constexpr uint64_t kMaxRssKib = 100 * 1024;

class CliValuesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The README's fixture (make fixture's flags).
    fixture_ = new std::string(testing_util::TempPath("readme_fixture.gguf"));
    const ProcessResult made = RunProcess({MOEGRAPH_BIN,
                                           "make-fixture",
                                           "--arch",
                                           "qwen3moe",
                                           "--layers",
                                           "4",
                                           "--experts",
                                           "16",
                                           "--top-k",
                                           "4",
                                           "--embd",
                                           "256",
                                           "--ff",
                                           "256",
                                           "--heads",
                                           "8",
                                           "--kv-heads",
                                           "4",
                                           "--vocab",
                                           "512",
                                           "--quant",
                                           "q8_0,expert=q4_K",
                                           "--router-skew",
                                           "2",
                                           "--seed",
                                           "1",
                                           "-o",
                                           *fixture_});
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*fixture_);
    delete fixture_;
  }
  static std::string* fixture_;
};
std::string* CliValuesTest::fixture_ = nullptr;

struct Case {
  std::vector<std::string> args;  // after the binary; FIXTURE is the README fixture
  std::string named;              // what the message must hold
};

TEST_F(CliValuesTest, EveryBadValueExitsOneOrTwoNamingTheFlagWithoutAllocating) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  const std::vector<Case> cases = {
      // run: the context and the counts
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "100000000"}, "--ctx 100000000"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "1000000000"}, "--ctx 1000000000"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-c", "2147483647"}, "--ctx 2147483647"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "99999999999"}, "ctx"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "abc"}, "ctx"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "-5"}, "--ctx -5 must not be negative"},
      {{"run", "-m", "FIXTURE", "--tokens", "1,2,3", "-n", "4", "--ctx", "5"},
       "--ctx 5 is too small"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-n", "-2"}, "-n -2"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-n", "many"}, "-n 'many'"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-n", "-1", "--ctx", "1"}, "--ctx 1"},
      // run: threads, sampling, backend, slots
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-t", "-3"}, "-t -3: threads must be at least 1"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "-t", "abc"}, "-t 'abc'"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--temp", "-1"}, "--temp"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--temp", "nan"}, "--temp"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--top-p", "2"}, "--top-p"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--min-p", "-1"}, "--min-p"},
      {{"make-fixture", "--top-k", "-1", "-o", dir + "/never.gguf"}, "--top-k -1"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--seed", "-5"}, "--seed"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--slots", "0"}, "--slots"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--slots", "-1"}, "--slots"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--slots", "lots"}, "--slots"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--steps-per-launch", "0"}, "--steps-per-launch"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--steps-per-launch", "1000000"},
       "--steps-per-launch"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--kv-type", "q4_0"}, "--kv-type"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--backend", "tpu"}, "--backend"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--arm", "warp"}, "--arm"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--n-cpu-moe", "-2"}, "--n-cpu-moe"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--host-cache", "lots"}, "--host-cache 'lots'"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--host-cache", "-1G"}, "--host-cache '-1G'"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--host-cache", "1K"},
       "fewer than one token's working set (4 MoE layers x 4 experts = 16"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--host-cache", "8M", "--slots", "20"},
       "--host-cache sizes the expert cache"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--host-cache", "8M", "--load-mode", "none"},
       "leave out --load-mode"},
      {{"serve", "-m", "FIXTURE", "--host-cache", "1K", "--port", "0"},
       "fewer than one token's working set"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--drop-cold-experts", "-1"},
       "--drop-cold-experts -1 must be 0 (off) or more"},
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--drop-cold-experts", "x"},
       "--drop-cold-experts 'x' is not a number"},
      // run: prompts and files
      {{"run", "-m", "FIXTURE", "--tokens", "1,x"}, "--tokens"},
      {{"run", "-m", "FIXTURE", "--tokens", "99999"}, "--tokens"},
      {{"run", "-m", "FIXTURE", "-f", dir}, "-f " + dir + ": is a folder"},
      {{"run", "-m", "FIXTURE", "-f", "/nonexistent/prompt.txt"}, "-f /nonexistent/prompt.txt"},
      {{"run", "-m", "/nonexistent/model.gguf", "--tokens", "1"},
       "/nonexistent/model.gguf: cannot open: No such file or directory"},
      {{"run", "-m", dir, "--tokens", "1"}, dir + ": not a regular file"},
      {{"run", "--tokens", "1"}, "-m FILE is required"},
      // chat and serve
      {{"chat", "-m", "FIXTURE", "--ctx", "-1"}, "--ctx -1"},
      {{"chat", "-m", "FIXTURE", "-n", "0"}, "-n 0"},
      {{"chat", "-m", "FIXTURE", "-n", "-5"}, "-n -5"},
      {{"chat", "-m", "FIXTURE", "--ctx", "100000000"}, "--ctx 100000000"},
      {{"serve", "-m", "FIXTURE", "--port", "70000"}, "--port 70000"},
      {{"serve", "-m", "FIXTURE", "--port", "-1"}, "--port -1"},
      {{"serve", "-m", "FIXTURE", "--max-queue", "-1"}, "--max-queue -1"},
      {{"serve", "-m", "FIXTURE", "--max-queue", "100000000"}, "--max-queue 100000000"},
      {{"serve", "-m", "FIXTURE", "--max-body", "0"}, "--max-body 0"},
      {{"serve", "-m", "FIXTURE", "--timeout", "0"}, "--timeout 0"},
      {{"serve", "-m", "FIXTURE", "--ctx", "-1"}, "--ctx -1"},
      {{"serve", "-m", "FIXTURE", "--ctx", "100000000"}, "--ctx 100000000"},
      // bench
      {{"bench", "-m", "FIXTURE", "-r", "0"}, "-r 0"},
      {{"bench", "-m", "FIXTURE", "-p", "-1"}, "-p '-1'"},
      {{"bench", "-m", "FIXTURE", "-n", "x"}, "-n 'x'"},
      {{"bench", "-m", "FIXTURE", "-n", "100", "--ctx", "5"}, "--ctx 5"},
      {{"bench", "-m", "FIXTURE", "-n", "100000000"}, "--ctx 100000001"},
      {{"bench", "-m", "FIXTURE", "-o", "xml"}, "-o 'xml'"},
      {{"bench", "-m", "FIXTURE", "-t", "1,-2"}, "-t -2"},
      // make-fixture, tokenize, trace, simulate, inspect
      {{"make-fixture", "-o", "/nonexistent/x.gguf"},
       "/nonexistent/x.gguf: cannot create: No such file or directory"},
      {{"make-fixture", "-o", dir}, dir + ": cannot create: Is a directory"},
      {{"make-fixture", "--layers", "-1", "-o", dir + "/never.gguf"}, "--layers -1"},
      {{"make-fixture", "--vocab", "1", "-o", dir + "/never.gguf"}, "--vocab 1"},
      {{"make-fixture", "--seed", "-2", "-o", dir + "/never.gguf"}, "--seed"},
      {{"make-fixture", "--experts", "512", "--embd", "65536", "--ff", "65536", "-o",
        dir + "/never.gguf"},
       "largest tensor takes 8192.00 GiB"},
      {{"tokenize", "-m", "FIXTURE", "-f", dir}, "-f " + dir},
      {{"trace", "synth", "--steps", "100000000000", "-o", dir + "/never.bin"}, "--steps"},
      {{"simulate", "--trace", "/nonexistent/t.jsonl"}, "/nonexistent/t.jsonl"},
      {{"inspect", "/nonexistent/model.gguf"}, "/nonexistent/model.gguf: cannot open"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {MOEGRAPH_BIN};
    std::string shown;
    for (const std::string& arg : c.args) {
      argv.push_back(arg == "FIXTURE" ? *fixture_ : arg);
      shown += " " + arg;
    }
    const ProcessResult r = RunProcess(argv);
    EXPECT_EQ(r.signal, 0) << shown;
    EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << shown << ": exit " << r.exit_code;
    EXPECT_TRUE(Contains(r.err, c.named)) << shown;
    EXPECT_LT(r.peak_rss_kib, kMaxRssKib) << shown;
    // A file's reason is said once.
    EXPECT_EQ(r.err.find("directory: No such"), std::string::npos) << shown << ": " << r.err;
  }
}

TEST_F(CliValuesTest, ThreadsAboveTheLogicalCpusAreClampedWithAWarning) {
  const ProcessResult r =
      RunProcess({MOEGRAPH_BIN, "run", "-m", *fixture_, "--tokens", "1", "-n", "2", "-t", "999"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.err, "warning: -t 999: this machine has ")) << r.err;
  const size_t logical = std::thread::hardware_concurrency();
  EXPECT_TRUE(Contains(r.out, "backend cpu: " + std::to_string(logical) + " thread")) << r.out;
}

TEST_F(CliValuesTest, AContextAboveTheModelsIsAWarningAndMinusOneRunsToTheEnd) {
  // The fixture says context_length 4096.
  const ProcessResult above = RunProcess(
      {MOEGRAPH_BIN, "run", "-m", *fixture_, "--tokens", "1", "-n", "2", "--ctx", "5000"});
  ASSERT_EQ(above.exit_code, 0) << above.err;
  EXPECT_TRUE(Contains(above.out, "warning: a context of 5000 positions is above the 4096"))
      << above.out;
  // -n -1: until the context is full (no tokenizer, so no end-of-generation).
  const ProcessResult to_end = RunProcess(
      {MOEGRAPH_BIN, "run", "-m", *fixture_, "--tokens", "1,2", "-n", "-1", "--ctx", "12"});
  ASSERT_EQ(to_end.exit_code, 0) << to_end.err;
  EXPECT_EQ(testing_util::IdsAfter(to_end.out, "generated").size(), 11u) << to_end.out;
  EXPECT_TRUE(Contains(to_end.out, "2 prompt tokens")) << to_end.out;
  EXPECT_TRUE(Contains(to_end.out, "+ 11 generated")) << to_end.out;
  EXPECT_TRUE(Contains(to_end.out, "= 13;")) << to_end.out;
}

// Every check that needs only the header runs before the weights are read
// (--load-mode none reads them and says so on a "load:" line): a bad value
// fails at once whatever the file's size, as llama-server binds its port first.
TEST_F(CliValuesTest, ChecksThatNeedNoWeightsFailBeforeTheWeightsAreRead) {
  const std::string junk = testing_util::TempPath("junk-prompt.txt");
  {
    std::FILE* f = std::fopen(junk.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite("\xff\xfe\x00abc", 1, 6, f);
    std::fclose(f);
  }
  const std::vector<Case> cases = {
      {{"run", "-m", "FIXTURE", "--tokens", "1", "--ctx", "1000000000"}, "KV cache of"},
      {{"run", "-m", "FIXTURE", "--tokens", "1,2,3", "-n", "8", "--ctx", "4"}, "--ctx 4 is too small"},
      {{"run", "-m", "FIXTURE", "-f", "/dev/null"}, "the prompt has no tokens"},
      {{"run", "-m", "FIXTURE", "-f", junk}, "not valid UTF-8"},
      {{"run", "-m", "FIXTURE", "--tokens", "100000"}, "outside the vocabulary"},
      {{"chat", "-m", "FIXTURE", "--chat-template", "bogus"}, "--chat-template"},
      {{"chat", "-m", "FIXTURE", "--ctx", "1000000000"}, "KV cache of"},
      {{"bench", "-m", "FIXTURE", "--routing-trace", "/nonexistent"}, "--routing-trace"},
      {{"bench", "-m", "FIXTURE", "--ctx", "1000000000", "-p", "0", "-n", "1"}, "KV cache of"},
      {{"perplexity", "-m", "FIXTURE", "-f", "/dev/null"}, "0 tokens"},
      {{"serve", "-m", "FIXTURE", "--host", "192.0.2.1", "--port", "0"}, "--host 192.0.2.1"},
      {{"serve", "-m", "FIXTURE", "--ctx", "1000000000", "--port", "0"}, "KV cache of"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {"/usr/bin/timeout", "60", MOEGRAPH_BIN};
    for (const std::string& a : c.args) argv.push_back(a == "FIXTURE" ? *fixture_ : a);
    argv.insert(argv.end(), {"--backend", "cpu", "--load-mode", "none"});
    const ProcessResult r = RunProcess(argv);
    const std::string all = r.out + r.err;
    EXPECT_EQ(r.exit_code, 1) << all;
    EXPECT_TRUE(Contains(all, c.named)) << c.named << " not in: " << all;
    EXPECT_FALSE(Contains(all, "load: ")) << "the weights were read first: " << all;
  }
  // The same flags that are fine read them.
  const ProcessResult ok = RunProcess({MOEGRAPH_BIN, "run", "-m", *fixture_, "--tokens", "1",
                                       "-n", "2", "--backend", "cpu", "--load-mode", "none"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(Contains(ok.err, "load: ")) << ok.err;
  std::filesystem::remove(junk);
}

// The disk tier: misses read from the file into a host cache of --host-cache
// bytes (here 2 MiB, 18 slots of the fixture's 64 experts, just over one
// token's 16), the tokens those of the run with every expert in memory.
TEST_F(CliValuesTest, TheHostCacheReadsMissesFromTheFileAndChangesNoToken) {
  const std::vector<std::string> run = {MOEGRAPH_BIN, "run",  "-m", *fixture_, "-p",
                                        "Hello",      "-n",   "24", "--backend", "cpu"};
  const ProcessResult resident = RunProcess(run);
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  std::vector<std::string> cached = run;
  cached.insert(cached.end(), {"--host-cache", "2M"});
  const ProcessResult disk = RunProcess(cached);
  ASSERT_EQ(disk.exit_code, 0) << disk.err;
  EXPECT_EQ(disk.out, resident.out);
  EXPECT_TRUE(Contains(disk.err, "host cache: 18 expert slots in 2 MiB (--host-cache) for "
                                 "6.75 MiB of experts; misses read from " + *fixture_))
      << disk.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(disk.err, m, std::regex(R"((\d+) misses, (\d+) evictions.*\((\d+) disk reads)")))
      << disk.err;
  EXPECT_GT(std::stoi(m[1]), 0);
  EXPECT_GT(std::stoi(m[2]), 0) << "a cache under the experts evicts";
  EXPECT_EQ(m[1], m[3]) << "each miss is a read";
  EXPECT_FALSE(Contains(resident.err, "disk reads")) << resident.err;
}

// --host-cache's default: a file whose tensors do not fit in the memory
// available (MOEGRAPH_MEM_AVAILABLE standing in for MemAvailable) less the
// 1 GiB rail gets a host cache of what the rest leaves, said with its
// arithmetic, and the same tokens; where that is under one token's working
// set the file is mapped as before. A size that is not one is an error.
TEST_F(CliValuesTest, AFileBiggerThanMemoryGetsAHostCacheOfWhatTheRestLeaves) {
  const std::vector<std::string> run = {MOEGRAPH_BIN, "run",  "-m", *fixture_, "-p",
                                        "Hello",      "-n",   "24", "--backend", "cpu"};
  const ProcessResult resident = RunProcess(run);
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  const uint64_t file = std::filesystem::file_size(*fixture_);
  const auto with_memory = [&](uint64_t available) {
    std::vector<std::string> argv = {"/usr/bin/env",
                                     "MOEGRAPH_MEM_AVAILABLE=" + std::to_string(available)};
    argv.insert(argv.end(), run.begin(), run.end());
    return RunProcess(argv);
  };
  constexpr uint64_t kGiB = uint64_t{1} << 30, kMiB = uint64_t{1} << 20;
  // The fixture's 6.75 MiB of experts less 2 MiB: some 4.7 MiB of slots.
  const ProcessResult cached = with_memory(kGiB + file - 2 * kMiB);
  ASSERT_EQ(cached.exit_code, 0) << cached.err;
  EXPECT_EQ(cached.out, resident.out);
  EXPECT_TRUE(std::regex_search(
      cached.err,
      std::regex(R"(host cache: auto: the file's [0-9.]+ MiB of tensors do not fit in memory; )"
                 R"(1\.01 GiB available \(MOEGRAPH_MEM_AVAILABLE, MemAvailable or the memory cgroup's )"
                 R"(room\) - [0-9.]+ MiB )"
                 R"(of other tensors - [0-9.]+ MiB of KV cache and state - a 1 GiB rail = )"
                 R"([0-9.]+ MiB for 6\.75 MiB of experts \(--host-cache SIZE sets it\))")))
      << cached.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(cached.err, m, std::regex(R"(host cache: (\d+) expert slots)")))
      << cached.err;
  EXPECT_GE(std::stoi(m[1]), 16) << "one token's working set at least";
  EXPECT_LT(std::stoi(m[1]), 64) << "fewer than the experts";
  EXPECT_TRUE(std::regex_search(cached.err, std::regex(R"(\((\d+) disk reads)"))) << cached.err;
  // Less than a working set left: mapped, no cache.
  const ProcessResult mapped = with_memory(kGiB + file - 6 * kMiB);
  ASSERT_EQ(mapped.exit_code, 0) << mapped.err;
  EXPECT_EQ(mapped.out, resident.out);
  EXPECT_TRUE(Contains(mapped.err, "of tensors do not fit, but 1.00 GiB available"))
      << mapped.err;
  EXPECT_FALSE(Contains(mapped.err, "disk reads")) << mapped.err;
  // The file fits: nothing said, nothing changed.
  const ProcessResult fits = with_memory(kGiB + file + 64 * kMiB);
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_FALSE(Contains(fits.err, "host cache")) << fits.err;
  const ProcessResult bad = with_memory(0);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_TRUE(Contains(bad.err, "MOEGRAPH_MEM_AVAILABLE='0' is not a size")) << bad.err;
}

// As llama.cpp's -c 0, run's default context is at most the model's: a huge -n
// never sizes the KV cache; generation stops when the context is full, with a
// note (the fixture's context_length is 64).
TEST_F(CliValuesTest, AHugeMinusNStopsAtTheModelsContextWithoutSizingMemory) {
  const std::string small = testing_util::TempPath("ctx64.gguf");
  const ProcessResult made =
      RunProcess({MOEGRAPH_BIN, "make-fixture", "--ctx", "64", "-o", small});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", small, "--tokens", "1,2,3", "-n",
                                      "2000000000", "--backend", "cpu"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(testing_util::IdsAfter(r.out, "generated").size(), 62u) << r.out;
  EXPECT_TRUE(Contains(r.err, "note: -n 2000000000: the context (--ctx 0: 64 positions")) << r.err;
  // An explicit --ctx still must hold the prompt and -n.
  const ProcessResult explicit_ctx = RunProcess({MOEGRAPH_BIN, "run", "-m", small, "--tokens",
                                                 "1", "-n", "2000000000", "--ctx", "128"});
  EXPECT_EQ(explicit_ctx.exit_code, 1);
  EXPECT_TRUE(Contains(explicit_ctx.err, "--ctx 128 is too small")) << explicit_ctx.err;
  std::filesystem::remove(small);
}

}  // namespace
}  // namespace moegraph
