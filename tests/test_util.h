// Helpers the test binaries share: fixtures parsed in memory, status and text
// matchers, subprocesses, temp files and the shared data folder. Depends only on
// the loader libraries and gtest, so the sanitizer tree can build it too.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"

namespace moegraph::testing_util {

// A fixture model and the file its weight views point into.
struct LoadedModel {
  std::unique_ptr<GgufFile> file;
  Model model;
};

// FixtureBytes(spec) parsed as "fixture" and bound with LoadModel.
absl::StatusOr<std::unique_ptr<LoadedModel>> LoadFixture(const FixtureSpec& spec);

// The bytes parsed as a GgufFile named `name`; a test failure and nullptr when
// they do not parse.
std::unique_ptr<GgufFile> ParseOrFail(const std::vector<uint8_t>& bytes, const std::string& name);

// FixtureBytes(spec) parsed as "fixture.gguf"; a test failure and nullptr on error.
std::unique_ptr<GgufFile> FixtureFileOrFail(const FixtureSpec& spec);

// Passes when text contains part; the failure prints both (tests link gtest
// without gmock, so there is no HasSubstr).
::testing::AssertionResult Contains(absl::string_view text, absl::string_view part);

// True when the status message contains text.
bool MessageHas(const absl::Status& status, const std::string& text);

// Same length and the same bits in every element (NaNs and signed zeros included).
bool BitEqual(const std::vector<float>& a, const std::vector<float>& b);

struct CommandResult {
  int exit_code = -1;  // -1 when the command did not exit normally (a crash)
  std::string output;  // stdout, and stderr too where the command line redirects it there
};

// Runs a shell command line (popen) and returns its exit code and stdout.
CommandResult RunCommand(const std::string& shell_command);

struct ProcessResult {
  int exit_code = -1;  // -1 when the process did not exit normally (a crash)
  int signal = 0;      // the signal that ended it, or 0
  uint64_t peak_rss_kib = 0;  // its peak resident set (getrusage's ru_maxrss)
  std::string out;
  std::string err;
};

// Runs argv[0] (a path, no shell) with argv and returns its exit code, stdout and
// stderr apart; the process reads stdin_text on its stdin (a file, not a terminal).
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::string& stdin_text = std::string());

// Runs argv followed by the words of args (split at spaces), as RunProcess does.
ProcessResult RunProcessWithArgs(std::vector<std::string> argv, const std::string& args);

// tools/fetch-vocab.sh's Qwen3 tokenizer.json: $MOEGRAPH_VOCAB, else source_dir's vocab/.
std::string Qwen3TokenizerJson(const std::string& source_dir);

// `bin make-fixture` of a small f32 model of arch (2 layers, 4 experts,
// top-2, embd 64; qwen35moe's a Gated DeltaNet, then gated attention)
// carrying the vocabulary of tokenizer_json, written to out.
ProcessResult MakeVocabFixture(const std::string& bin, const std::string& tokenizer_json,
                               const std::string& out, const std::string& arch = "qwen3moe");

// A path in the test temp folder, the same for the same name within one test
// process and distinct between processes.
std::string TempPath(const std::string& name);

// The whole file; empty when it cannot be read.
std::string ReadFileToString(const std::string& path);

// A path under the shared data folder: $MOEGRAPH_SHARED (set by ctest), else
// /work/shared.
std::string SharedPath(const std::string& relative);

// A suite whose tests share one fixture file: the subclass's SetUpTestSuite calls
// WriteSuiteFixture, the file goes when the suite ends, and every test fails at
// once when the write did.
class FixtureFileTest : public ::testing::Test {
 protected:
  // Writes spec to TempPath(name).
  static void WriteSuiteFixture(const FixtureSpec& spec, const std::string& name);
  static void TearDownTestSuite();
  void SetUp() override;

  static const std::string& fixture_path() { return *path_; }

 private:
  static std::string* path_;
  static absl::Status* status_;
};

// The ids after "label:" on the first line of output that starts with it.
std::vector<int32_t> IdsAfter(const std::string& output, const std::string& label);

// The rows of `moegraph bench`'s markdown table (not the header or its
// separator), each split into trimmed cells.
std::vector<std::vector<std::string>> BenchTableRows(const std::string& out);

// The objects of `moegraph bench -o json`'s array, one per line, as field -> raw
// value text.
std::vector<std::map<std::string, std::string>> BenchJsonRows(const std::string& out);

// Accepts exactly one RFC 8259 JSON value (whitespace around it allowed).
class JsonChecker {
 public:
  explicit JsonChecker(std::string_view text) : text_(text) {}
  bool Valid();

 private:
  void Space();
  bool Eat(char c);
  bool Digits();
  bool String();
  bool Value(int depth);

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace moegraph::testing_util
