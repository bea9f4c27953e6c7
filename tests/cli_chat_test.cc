// `moegraph chat` through a pipe, on a fixture carrying Qwen3's real vocabulary
// and chat template (tools/fetch-vocab.sh; skips without it): two turns; the
// text each turn prefills is llama.cpp's own rendering of the conversation
// (tests/data/chat/llama-chat.json), the second turn prefills only its own
// tokens at the positions after the first, and the template and its errors
// are reported as llama.cpp names them.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "loader/gguf.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using testing_util::Contains;
using testing_util::ProcessResult;
using testing_util::RunProcess;

std::string Qwen3Json() { return testing_util::Qwen3TokenizerJson(MOEGRAPH_SOURCE_DIR); }

// llama.cpp's rendering of a conversation of tests/data/chat/cases.json with
// its chatml template, with the generation prompt.
std::string LlamaCppChatml(const std::string& conversation) {
  std::ifstream in(MOEGRAPH_SOURCE_DIR "/tests/data/chat/llama-chat.json");
  const nlohmann::json expected = nlohmann::json::parse(in, nullptr, false);
  for (const nlohmann::json& t : expected["templates"]) {
    if (t["id"] != "name:chatml") continue;
    for (const nlohmann::json& r : t["renders"]) {
      if (r["conversation"] == conversation && r["add_assistant"] == true) return r["text"];
    }
  }
  ADD_FAILURE() << "no chatml rendering of " << conversation;
  return "";
}

struct Turn {
  std::string text;  // what it prefilled (--verbose-prompt)
  int prefill = -1, start = -1, generated = -1;
  std::string ended_by;
};

std::vector<Turn> Turns(const std::string& err) {
  std::vector<Turn> turns;
  const std::regex text_line(R"(turn (\d+) prefill text: (".*"))");
  const std::regex stats_line(
      R"(turn (\d+): prefill (\d+) tokens at positions (\d+)\.\.\d+, (\d+) generated \(([^)]*)\))");
  std::smatch m;
  std::istringstream lines(err);
  std::string line;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, text_line)) {
      turns.resize(std::stoul(m[1]));
      turns.back().text = nlohmann::json::parse(m[2].str()).get<std::string>();
    } else if (std::regex_search(line, m, stats_line) && turns.size() == std::stoul(m[1])) {
      turns.back().prefill = std::stoi(m[2]);
      turns.back().start = std::stoi(m[3]);
      turns.back().generated = std::stoi(m[4]);
      turns.back().ended_by = m[5];
    }
  }
  return turns;
}

class CliChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(Qwen3Json())) {
      GTEST_SKIP() << Qwen3Json()
                   << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
    }
    fixture_ = testing_util::TempPath("chat-" + arch() + ".gguf");
    const ProcessResult made =
        testing_util::MakeVocabFixture(MOEGRAPH_BIN, Qwen3Json(), fixture_, arch());
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  void TearDown() override { std::remove(fixture_.c_str()); }

  // Token count of text under the fixture's own tokenizer.
  int Tokens(const std::string& text, bool add_special) {
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(fixture_);
    EXPECT_TRUE(file.ok()) << file.status();
    absl::StatusOr<Vocab> vocab = Vocab::FromGguf(**file);
    EXPECT_TRUE(vocab.ok()) << vocab.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(*vocab));
    EXPECT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::vector<int32_t>> ids = (*t)->Tokenize(text, add_special, true);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? static_cast<int>(ids->size()) : -1;
  }

  virtual std::string arch() const { return "qwen3moe"; }

  std::string fixture_;
};

// The same on each architecture: qwen35moe's recurrent state carries from one
// turn to the next as a KV cache does.
class CliChatArchTest : public CliChatTest, public ::testing::WithParamInterface<std::string> {
 protected:
  std::string arch() const override { return GetParam(); }
};

TEST_P(CliChatArchTest, TwoTurnsThroughAPipeKeepTheKvCacheAndRenderAsLlamaCpp) {
  const ProcessResult r = RunProcess({MOEGRAPH_BIN, "chat", "-m", fixture_, "--backend", "cpu",
                                      "--system", "Be kind.", "-n", "8", "--verbose-prompt"},
                                     "Hi\n\nExplain top-k.\n");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.err, "chat template: chatml (the file's tokenizer.chat_template)"));
  const std::vector<Turn> turns = Turns(r.err);
  ASSERT_EQ(turns.size(), 2u) << r.err;  // the empty line is no turn

  // Turn 1 renders the system message and the question as llama.cpp does.
  EXPECT_EQ(turns[0].text, LlamaCppChatml("system-hi"));
  EXPECT_EQ(turns[0].start, 0);
  EXPECT_EQ(turns[0].prefill, Tokens(turns[0].text, true));
  ASSERT_GT(turns[0].generated, 0);

  // Turn 2 prefills what the template adds after the first reply: llama.cpp's
  // rendering of a two-turn conversation, after its first reply's text.
  const std::string two_turns = LlamaCppChatml("two-turns");
  const std::string reply = "Hello, how can I help?";
  ASSERT_NE(two_turns.find(reply), std::string::npos);
  EXPECT_EQ(turns[1].text, two_turns.substr(two_turns.find(reply) + reply.size()));
  // Only its own tokens, at the positions after the first turn's: the first
  // reply's tokens are all fed back but its last, which turn 2 feeds first
  // unless it was the end-of-generation token.
  const bool ended = turns[0].ended_by == "end of generation";
  EXPECT_EQ(turns[1].start, turns[0].prefill + turns[0].generated - (ended ? 0 : 1));
  EXPECT_EQ(turns[1].prefill, Tokens(turns[1].text, false) + (ended ? 0 : 1));
  EXPECT_TRUE(Contains(r.err, "backend cpu: ")) << r.err;

  // The first reply is what run -p prints for the same text.
  const ProcessResult run = RunProcess(
      {MOEGRAPH_BIN, "run", "-m", fixture_, "--backend", "cpu", "-n", "8", "-p", turns[0].text});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  ASSERT_FALSE(run.out.empty());
  EXPECT_TRUE(r.out.starts_with(run.out)) << "chat: " << r.out << "\nrun: " << run.out;
}

INSTANTIATE_TEST_SUITE_P(Archs, CliChatArchTest, ::testing::Values("qwen3moe", "qwen35moe"));

TEST_F(CliChatTest, TemplatesAreDetectedOrRefusedByName) {
  ProcessResult r = RunProcess({MOEGRAPH_BIN, "chat", "-m", fixture_, "--backend", "cpu", "-n", "2",
                                "--chat-template", "llama3"},
                               "Hi\n");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.err, "chat template: llama3 (--chat-template)"));
  r = RunProcess({MOEGRAPH_BIN, "chat", "-m", fixture_, "--chat-template", "gemma"}, "Hi\n");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(Contains(r.err, "--chat-template: the chat template is llama.cpp's 'gemma'"))
      << r.err;
  EXPECT_TRUE(Contains(r.err, "chatml, llama2")) << r.err;
  r = RunProcess({MOEGRAPH_BIN, "chat", "-m", fixture_, "--chat-template", "{{ messages }}"},
                 "Hi\n");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(Contains(r.err, "not one moegraph recognizes")) << r.err;
}

// More turns than the context holds: the oldest turns are dropped and the rest
// prefilled again, and every turn is answered; /clear starts over at position
// 0, /exit ends the chat and nothing after it is read. A synthetic vocabulary
// (about a token a byte) fills a small context in four turns; its replies
// (random bytes) are not always UTF-8, and later turns render them anyway.
TEST(CliChatContextTest, MoreTurnsThanTheContextHoldsAndTheCommands) {
  const std::string fixture = testing_util::TempPath("chat-context.gguf");
  ASSERT_EQ(RunProcess({MOEGRAPH_BIN, "make-fixture", "-o", fixture}).exit_code, 0);
  std::string input;
  constexpr int kTurns = 12;
  constexpr int kCtx = 400;
  for (int i = 0; i < kTurns; ++i) input += "Tell me about turn number " + std::to_string(i) + "\n";
  input += "/clear\nAnd now?\n/exit\nNever read.\n";
  const ProcessResult r =
      RunProcess({MOEGRAPH_BIN, "chat", "-m", fixture, "--backend", "cpu", "--ctx",
                  std::to_string(kCtx), "-n", "6", "--system", "Be brief.", "--verbose-prompt"},
                 input);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<Turn> turns = Turns(r.err);
  ASSERT_EQ(turns.size(), static_cast<size_t>(kTurns + 1)) << r.err;
  for (const Turn& t : turns) {
    EXPECT_GT(t.generated, 0) << r.err;
    EXPECT_LE(t.start + t.prefill + t.generated, kCtx) << r.err;
  }
  EXPECT_TRUE(Contains(r.err, "chat: the context (--ctx 400) is full: dropped the oldest"))
      << r.err;
  // A full context drops turns until half of it is free, as llama-cli's shift
  // discards half: the turns after a drop extend the cache (start > 0), so
  // drops are fewer than the turns after the first one.
  int drops = 0;
  for (size_t at = r.err.find("is full: dropped"); at != std::string::npos;
       at = r.err.find("is full: dropped", at + 1)) {
    ++drops;
  }
  int first_drop = -1, extended_after_drop = 0;
  for (int i = 1; i < kTurns; ++i) {
    if (first_drop < 0 && turns[i].start == 0) first_drop = i;
    if (first_drop >= 0 && i > first_drop && turns[i].start > 0) ++extended_after_drop;
  }
  ASSERT_GT(first_drop, 0) << r.err;
  EXPECT_LT(drops, kTurns - first_drop) << r.err;
  EXPECT_GT(extended_after_drop, 0) << r.err;
  EXPECT_TRUE(Contains(r.err, "chat: a new conversation\nturn 13 prefill text")) << r.err;
  EXPECT_EQ(turns.back().start, 0) << r.err;  // after /clear
  EXPECT_FALSE(Contains(r.err, "turn 14:")) << r.err;
  std::remove(fixture.c_str());
}

}  // namespace
}  // namespace moegraph
