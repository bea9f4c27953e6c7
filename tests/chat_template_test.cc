// Chat templates (text/chat_template.h) against llama.cpp's own built-in ones:
// tests/data/chat/llama-chat.json holds llama.cpp's detection and rendering of
// the cases in tests/data/chat/cases.json (names, marker snippets, and Qwen3's
// real template from vocab/, fetched by tools/fetch-vocab.sh), written by
// tools/llama-crosscheck/chat-templates.sh. Every case moegraph renders must
// render as llama.cpp does; every other must be an error naming llama.cpp's
// template.
#include "text/chat_template.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::MessageHas;

nlohmann::json ReadJson(const std::string& relative) {
  std::ifstream in(std::string(MOEGRAPH_SOURCE_DIR) + "/" + relative);
  return nlohmann::json::parse(in, nullptr, false);
}

// A template case's text: cases.json's, or a fetched vocabulary's chat_template.
bool TemplateText(const nlohmann::json& cases, const std::string& id, std::string* text) {
  for (const nlohmann::json& c : cases["templates"]) {
    if (c["id"] == id) {
      *text = c["template"].get<std::string>();
      return true;
    }
  }
  if (id.starts_with("vocab:")) {
    const char* dir = std::getenv("MOEGRAPH_VOCAB");
    const std::string path = std::string(dir != nullptr ? dir : MOEGRAPH_SOURCE_DIR "/vocab") +
                             "/" + id.substr(6) + "/tokenizer_config.json";
    std::ifstream in(path);
    const nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
    if (!config.is_object() || !config.contains("chat_template")) return false;
    *text = config["chat_template"].get<std::string>();
    return true;
  }
  return false;
}

TEST(ChatTemplateTest, DetectionAndTextEqualLlamaCpps) {
  const nlohmann::json cases = ReadJson("tests/data/chat/cases.json");
  const nlohmann::json expected = ReadJson("tests/data/chat/llama-chat.json");
  ASSERT_TRUE(cases.is_object() && expected.is_object());
  std::map<std::string, std::vector<ChatMessage>> conversations;
  for (const nlohmann::json& c : cases["conversations"]) {
    for (const nlohmann::json& m : c["messages"]) {
      conversations[c["id"]].push_back({m[0].get<std::string>(), m[1].get<std::string>()});
    }
  }
  int rendered = 0, refused = 0;
  for (const nlohmann::json& want : expected["templates"]) {
    const std::string id = want["id"];
    SCOPED_TRACE(id);
    std::string text;
    if (!TemplateText(cases, id, &text)) {
      ASSERT_TRUE(id.starts_with("vocab:")) << "no case " << id;
      continue;  // a vocabulary not fetched here
    }
    const std::string detected = want["detected"];
    absl::StatusOr<ChatTemplate> t = DetectChatTemplate(text);
    if (!t.ok()) {
      // Refused: llama.cpp's template for it is none moegraph renders.
      EXPECT_FALSE(DetectChatTemplate(detected).ok()) << "llama.cpp renders it as " << detected;
      if (detected != "unknown") {
        EXPECT_TRUE(MessageHas(t.status(), "llama.cpp's '" + detected + "'")) << t.status();
      }
      EXPECT_TRUE(MessageHas(t.status(), "chatml, llama2")) << t.status();
      ++refused;
      continue;
    }
    EXPECT_EQ(ChatTemplateName(*t), detected);
    for (const nlohmann::json& r : want["renders"]) {
      EXPECT_EQ(ApplyChatTemplate(*t, conversations[r["conversation"]], r["add_assistant"]),
                r["text"].get<std::string>())
          << r["conversation"] << " add_assistant " << r["add_assistant"];
      ++rendered;
    }
  }
  // 18 templates by name and 18 by markers (gpt-oss's, chatglm4's and chatglm3's
  // among them, and GLM markers behind phi3's and llama3's, which llama.cpp
  // checks first), 6 conversations each, with and without the generation prompt;
  // gemma (by name and by marker), phi4, llama4 and exaone3 markers and an
  // unknown text refused.
  EXPECT_GE(rendered, 36 * 6 * 2);
  EXPECT_EQ(refused, 6);
}

TEST(ChatTemplateTest, EveryNameRoundTrips) {
  for (const std::string name :
       {"chatml", "llama2", "mistral-v7-tekken", "glmedge", "chatglm4", "llama3"}) {
    absl::StatusOr<ChatTemplate> t = DetectChatTemplate(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(ChatTemplateName(*t), name);
  }
}

}  // namespace
}  // namespace moegraph
