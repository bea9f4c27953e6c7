// Each command's flags: `moegraph COMMAND --help` lists the flags the command
// reads (together they cover every flag tools/ defines), and a flag of another
// command is an error naming it, not silently taken.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;
using testing_util::ProcessResult;
using testing_util::RunProcess;

const std::vector<std::string> kCommands = {"inspect", "make-fixture", "run",   "chat",    "serve",
                                            "bench",   "tokenize",     "trace", "simulate"};

// The names of the flags tools/*.cc define with ABSL_FLAG.
std::set<std::string> DefinedFlags() {
  std::set<std::string> names;
  const std::regex flag(R"(ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,)");
  for (const auto& entry : std::filesystem::directory_iterator(MOEGRAPH_SOURCE_DIR "/tools/cli")) {
    if (entry.path().extension() != ".cc") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    const std::string source = text.str();
    for (auto it = std::sregex_iterator(source.begin(), source.end(), flag);
         it != std::sregex_iterator(); ++it) {
      names.insert((*it)[1]);
    }
  }
  return names;
}

TEST(CliFlagsTest, EachCommandsHelpListsItsFlagsAndTogetherTheyCoverAll) {
  std::string all_help;
  for (const std::string& command : kCommands) {
    const ProcessResult r = RunProcess({MOEGRAPH_BIN, command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command << ": " << r.err;
    EXPECT_TRUE(Contains(r.out, "usage: moegraph " + command)) << r.out;
    all_help += r.out;
  }
  const std::set<std::string> defined = DefinedFlags();
  ASSERT_GT(defined.size(), 40u);
  for (const std::string& name : defined) {
    const std::string spelled =
        (name.size() == 1 ? "  -" : "  --") + absl::StrReplaceAll(name, {{"_", "-"}}) + "\n";
    EXPECT_TRUE(Contains(all_help, spelled)) << name << " is in no command's --help";
  }

  const ProcessResult run = RunProcess({MOEGRAPH_BIN, "run", "--help"});
  EXPECT_TRUE(Contains(run.out, "  --ignore-eos\n"));
  EXPECT_TRUE(Contains(run.out, "  -p\n"));
  EXPECT_FALSE(Contains(run.out, "  --arms\n"));   // bench's
  EXPECT_FALSE(Contains(run.out, "  --quant\n"));  // make-fixture's
}

TEST(CliFlagsTest, AnotherCommandsFlagIsAnErrorNamingIt) {
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--arms", "graph"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "--arms is not a flag of run; 'moegraph run --help' lists them"))
      << r.err;
  r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", "x.gguf", "-p", "a", "-r=3"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "-r is not a flag of tokenize")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "inspect", "--made-up", "x.gguf"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "--made-up is not a flag of inspect")) << r.err;
}

TEST(CliFlagsTest, OwnFlagsPassWithTheirValuesAndNegations) {
  const std::string path = testing_util::TempPath("cli_flags.gguf");
  ASSERT_EQ(RunProcess({MOEGRAPH_BIN, "make-fixture", "--quant", "Q8_0", "-o", path}).exit_code, 0);
  // A value that looks like a flag is the value of the flag before it.
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", path, "-p", "--arms", "--noids"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", path, "-p", "ab", "--ids=false", "--no-bos"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moegraph
