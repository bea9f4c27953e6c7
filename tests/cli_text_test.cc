// `moegraph run` with text, on a fixture carrying Qwen3's real vocabulary
// (tools/fetch-vocab.sh; skips without it), against llama.cpp's own greedy
// decode of the same prompt on the same f32 fixture
// (tests/data/tokenizer/qwen3-llama-greedy.json, from
// tools/llama-crosscheck/tokenizer-ids.sh): the prompt's ids, the generated ids
// and the printed text all equal llama.cpp's.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::IdsAfter;
using testing_util::ProcessResult;
using testing_util::RunProcess;
using testing_util::RunProcessWithArgs;

std::string VocabJson() {
  const char* dir = std::getenv("MOEGRAPH_VOCAB");
  return std::string(dir != nullptr ? dir : MOEGRAPH_SOURCE_DIR "/vocab") + "/qwen3/tokenizer.json";
}

class CliTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(VocabJson())) {
      GTEST_SKIP() << VocabJson()
                   << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
    }
    std::ifstream in(MOEGRAPH_SOURCE_DIR "/tests/data/tokenizer/qwen3-llama-greedy.json");
    expected_ = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(expected_.is_object());
    fixture_ = testing_util::TempPath("qwen3-vocab-f32.gguf");
    const ProcessResult made = RunProcessWithArgs(
        {MOEGRAPH_BIN, "make-fixture", "--tokenizer-json", VocabJson(), "-o", fixture_},
        expected_["make_fixture_flags"].get<std::string>());
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  void TearDown() override { std::remove(fixture_.c_str()); }

  nlohmann::json expected_;
  std::string fixture_;
};

TEST_F(CliTextTest, RunPrintsLlamaCppsGreedyTokensAndText) {
  const std::string prompt = expected_["prompt"].get<std::string>();
  const std::vector<int32_t> prompt_ids = expected_["prompt_ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> generated = expected_["generated"].get<std::vector<int32_t>>();
  const std::string n = std::to_string(generated.size());

  const ProcessResult ids =
      RunProcess({MOEGRAPH_BIN, "tokenize", "-m", fixture_, "-p", prompt, "--ids"});
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  EXPECT_EQ(ids.out, absl::StrCat("[", absl::StrJoin(prompt_ids, ", "), "]\n"));

  const ProcessResult by_ids = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_, "--backend", "cpu",
                                           "--tokens", absl::StrJoin(prompt_ids, ","), "-n", n});
  ASSERT_EQ(by_ids.exit_code, 0) << by_ids.err;
  EXPECT_EQ(IdsAfter(by_ids.out, "generated"), generated);

  // Text: stdout is the generation alone (then a newline); the rest is on stderr.
  const ProcessResult text = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_, "--backend", "cpu",
                                         "-p", prompt, "-n", n, "--ignore-eos"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(text.out, expected_["text"].get<std::string>() + "\n");
  EXPECT_TRUE(testing_util::Contains(text.err, "backend cpu: "));
  EXPECT_TRUE(testing_util::Contains(text.err, "24 generated"));
}

TEST_F(CliTextTest, APromptGivenTwiceOrNotAtAllIsAnError) {
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_, "-p", "hi", "--tokens", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "give the prompt once"));
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "a prompt is required: -p TEXT, -f FILE or --tokens"));
}

}  // namespace
}  // namespace moegraph
