// `moegraph run` with text, on fixtures carrying real vocabularies (Qwen3's
// byte-level BPE on a qwen3moe fixture, Mistral's SentencePiece on a mixtral
// one; tools/fetch-vocab.sh, skips without them), against llama.cpp's own
// greedy decode of the same prompt on the same f32 fixture
// (tests/data/tokenizer/VOCAB-llama-greedy.json, from
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

std::string VocabJson(const std::string& vocab) {
  const char* dir = std::getenv("MOEGRAPH_VOCAB");
  return absl::StrCat(dir != nullptr ? dir : MOEGRAPH_SOURCE_DIR "/vocab", "/", vocab,
                      "/tokenizer.json");
}

// Bytes as llama.cpp's text reaches JavaScript (node-llama-cpp): each maximal
// ill-formed subsequence becomes U+FFFD, as the WHATWG decoder does it.
std::string AsJavaScriptString(const std::string& bytes) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto b = static_cast<uint8_t>(bytes[i]);
    const int n = b < 0x80                 ? 1
                  : b >= 0xC2 && b <= 0xDF ? 2
                  : b >= 0xE0 && b <= 0xEF ? 3
                  : b >= 0xF0 && b <= 0xF4 ? 4
                                           : 0;
    int good = n == 0 ? 0 : 1;  // bytes of a valid prefix
    while (good > 0 && good < n && i + static_cast<size_t>(good) < bytes.size()) {
      const auto c = static_cast<uint8_t>(bytes[i + static_cast<size_t>(good)]);
      const uint8_t lo = good == 1 && b == 0xE0 ? 0xA0 : good == 1 && b == 0xF0 ? 0x90 : 0x80;
      const uint8_t hi = good == 1 && b == 0xED ? 0x9F : good == 1 && b == 0xF4 ? 0x8F : 0xBF;
      if (c < lo || c > hi) break;
      ++good;
    }
    if (n > 0 && good == n) {
      out.append(bytes, i, static_cast<size_t>(n));
      i += static_cast<size_t>(n);
    } else {
      out += "\xef\xbf\xbd";
      i += static_cast<size_t>(good > 0 ? good : 1);
    }
  }
  return out;
}

TEST(AsJavaScriptStringTest, ReplacesEachMaximalIllFormedSubsequence) {
  EXPECT_EQ(AsJavaScriptString("a\xd1 b"), "a\xef\xbf\xbd b");
  EXPECT_EQ(AsJavaScriptString("\xe2\x82x\xff\xc3\xa9"), "\xef\xbf\xbdx\xef\xbf\xbd\xc3\xa9");
  EXPECT_EQ(AsJavaScriptString("\xed\xa0\x80"), "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
}

// The vocabulary's folder under vocab/: qwen3 or mistral.
class CliTextTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string vocab = GetParam();
    const std::string json = VocabJson(vocab);
    if (!std::filesystem::exists(json)) {
      GTEST_SKIP() << json << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
    }
    std::ifstream in(
        absl::StrCat(MOEGRAPH_SOURCE_DIR, "/tests/data/tokenizer/", vocab, "-llama-greedy.json"));
    expected_ = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(expected_.is_object());
    fixture_ = testing_util::TempPath(vocab + "-vocab-f32.gguf");
    const ProcessResult made =
        RunProcessWithArgs({MOEGRAPH_BIN, "make-fixture", "--tokenizer-json", json, "-o", fixture_},
                           expected_["make_fixture_flags"].get<std::string>());
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  void TearDown() override { std::remove(fixture_.c_str()); }

  nlohmann::json expected_;
  std::string fixture_;
};

TEST_P(CliTextTest, RunPrintsLlamaCppsGreedyTokensAndText) {
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
  EXPECT_EQ(AsJavaScriptString(text.out), expected_["text"].get<std::string>() + "\n");
  EXPECT_TRUE(testing_util::Contains(text.err, "backend cpu: "));
  EXPECT_TRUE(testing_util::Contains(text.err, "24 generated"));
}

TEST_P(CliTextTest, APromptGivenTwiceOrNotAtAllIsAnError) {
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_, "-p", "hi", "--tokens", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "give the prompt once"));
  r = RunProcess({MOEGRAPH_BIN, "run", "-m", fixture_});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "a prompt is required: -p TEXT, -f FILE or --tokens"));
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, CliTextTest, ::testing::Values("qwen3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace moegraph
