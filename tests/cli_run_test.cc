// `moegraph run` as a user runs it: the binary in a subprocess on a fixture file,
// its generated ids checked against the oracle run in-process at several slot
// counts, and its banner and summary lines against the fixture's geometry.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "capture/engine.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "reference/oracle.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::CommandResult;
using testing_util::IdsAfter;
using testing_util::RunCommand;

// `moegraph run ARGS` with stdout only, or stdout and stderr together.
CommandResult RunMoegraph(const std::string& args, bool with_stderr) {
  return RunCommand(std::string(MOEGRAPH_BIN) + " run " + args +
                    (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

class CliRunTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() {
    FixtureSpec spec;
    spec.arch = Arch::kQwen3Moe;
    spec.router_skew = 1.0f;
    spec.seed = 21;
    WriteSuiteFixture(spec, "cli_run.gguf");
  }
};

TEST_F(CliRunTest, GeneratedIdsEqualTheOracleInProcess) {
  const std::vector<int32_t> prompt = {1, 2, 3};
  constexpr int kPredict = 8;
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(fixture_path());
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<Oracle>> oracle =
      Oracle::Create(*model, static_cast<int>(prompt.size()) + kPredict);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  absl::StatusOr<std::vector<int32_t>> want = (*oracle)->Generate(prompt, kPredict);
  ASSERT_TRUE(want.ok()) << want.status();

  // Every slot count, down to heavy eviction at --slots 2 (top-k), gives the oracle's ids.
  for (const char* args : {"--backend auto", "--backend cpu", "--backend cpu --slots 2",
                           "--slots 5", "--slots auto"}) {
    const CommandResult run =
        RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 8 " + args, /*with_stderr=*/false);
    ASSERT_EQ(run.exit_code, 0) << args << "\n" << run.output;
    EXPECT_EQ(IdsAfter(run.output, "prompt"), prompt) << run.output;
    EXPECT_EQ(IdsAfter(run.output, "generated"), *want) << run.output;
    EXPECT_NE(run.output.find("tok/s"), std::string::npos) << run.output;
  }
}

// Every load mode decodes the default's tokens; those that read the file say
// so on stderr; contradictory or unknown spellings are refused naming the flag.
TEST_F(CliRunTest, LoadModesDecodeTheSameTokens) {
  const std::string base = "-m " + fixture_path() + " --tokens 1,2,3 -n 8 --backend cpu ";
  const CommandResult plain = RunMoegraph(base, /*with_stderr=*/false);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::vector<int32_t> want = IdsAfter(plain.output, "generated");
  ASSERT_EQ(want.size(), 8u) << plain.output;
  struct Case {
    const char* flags;
    const char* line;  // on stderr
  };
  for (const Case& c :
       {Case{"--load-mode none", "read into memory"}, Case{"--no-mmap", "read into memory"},
        Case{"--load-mode mmap", "mapped, faulted in"}, Case{"--mmap", "mapped, faulted in"},
        Case{"--load-mode auto", "read into memory"}, Case{"--load-mode mlock", "read into memory"},
        Case{"--mlock", "mapped, faulted in"}, Case{"--no-mmap --mlock", "read into memory"}}) {
    const CommandResult run = RunMoegraph(base + c.flags, /*with_stderr=*/true);
    // A lock the machine refuses names the limit (a small RLIMIT_MEMLOCK, no CAP_IPC_LOCK).
    if (run.exit_code != 0 && run.output.find("RLIMIT_MEMLOCK") != std::string::npos) continue;
    ASSERT_EQ(run.exit_code, 0) << c.flags << "\n" << run.output;
    EXPECT_EQ(IdsAfter(run.output, "generated"), want) << c.flags << "\n" << run.output;
    EXPECT_NE(run.output.find(std::string("of tensors ") + c.line), std::string::npos)
        << c.flags << "\n"
        << run.output;
  }
  for (const char* bad :
       {"--load-mode bogus", "--load-mode dio", "--mmap --no-mmap", "--load-mode none --mlock"}) {
    const CommandResult run = RunMoegraph(base + bad, /*with_stderr=*/true);
    EXPECT_NE(run.exit_code, 0) << bad;
    EXPECT_NE(run.output.find(std::string(bad).substr(0, std::string(bad).find(' '))),
              std::string::npos)
        << bad << "\n"
        << run.output;
  }
}

// --temp > 0 samples: one seed gives one generation, another seed another (the
// fixture's logits are nearly flat), and without --seed the banner prints the
// random seed it drew, which reproduces the run.
TEST_F(CliRunTest, SamplingFollowsTheSeedAndTheBannerNamesIt) {
  const std::string base =
      "-m " + fixture_path() + " --tokens 1,2,3 -n 12 --temp 1.0 --backend cpu";
  const CommandResult a = RunMoegraph(base + " --seed 7", false);
  const CommandResult b = RunMoegraph(base + " --seed 7", false);
  const CommandResult c = RunMoegraph(base + " --seed 8", false);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(IdsAfter(a.output, "generated"), IdsAfter(b.output, "generated"));
  EXPECT_NE(IdsAfter(a.output, "generated"), IdsAfter(c.output, "generated"));

  const CommandResult unseeded = RunMoegraph(base, /*with_stderr=*/true);
  ASSERT_EQ(unseeded.exit_code, 0) << unseeded.output;
  const size_t at = unseeded.output.find(", seed ");
  ASSERT_NE(at, std::string::npos) << unseeded.output;
  const std::string seed = unseeded.output.substr(at + 7, unseeded.output.find('\n', at) - at - 7);
  EXPECT_TRUE(testing_util::Contains(unseeded.output,
                                     "sampling: temp 1.00, top-k 40, top-p 0.95, min-p 0.05"));
  const CommandResult replay = RunMoegraph(base + " --seed " + seed, false);
  EXPECT_EQ(IdsAfter(replay.output, "generated"), IdsAfter(unseeded.output, "generated"));

  // Greedy by default.
  const CommandResult greedy = RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 2", true);
  EXPECT_TRUE(testing_util::Contains(greedy.output, "sampling: greedy (--temp 0)"));
}

TEST_F(CliRunTest, SamplingSettingsOutOfRangeNameTheFlag) {
  const std::string base = "-m " + fixture_path() + " --tokens 1,2,3 -n 2 ";
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--temp -0.5", "--temp -0.5 must be 0 (greedy) or positive"},
           {"--top-p 1.5", "--top-p 1.5 must be in (0, 1]"},
           {"--min-p -0.1", "--min-p -0.1 must be in [0, 1]"},
           {"--seed -9", "--seed -9 is negative"}}) {
    const CommandResult r = RunMoegraph(base + args, /*with_stderr=*/true);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_TRUE(testing_util::Contains(r.output, message)) << args << ": " << r.output;
  }
  // As llama.cpp: a top-k of 0 or less keeps every token, and a seed of -1 is random.
  const CommandResult off = RunMoegraph(base + "--temp 1 --top-k -1 --seed -1", true);
  EXPECT_EQ(off.exit_code, 0) << off.output;
  EXPECT_TRUE(testing_util::Contains(off.output, "top-k 0,")) << off.output;
}

// The number before `suffix` on the line starting with `label`, or -1.
double NumberBefore(const std::string& output, const std::string& label,
                    const std::string& suffix) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(label, 0) != 0) continue;
    const size_t end = line.find(suffix);
    if (end == std::string::npos) return -1;
    const size_t begin = line.find_last_of(" (", end - 1);
    return std::stod(line.substr(begin + 1, end - begin - 1));
  }
  return -1;
}

TEST_F(CliRunTest, TheBannerShowsTheSlotsAndTheSummaryTheCacheWork) {
  // --slots auto on the CPU is resident: the experts are read in place, each a hit.
  const CommandResult in_place =
      RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 8", false);
  ASSERT_EQ(in_place.exit_code, 0) << in_place.output;
  EXPECT_TRUE(testing_util::Contains(in_place.output,
                                     "backend cpu: resident, every expert read "
                                     "in place from the model's bytes"))
      << in_place.output;
  EXPECT_EQ(NumberBefore(in_place.output, "backend cpu: 3 prompt tokens", "%"), 100)
      << in_place.output;
  EXPECT_EQ(NumberBefore(in_place.output, "backend cpu: 3 prompt tokens", " misses"), 0)
      << in_place.output;
  EXPECT_EQ(NumberBefore(in_place.output, "backend cpu: 3 prompt tokens", " MiB staged"), 0)
      << in_place.output;

  // The fixture has 2 layers of 8 experts: 16 slots hold them all, nothing is evicted.
  const CommandResult all =
      RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 8 --slots 16", false);
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_EQ(NumberBefore(all.output, "backend cpu: hazard", " slots;"), 16) << all.output;
  EXPECT_EQ(NumberBefore(all.output, "backend cpu: 3 prompt tokens", " evictions"), 0)
      << all.output;
  const double all_misses = NumberBefore(all.output, "backend cpu: 3 prompt tokens", " misses");
  EXPECT_GT(all_misses, 0) << all.output;
  EXPECT_LE(all_misses, 16) << all.output;

  // 2 slots for 2 layers with top-k 2: every step of every layer misses.
  const CommandResult tight =
      RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 8 --slots 2", false);
  ASSERT_EQ(tight.exit_code, 0) << tight.output;
  EXPECT_EQ(NumberBefore(tight.output, "backend cpu: hazard", " slots;"), 2) << tight.output;
  EXPECT_EQ(NumberBefore(tight.output, "backend cpu: 3 prompt tokens", " misses"), 10 * 2 * 2)
      << tight.output;
  EXPECT_EQ(NumberBefore(tight.output, "backend cpu: 3 prompt tokens", "%"), 0) << tight.output;
  EXPECT_GT(NumberBefore(tight.output, "backend cpu: 3 prompt tokens", " evictions"), 0)
      << tight.output;
}

// The figures of the summary's "peak RSS R MiB (file F MiB, KV cache K MiB)".
struct MemoryFigures {
  double rss = -1, file = -1, kv = -1;
};
MemoryFigures MemoryOf(const std::string& output) {
  MemoryFigures m;
  const size_t at = output.find("peak RSS ");
  if (at == std::string::npos) return m;
  std::sscanf(output.c_str() + at, "peak RSS %lf MiB (file %lf MiB, KV cache %lf MiB)", &m.rss,
              &m.file, &m.kv);
  return m;
}

// Memory of a resident run: the file's pages and the KV cache, no copy of the
// experts, so peak RSS stays under (file + KV cache) * 1.1 (the process's own
// few MiB fit in the 10% of a file this size). A cache holding every expert
// copies them twice (the store, then the slots), and the figure shows it.
TEST(CliRunMemoryTest, AResidentRunStaysUnderTheFileAndKvCachePlusTenPercent) {
  FixtureSpec spec;
  spec.n_layer = 4;
  spec.n_expert = 32;
  spec.n_expert_used = 4;
  spec.n_embd = 1024;
  spec.n_ff_exp = 512;
  spec.n_head = 16;
  spec.n_head_kv = 4;
  spec.n_vocab = 4096;
  spec.dense_type = GgmlType::kQ8_0;
  spec.expert_type = GgmlType::kQ8_0;
  spec.expert_variants = 2;  // 4 x 32 x 3 x 0.5 MiB of experts, two of them quantized
  const std::string path = testing_util::TempPath("cli_run_memory.gguf");
  ASSERT_TRUE(WriteFixture(spec, path).ok());

  const std::string run = "-m " + path + " --tokens 1,2,3 -n 64 --backend cpu --ctx 4096";
  const CommandResult resident = RunMoegraph(run, true);
  ASSERT_EQ(resident.exit_code, 0) << resident.output;
  const MemoryFigures in_place = MemoryOf(resident.output);
  ASSERT_GT(in_place.file, 200) << resident.output;
  ASSERT_GT(in_place.kv, 0) << resident.output;
  EXPECT_LT(in_place.rss, (in_place.file + in_place.kv) * 1.1) << resident.output;

  const CommandResult cached = RunMoegraph(run + " --slots 128", true);
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  const double expert_mib = 4 * 32 * 3 * (1024.0 * 512 / 32 * 34) / (1 << 20);
  EXPECT_GT(MemoryOf(cached.output).rss, in_place.rss + expert_mib) << cached.output;
  std::remove(path.c_str());
}

TEST_F(CliRunTest, BadSlotCountsNameTheFlag) {
  const CommandResult below =
      RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2 --slots 1", true);
  EXPECT_EQ(below.exit_code, 1);
  EXPECT_NE(below.output.find("--slots 1 is below the 2 experts a token selects"), std::string::npos)
      << below.output;
  const CommandResult word =
      RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2 --slots many", true);
  EXPECT_EQ(word.exit_code, 1);
  EXPECT_NE(word.output.find("--slots 'many'"), std::string::npos) << word.output;
}

TEST_F(CliRunTest, AnExplicitContextGivesTheSameIds) {
  const CommandResult fitted = RunMoegraph("-m " + fixture_path() + " --tokens 7,8 -n 4", false);
  const CommandResult roomy =
      RunMoegraph("-m " + fixture_path() + " --tokens 7,8 -n 4 --ctx 64", false);
  ASSERT_EQ(fitted.exit_code, 0) << fitted.output;
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  EXPECT_EQ(IdsAfter(fitted.output, "generated").size(), 4u);
  EXPECT_EQ(IdsAfter(fitted.output, "generated"), IdsAfter(roomy.output, "generated"));
}

TEST_F(CliRunTest, ABadTokenListExitsNonZeroNamingTokens) {
  const CommandResult run = RunMoegraph("-m " + fixture_path() + " --tokens 1,x -n 2", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--tokens"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("'x'"), std::string::npos) << run.output;
}

TEST_F(CliRunTest, ATokenOutsideTheVocabularyExitsNonZero) {
  // The fixture's vocabulary is 256 ids.
  const CommandResult run = RunMoegraph("-m " + fixture_path() + " --tokens 1,256 -n 2", true);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find("--tokens: token 256"), std::string::npos) << run.output;
}

TEST_F(CliRunTest, MissingTokensOrModelAreErrorsNamingTheFlag) {
  const CommandResult no_tokens = RunMoegraph("-m " + fixture_path() + " -n 2", true);
  EXPECT_EQ(no_tokens.exit_code, 1);
  EXPECT_NE(no_tokens.output.find("--tokens"), std::string::npos) << no_tokens.output;
  const CommandResult no_model = RunMoegraph("--tokens 1 -n 2", true);
  EXPECT_EQ(no_model.exit_code, 1);
  EXPECT_NE(no_model.output.find("-m FILE"), std::string::npos) << no_model.output;
}

TEST_F(CliRunTest, AMissingFileIsAnErrorNamingIt) {
  const std::string missing = ::testing::TempDir() + "moegraph_no_such_model.gguf";
  const CommandResult run = RunMoegraph("-m " + missing + " --tokens 1 -n 2", true);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find(missing), std::string::npos) << run.output;
}

// This test runs where CI does: without a GPU, where --backend cuda must refuse
// with a message rather than fall back silently.
TEST_F(CliRunTest, TheCudaBackendWithoutADeviceIsAnError) {
  if (CudaDeviceCount() > 0)
    GTEST_SKIP() << "a CUDA device is present; the engine GPU tests cover it";
  const CommandResult run =
      RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2 --backend cuda", true);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find("--backend cuda: no CUDA device (--verbose gives the CUDA runtime's "
                            "reason)"),
            std::string::npos)
      << run.output;
  const CommandResult verbose =
      RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2 --backend cuda --verbose", true);
  EXPECT_EQ(verbose.exit_code, 1);
  EXPECT_NE(verbose.output.find("--backend cuda: no CUDA device (cudaGetDeviceCount"),
            std::string::npos)
      << verbose.output;
  // auto falls back, and says so in one line; the runtime's words only with --verbose.
  const CommandResult fallback = RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2", true);
  EXPECT_EQ(fallback.exit_code, 0) << fallback.output;
  EXPECT_NE(fallback.output.find("no CUDA device: running on the CPU backend\n"), std::string::npos)
      << fallback.output;
  EXPECT_EQ(fallback.output.find("cudaGetDeviceCount"), std::string::npos) << fallback.output;
  const CommandResult bad =
      RunMoegraph("-m " + fixture_path() + " --tokens 1 -n 2 --backend tpu", true);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("--backend 'tpu'"), std::string::npos) << bad.output;
}

TEST_F(CliRunTest, ATooSmallContextOrNegativeCountNamesTheFlag) {
  const CommandResult ctx =
      RunMoegraph("-m " + fixture_path() + " --tokens 1,2,3 -n 4 --ctx 5", true);
  EXPECT_EQ(ctx.exit_code, 1);
  EXPECT_NE(ctx.output.find("--ctx 5"), std::string::npos) << ctx.output;
  const CommandResult n = RunMoegraph("-m " + fixture_path() + " --tokens 1 -n=-3", true);
  EXPECT_EQ(n.exit_code, 1);
  EXPECT_NE(n.output.find("-n -3"), std::string::npos) << n.output;
}

}  // namespace
}  // namespace moegraph
