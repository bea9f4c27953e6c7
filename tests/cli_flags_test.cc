// The command line a llama.cpp user types: each command's --help lists only
// its own flags with its meaning, a value placeholder and the default (and
// together they cover every flag tools/cli defines); a flag of another command
// or a misspelling is an error naming it, with the nearest flag; every
// llama.cpp spelling maps to moegraph's flag (a test each, through what the
// flag does); llama.cpp's flags that mean nothing here are accepted with a note
// or refused with the reason; --version and help.
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
using testing_util::IdsAfter;
using testing_util::ProcessResult;
using testing_util::RunProcess;

const std::vector<std::string> kCommands = {"inspect",  "make-fixture", "run",        "chat",
                                            "serve",    "bench",        "tokenize",   "trace",
                                            "simulate", "gguf-split",   "perplexity", "quantize"};

// The names of the flags tools/cli/*.cc define with ABSL_FLAG.
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

// The help's entry of a flag: its line, then the line under it.
std::string HelpEntry(const std::string& help, const std::string& spelled) {
  const size_t at = help.find("\n  " + spelled);
  if (at == std::string::npos) return "";
  const size_t end = help.find('\n', help.find('\n', at + 1) + 1);
  return help.substr(at + 1, end - at - 1);
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
    const std::string dashed = absl::StrReplaceAll(name, {{"_", "-"}});
    const std::regex entry("\n  --?" + dashed + "( [^\n]+)?\n      \\S");
    EXPECT_TRUE(std::regex_search(all_help, entry)) << name << " is in no command's --help";
  }
}

TEST(CliFlagsTest, HelpGivesThisCommandsMeaningAPlaceholderAndTheDefault) {
  const ProcessResult run = RunProcess({MOEGRAPH_BIN, "run", "--help"});
  const ProcessResult bench = RunProcess({MOEGRAPH_BIN, "bench", "--help"});
  const ProcessResult fixture = RunProcess({MOEGRAPH_BIN, "make-fixture", "--help"});
  ASSERT_EQ(run.exit_code, 0);
  // run's -p is text, bench's a list of prompt lengths; each help says only its own.
  EXPECT_TRUE(Contains(HelpEntry(run.out, "-p "), "-p TEXT\n")) << run.out;
  EXPECT_FALSE(Contains(run.out, "pp test")) << run.out;
  EXPECT_TRUE(Contains(HelpEntry(bench.out, "-p "), "-p N[,N...]\n")) << bench.out;
  // --top-k: sampling to run, experts per token to make-fixture, with each default.
  EXPECT_TRUE(Contains(HelpEntry(run.out, "--top-k"), "most likely tokens")) << run.out;
  EXPECT_TRUE(Contains(HelpEntry(run.out, "--top-k"), "(default: 40)")) << run.out;
  EXPECT_FALSE(Contains(run.out, "experts used per token")) << run.out;
  EXPECT_TRUE(Contains(HelpEntry(fixture.out, "--top-k"), "experts used per token (default: 2)"))
      << fixture.out;
  // -n: 16 for run, 128 for bench.
  EXPECT_TRUE(Contains(HelpEntry(run.out, "-n "), "(default: 16)")) << run.out;
  EXPECT_TRUE(Contains(HelpEntry(bench.out, "-n "), "(default: 128)")) << bench.out;
  EXPECT_FALSE(Contains(run.out, "  --arms"));              // bench's
  EXPECT_FALSE(Contains(run.out, "  --quant"));             // make-fixture's
  EXPECT_TRUE(Contains(run.out, "-c = --ctx")) << run.out;  // llama.cpp's spellings
  // `moegraph help run` is `moegraph run --help`; `moegraph --help` lists the commands.
  EXPECT_EQ(RunProcess({MOEGRAPH_BIN, "help", "run"}).out, run.out);
  const ProcessResult top = RunProcess({MOEGRAPH_BIN, "--help"});
  EXPECT_EQ(top.exit_code, 0);
  for (const std::string& command : kCommands) {
    EXPECT_TRUE(Contains(top.out, "  " + command + "  ")) << top.out;
  }
  EXPECT_EQ(RunProcess({MOEGRAPH_BIN, "help"}).out, top.out);
}

TEST(CliFlagsTest, VersionPrintsTheVersionAndCommit) {
  for (const std::vector<std::string>& argv :
       std::vector<std::vector<std::string>>{{MOEGRAPH_BIN, "--version"},
                                             {MOEGRAPH_BIN, "version"},
                                             {MOEGRAPH_BIN, "run", "--version"}}) {
    const ProcessResult r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, 0) << argv.back();
    EXPECT_TRUE(
        std::regex_search(r.out, std::regex(R"(^moegraph \d+\.\d+\.\d+ \(git \S+\), built with )")))
        << r.out;
  }
}

TEST(CliFlagsTest, AnotherCommandsFlagOrAMisspellingIsAnErrorNamingItAndTheNearest) {
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--arms", "graph"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err,
                       "--arms is not a flag of run (did you mean --arm?); 'moegraph run "
                       "--help' lists them"))
      << r.err;
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--ctxx", "8"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "--ctxx is not a flag of run (did you mean --ctx?)")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--temprature", "0.5"});
  EXPECT_TRUE(Contains(r.err, "(did you mean --temperature?)")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", "x.gguf", "-p", "a", "-r=3"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "-r is not a flag of tokenize")) << r.err;
  // A value Abseil cannot parse is named as written, not by Abseil's own words.
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--top-k", "abc"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "moegraph run: --top-k 'abc' is not an integer")) << r.err;
  EXPECT_FALSE(Contains(r.err, "Illegal value")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "--temperature=warm"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "--temperature 'warm' is not a number")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "bench", "-m", "x.gguf", "-r", "many"});
  EXPECT_TRUE(Contains(r.err, "-r 'many' is not an integer")) << r.err;
  // One letter is an edit from every one-letter flag: no hint.
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", "x.gguf", "-x", "1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "-x is not a flag of run; 'moegraph run --help' lists them"))
      << r.err;
  r = RunProcess({MOEGRAPH_BIN, "inspect", "--made-up", "x.gguf"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "--made-up is not a flag of inspect")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "rn", "-m", "x.gguf"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(Contains(r.err, "unknown command 'rn'")) << r.err;
}

TEST(CliFlagsTest, OwnFlagsPassWithTheirValuesAndNegations) {
  const std::string path = testing_util::TempPath("cli_flags.gguf");
  ASSERT_EQ(RunProcess({MOEGRAPH_BIN, "make-fixture", "--quant", "Q8_0", "-o", path}).exit_code, 0);
  // A value that looks like a flag is the value of the flag before it.
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", path, "-p", "--arms", "--noids"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "tokenize", "-m", path, "-p", "ab", "--ids=false", "--no-bos"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // inspect takes its file as an argument or as -m.
  r = RunProcess({MOEGRAPH_BIN, "inspect", "-m", path});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RunProcess({MOEGRAPH_BIN, "inspect", path}).out);
  std::filesystem::remove(path);
}

// llama.cpp's spellings, each checked through what the flag does.
class LlamaSpellingTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() {
    FixtureSpec spec;
    spec.n_layer = 2;
    spec.n_expert = 4;
    WriteSuiteFixture(spec, "cli_spellings.gguf");
  }
  ProcessResult Run(std::vector<std::string> args, const std::string& command = "run",
                    const std::string& stdin_text = "") {
    std::vector<std::string> argv = {MOEGRAPH_BIN,   command,     "-m",
                                     fixture_path(), "--backend", "cpu"};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv, stdin_text);
  }
};

TEST_F(LlamaSpellingTest, ContextSizeIsCtx) {
  for (const char* spelling : {"-c", "--ctx-size"}) {
    const ProcessResult r = Run({"--tokens", "1,2,3", "-n", "4", spelling, "5"});
    EXPECT_EQ(r.exit_code, 1) << spelling;
    EXPECT_TRUE(Contains(r.err, "--ctx 5 is too small")) << spelling << ": " << r.err;
  }
}

TEST_F(LlamaSpellingTest, SeedTemperatureAndThreads) {
  const ProcessResult ours =
      Run({"--tokens", "1,2", "-n", "6", "--temp", "0.9", "--seed", "7", "-t", "1"});
  ASSERT_EQ(ours.exit_code, 0) << ours.err;
  EXPECT_TRUE(Contains(ours.out, "seed 7")) << ours.out;
  EXPECT_TRUE(Contains(ours.out, "backend cpu: 1 thread,")) << ours.out;
  for (const std::vector<std::string>& spelled :
       std::vector<std::vector<std::string>>{{"-s", "7", "--temperature", "0.9", "--threads", "1"},
                                             {"--seed", "7", "--temp", "0.9", "--threads=1"}}) {
    std::vector<std::string> args = {"--tokens", "1,2", "-n", "6"};
    args.insert(args.end(), spelled.begin(), spelled.end());
    const ProcessResult r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(IdsAfter(r.out, "generated"), IdsAfter(ours.out, "generated")) << spelled[0];
    EXPECT_TRUE(Contains(r.out, "seed 7")) << r.out;
    EXPECT_TRUE(Contains(r.out, "backend cpu: 1 thread,")) << r.out;
  }
}

TEST_F(LlamaSpellingTest, ModelPromptFileAndPredict) {
  const std::string text_file = testing_util::TempPath("spelling_prompt.txt");
  std::ofstream(text_file) << "abc";
  const ProcessResult ours = Run({"-p", "abc", "-n", "5"});
  ASSERT_EQ(ours.exit_code, 0) << ours.err;
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--prompt", "abc", "--n-predict", "5"},
                                             {"--file", text_file, "--predict", "5"},
                                             {"-f", text_file, "-n", "5"}}) {
    const ProcessResult r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << args[0] << ": " << r.err;
    EXPECT_EQ(r.out, ours.out) << args[0];
  }
  // --model for -m.
  const ProcessResult model = RunProcess(
      {MOEGRAPH_BIN, "run", "--model", fixture_path(), "--backend", "cpu", "-p", "abc", "-n", "5"});
  EXPECT_EQ(model.exit_code, 0) << model.err;
  EXPECT_EQ(model.out, ours.out);
  std::filesystem::remove(text_file);
}

TEST_F(LlamaSpellingTest, CacheTypesAreKvType) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"-ctk", "f32"},
                                             {"-ctv", "f32"},
                                             {"-ctk", "f32", "-ctv", "f32"},
                                             {"--cache-type-k", "f32"},
                                             {"--cache-type-v=f32"}}) {
    std::vector<std::string> all = {"--tokens", "1", "-n", "1"};
    all.insert(all.end(), args.begin(), args.end());
    const ProcessResult r = Run(all);
    EXPECT_EQ(r.exit_code, 0) << args[0] << ": " << r.err;
    EXPECT_TRUE(Contains(r.out, "KV cache f32")) << args[0] << ": " << r.out;
  }
  const ProcessResult mixed = Run({"--tokens", "1", "-ctk", "f16", "-ctv", "f32"});
  EXPECT_EQ(mixed.exit_code, 2);
  EXPECT_TRUE(Contains(mixed.err, "-ctk f16 and -ctv f32")) << mixed.err;
  const ProcessResult q8 = Run({"--tokens", "1", "-ctk", "q8_0"});
  EXPECT_EQ(q8.exit_code, 1);
  EXPECT_TRUE(Contains(q8.err, "--kv-type 'q8_0' is not f16 or f32")) << q8.err;
}

TEST_F(LlamaSpellingTest, SpecialVerboseAndNCpuMoe) {
  const ProcessResult special = Run({"-p", "abc", "-n", "3", "-sp"});
  EXPECT_EQ(special.exit_code, 0) << special.err;
  EXPECT_EQ(special.out, Run({"-p", "abc", "-n", "3", "--special"}).out);
  for (const char* spelling : {"-v", "--verbose", "--log-verbose"}) {
    const ProcessResult r = Run({"--tokens", "1", "-n", "1", spelling});
    EXPECT_EQ(r.exit_code, 0) << spelling;
    EXPECT_TRUE(Contains(r.out, "doors: arm graph; MOEGRAPH_GRAPH=1 (default)")) << r.out;
  }
  // Without it, doors at their defaults say nothing.
  EXPECT_FALSE(Contains(Run({"--tokens", "1", "-n", "1"}).out, "doors:"));
  for (const char* spelling : {"--n-cpu-moe", "-ncmoe"}) {
    const ProcessResult r = Run({"--tokens", "1", "-n", "1", spelling, "1"});
    EXPECT_EQ(r.exit_code, 0) << spelling << ": " << r.err;
    EXPECT_TRUE(Contains(r.out, "--n-cpu-moe is ignored")) << r.out;
  }
  const ProcessResult both = Run({"--tokens", "1", "--n-cpu-moe", "1", "--slots", "4"});
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_TRUE(Contains(both.err, "--n-cpu-moe and --slots")) << both.err;
}

TEST_F(LlamaSpellingTest, SystemPromptIsSystem) {
  for (const char* spelling : {"-sys", "--system-prompt", "--system"}) {
    const ProcessResult r =
        Run({"-n", "2", spelling, "Be brief.", "--verbose-prompt"}, "chat", "Hi\n");
    EXPECT_EQ(r.exit_code, 0) << spelling << ": " << r.err;
    EXPECT_TRUE(Contains(r.err, "<|im_start|>system\\nBe brief.<|im_end|>")) << r.err;
  }
}

TEST_F(LlamaSpellingTest, LlamaBenchsLongNames) {
  const ProcessResult r = Run({"--n-prompt", "3", "--n-gen", "2", "--repetitions", "1", "--output",
                               "json", "--arms", "resident"},
                              "bench");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = testing_util::BenchJsonRows(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  EXPECT_EQ(rows[0].at("test"), "\"pp3\"");
  EXPECT_EQ(rows[1].at("test"), "\"tg2\"");
  EXPECT_EQ(rows[0].at("samples_ts").find(','), std::string::npos);  // -r 1: one sample
}

TEST_F(LlamaSpellingTest, FlagsWithoutAMeaningHereAreNotedOrRefusedWithTheReason) {
  struct Case {
    std::string command;
    std::vector<std::string> args;
    std::string note;
  };
  const std::vector<Case> noted = {
      {"run", {"--tokens", "1", "-n", "1", "-ngl", "99"}, "note: -ngl: "},
      {"run", {"--tokens", "1", "-n", "1", "--n-gpu-layers", "all"}, "note: --n-gpu-layers: "},
      {"run", {"--tokens", "1", "-n", "1", "-fa", "on"}, "note: -fa: attention is moegraph's"},
      {"run", {"--tokens", "1", "-n", "1", "--flash-attn=auto"}, "note: --flash-attn: "},
      {"run", {"--tokens", "1", "-fa", "-n", "1"}, "note: -fa: "},  // older llama.cpp's bare -fa
      {"run", {"--tokens", "1", "-n", "1", "--jinja"}, "note: --jinja: the chat template"},
      {"run", {"--tokens", "1", "-n", "1", "-no-cnv"}, "note: -no-cnv: run decodes one prompt"},
      {"chat", {"-n", "1", "-cnv"}, "note: -cnv: chat is always a conversation"},
      {"bench", {"-n", "1", "-r", "1", "--arms", "resident", "-ngl", "99"}, "note: -ngl: "},
  };
  for (const Case& c : noted) {
    const ProcessResult r = Run(c.args, c.command);
    EXPECT_EQ(r.exit_code, 0) << c.args.back() << ": " << r.err;
    EXPECT_TRUE(Contains(r.err, c.note)) << r.err;
  }
  const ProcessResult cnv = Run({"--tokens", "1", "-cnv"});
  EXPECT_EQ(cnv.exit_code, 2);
  EXPECT_TRUE(Contains(cnv.err, "-cnv: a conversation is `moegraph chat -m FILE`")) << cnv.err;
  const ProcessResult np = Run({"--tokens", "1", "-np", "4"});
  EXPECT_EQ(np.exit_code, 2);  // serve's
  EXPECT_TRUE(Contains(np.err, "-np is not a flag of run")) << np.err;
  const ProcessResult no_value = Run({"--tokens", "1", "-ngl"});
  EXPECT_EQ(no_value.exit_code, 2);
  EXPECT_TRUE(Contains(no_value.err, "-ngl needs a value")) << no_value.err;
}

}  // namespace
}  // namespace moegraph
