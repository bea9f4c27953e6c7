// Detects and renders the chat cases of tests/data/chat/cases.json with
// llama.cpp's own built-in templates (src/llama-chat.cpp, compiled beside this
// file by chat-templates.sh from node-llama-cpp's llama.cpp source). Prints
// JSON: per template case, llama.cpp's name for it ("unknown" when none) and,
// for each conversation, the text with and without the generation prompt.
// Usage: chat_templates cases.json [ID TEMPLATE_FILE]... > expected.json
#include <cstdio>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "llama-chat.h"
#include "llama.h"

namespace {

std::string NameOf(llm_chat_template t) {
  std::vector<const char*> names(256);
  const int32_t n = llama_chat_builtin_templates(names.data(), names.size());
  for (int32_t i = 0; i < n; ++i) {
    if (llm_chat_template_from_str(names[i]) == t) return names[i];
  }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc % 2 != 0) {
    std::fprintf(stderr, "usage: chat_templates cases.json [ID TEMPLATE_FILE]...\n");
    return 2;
  }
  std::ifstream in(argv[1]);
  nlohmann::json cases = nlohmann::json::parse(in);
  for (int i = 2; i + 1 < argc; i += 2) {
    std::ifstream file(argv[i + 1]);
    cases["templates"].push_back(
        {{"id", argv[i]}, {"template", std::string(std::istreambuf_iterator<char>(file), {})}});
  }
  nlohmann::json out = {{"generator", "tools/llama-crosscheck/chat-templates.sh"},
                        {"templates", nlohmann::json::array()}};
  for (const nlohmann::json& c : cases["templates"]) {
    const llm_chat_template t = llm_chat_detect_template(c["template"].get<std::string>());
    nlohmann::json entry = {{"id", c["id"]}, {"detected", NameOf(t)}, {"renders", {}}};
    if (t != LLM_CHAT_TEMPLATE_UNKNOWN) {
      for (const nlohmann::json& conversation : cases["conversations"]) {
        std::vector<llama_chat_message> messages;
        std::vector<std::string> owned;
        owned.reserve(2 * conversation["messages"].size());
        for (const nlohmann::json& m : conversation["messages"]) {
          owned.push_back(m[0].get<std::string>());
          owned.push_back(m[1].get<std::string>());
        }
        for (size_t k = 0; k < owned.size(); k += 2) {
          messages.push_back({owned[k].c_str(), owned[k + 1].c_str()});
        }
        std::vector<const llama_chat_message*> chat;
        for (const llama_chat_message& m : messages) chat.push_back(&m);
        for (const bool add_assistant : {false, true}) {
          std::string text;
          llm_chat_apply_template(t, chat, text, add_assistant);
          entry["renders"].push_back({{"conversation", conversation["id"]},
                                      {"add_assistant", add_assistant},
                                      {"text", text}});
        }
      }
    }
    out["templates"].push_back(entry);
  }
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}
