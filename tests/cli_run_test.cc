// `moegraph run` as a user runs it: the binary in a subprocess on a fixture file,
// its generated ids checked against the oracle run in-process.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "reference/oracle.h"

namespace moegraph {
namespace {

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

// Runs a shell command line and returns its exit code and captured stdout.
CommandResult RunShell(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// `moegraph run ARGS` with stdout only, or stdout and stderr together.
CommandResult RunMoegraph(const std::string& args, bool with_stderr) {
  return RunShell(std::string(MOEGRAPH_BIN) + " run " + args +
                  (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

// The ids after "label: " on the line that starts with it.
std::vector<int32_t> IdsAfter(const std::string& output, const std::string& label) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(label + ":", 0) != 0) continue;
    std::istringstream ids(line.substr(label.size() + 1));
    std::vector<int32_t> out;
    int32_t id = 0;
    while (ids >> id) out.push_back(id);
    return out;
  }
  return {};
}

class CliRunTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(::testing::TempDir() + "moegraph_cli_run_" + std::to_string(getpid()) +
                            ".gguf");
    FixtureSpec spec;
    spec.arch = Arch::kQwen3Moe;
    spec.router_skew = 1.0f;
    spec.seed = 21;
    status_ = new absl::Status(WriteFixture(spec, *path_));
  }
  static void TearDownTestSuite() {
    std::remove(path_->c_str());
    delete path_;
    delete status_;
  }
  void SetUp() override { ASSERT_TRUE(status_->ok()) << *status_; }

  static std::string* path_;
  static absl::Status* status_;
};

std::string* CliRunTest::path_ = nullptr;
absl::Status* CliRunTest::status_ = nullptr;

TEST_F(CliRunTest, GeneratedIdsEqualTheOracleInProcess) {
  const std::vector<int32_t> prompt = {1, 2, 3};
  constexpr int kPredict = 8;
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(*path_);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<Oracle>> oracle =
      Oracle::Create(*model, static_cast<int>(prompt.size()) + kPredict);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  absl::StatusOr<std::vector<int32_t>> want = (*oracle)->Generate(prompt, kPredict);
  ASSERT_TRUE(want.ok()) << want.status();

  for (const char* backend : {"auto", "cpu"}) {
    const CommandResult run = RunMoegraph(
        "-m " + *path_ + " --tokens 1,2,3 -n 8 --backend " + backend, /*with_stderr=*/false);
    ASSERT_EQ(run.exit_code, 0) << backend << "\n" << run.output;
    EXPECT_EQ(IdsAfter(run.output, "prompt"), prompt) << run.output;
    EXPECT_EQ(IdsAfter(run.output, "generated"), *want) << run.output;
    EXPECT_NE(run.output.find("tok/s"), std::string::npos) << run.output;
  }
}

TEST_F(CliRunTest, AnExplicitContextGivesTheSameIds) {
  const CommandResult fitted = RunMoegraph("-m " + *path_ + " --tokens 7,8 -n 4", false);
  const CommandResult roomy = RunMoegraph("-m " + *path_ + " --tokens 7,8 -n 4 --ctx 64", false);
  ASSERT_EQ(fitted.exit_code, 0) << fitted.output;
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  EXPECT_EQ(IdsAfter(fitted.output, "generated").size(), 4u);
  EXPECT_EQ(IdsAfter(fitted.output, "generated"), IdsAfter(roomy.output, "generated"));
}

TEST_F(CliRunTest, ABadTokenListExitsNonZeroNamingTokens) {
  const CommandResult run = RunMoegraph("-m " + *path_ + " --tokens 1,x -n 2", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--tokens"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("'x'"), std::string::npos) << run.output;
}

TEST_F(CliRunTest, ATokenOutsideTheVocabularyExitsNonZero) {
  // The fixture's vocabulary is 256 ids.
  const CommandResult run = RunMoegraph("-m " + *path_ + " --tokens 1,256 -n 2", true);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find("--tokens: token 256"), std::string::npos) << run.output;
}

TEST_F(CliRunTest, MissingTokensOrModelAreErrorsNamingTheFlag) {
  const CommandResult no_tokens = RunMoegraph("-m " + *path_ + " -n 2", true);
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

TEST_F(CliRunTest, TheCudaBackendIsNotBuiltYet) {
  const CommandResult run = RunMoegraph("-m " + *path_ + " --tokens 1 -n 2 --backend cuda", true);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find("CUDA backend is not built"), std::string::npos) << run.output;
  const CommandResult bad = RunMoegraph("-m " + *path_ + " --tokens 1 -n 2 --backend tpu", true);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("--backend 'tpu'"), std::string::npos) << bad.output;
}

TEST_F(CliRunTest, ATooSmallContextOrNegativeCountNamesTheFlag) {
  const CommandResult ctx = RunMoegraph("-m " + *path_ + " --tokens 1,2,3 -n 4 --ctx 5", true);
  EXPECT_EQ(ctx.exit_code, 1);
  EXPECT_NE(ctx.output.find("--ctx 5"), std::string::npos) << ctx.output;
  const CommandResult n = RunMoegraph("-m " + *path_ + " --tokens 1 -n=-3", true);
  EXPECT_EQ(n.exit_code, 1);
  EXPECT_NE(n.output.find("-n -3"), std::string::npos) << n.output;
}

}  // namespace
}  // namespace moegraph
