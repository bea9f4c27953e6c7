// Chat templates as llama.cpp's built-in renderer has them (src/llama-chat.cpp):
// a template is recognized by name or by markers in the file's Jinja text
// (`tokenizer.chat_template`), in llama.cpp's order, and rendered by a fixed
// routine per template, not by a Jinja engine. moegraph renders the templates
// of the models it targets and their neighbours: chatml (Qwen2, Qwen3), the
// Mistral [INST] and llama-2 family (Mixtral), glmedge (llama.cpp's reading of
// OLMoE's <|user|>/<|assistant|> template), chatglm4 (GLM-4.5) and chatglm3,
// zephyr, falcon3, phi3, llama3 and gpt-oss.
// A template llama.cpp recognizes as another is an error naming it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "loader/gguf.h"

namespace moegraph {

enum class ChatTemplate {
  kChatml,
  kLlama2,
  kLlama2Sys,
  kLlama2SysBos,
  kLlama2SysStrip,
  kMistralV1,
  kMistralV3,
  kMistralV3Tekken,
  kMistralV7,
  kMistralV7Tekken,
  kPhi3,
  kFalcon3,
  kChatGlm3,  // llama.cpp's "chatglm3": [gMASK]sop, then <|role|>\n content
  kChatGlm4,  // llama.cpp's "chatglm4" (GLM-4, GLM-4.5): [gMASK]<sop>, then <|role|>\ncontent
  kGlmEdge,
  kZephyr,
  kLlama3,
  kGptOss,  // llama.cpp's "gpt-oss": Harmony's turns, no channels
};

struct ChatMessage {
  std::string role;  // system, user or assistant
  std::string content;
};

// llama.cpp's name of a template ("chatml", "mistral-v7", ...).
std::string_view ChatTemplateName(ChatTemplate t);
// The names moegraph renders, comma-separated, for messages.
std::string ChatTemplateNames();

// llm_chat_detect_template: a name, or a Jinja template's markers. Errors: a
// template llama.cpp knows but moegraph does not render (naming it), and one
// neither knows; both list the names moegraph renders.
absl::StatusOr<ChatTemplate> DetectChatTemplate(std::string_view name_or_jinja);

// The file's tokenizer.chat_template as DetectChatTemplate reads it, or chatml
// where the file has none (llama.cpp's default). Errors name the file and key.
absl::StatusOr<ChatTemplate> FileChatTemplate(const GgufFile& file);

// llm_chat_apply_template: the conversation as text, ending with the
// assistant's generation prompt when add_assistant.
std::string ApplyChatTemplate(ChatTemplate t, const std::vector<ChatMessage>& messages,
                              bool add_assistant);

}  // namespace moegraph
