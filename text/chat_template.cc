#include "text/chat_template.h"

#include <cctype>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace moegraph {
namespace {

struct Named {
  const char* name;
  ChatTemplate value;
};

constexpr Named kRendered[] = {
    {"chatml", ChatTemplate::kChatml},
    {"llama2", ChatTemplate::kLlama2},
    {"llama2-sys", ChatTemplate::kLlama2Sys},
    {"llama2-sys-bos", ChatTemplate::kLlama2SysBos},
    {"llama2-sys-strip", ChatTemplate::kLlama2SysStrip},
    {"mistral-v1", ChatTemplate::kMistralV1},
    {"mistral-v3", ChatTemplate::kMistralV3},
    {"mistral-v3-tekken", ChatTemplate::kMistralV3Tekken},
    {"mistral-v7", ChatTemplate::kMistralV7},
    {"mistral-v7-tekken", ChatTemplate::kMistralV7Tekken},
    {"phi3", ChatTemplate::kPhi3},
    {"falcon3", ChatTemplate::kFalcon3},
    {"chatglm3", ChatTemplate::kChatGlm3},
    {"chatglm4", ChatTemplate::kChatGlm4},
    {"glmedge", ChatTemplate::kGlmEdge},
    {"zephyr", ChatTemplate::kZephyr},
    {"llama3", ChatTemplate::kLlama3},
    {"gpt-oss", ChatTemplate::kGptOss},
};

// llama.cpp's other template names, which moegraph does not render.
constexpr const char* kNotRendered[] = {
    "phi4",          "monarch",     "gemma",     "orion",      "openchat",       "vicuna",
    "vicuna-orca",   "deepseek",    "deepseek2", "deepseek3",  "deepseek-ocr",   "command-r",
    "minicpm",       "exaone3",     "exaone4",   "exaone-moe", "rwkv-world",     "granite",
    "granite-4.0",   "granite-4.1", "gigachat",  "megrez",     "yandex",         "bailing",
    "bailing-think", "bailing2",    "llama4",    "smolvlm",    "hunyuan-moe",    "hunyuan-dense",
    "hunyuan-vl",    "kimi-k2",     "seed_oss",  "grok-2",     "pangu-embedded", "solar-open",
};

absl::Status NotRendered(std::string_view name) {
  return absl::InvalidArgumentError(
      absl::StrFormat("the chat template is llama.cpp's '%s', which moegraph does not render; "
                      "--chat-template picks one of: %s",
                      name, ChatTemplateNames()));
}

std::string Trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

void Mistral(ChatTemplate t, const std::vector<ChatMessage>& messages, std::string* out) {
  const std::string leading = t == ChatTemplate::kMistralV1 ? " " : "";
  const std::string trailing = t == ChatTemplate::kMistralV3Tekken ? "" : " ";
  bool inside_turn = false;
  for (const ChatMessage& m : messages) {
    if (!inside_turn) {
      absl::StrAppend(out, leading, "[INST]", trailing);
      inside_turn = true;
    }
    if (m.role == "system") {
      absl::StrAppend(out, m.content, "\n\n");
    } else if (m.role == "user") {
      absl::StrAppend(out, m.content, leading, "[/INST]");
    } else {
      absl::StrAppend(out, trailing, t == ChatTemplate::kMistralV3 ? Trim(m.content) : m.content,
                      "</s>");
      inside_turn = false;
    }
  }
}

void Llama2(ChatTemplate t, const std::vector<ChatMessage>& messages, std::string* out) {
  bool inside_turn = true;  // the first [INST] goes out before any message
  absl::StrAppend(out, "[INST] ");
  for (const ChatMessage& m : messages) {
    const std::string content = t == ChatTemplate::kLlama2SysStrip ? Trim(m.content) : m.content;
    if (!inside_turn) {
      inside_turn = true;
      absl::StrAppend(out, t == ChatTemplate::kLlama2SysBos ? "<s>[INST] " : "[INST] ");
    }
    if (m.role == "system") {
      if (t == ChatTemplate::kLlama2) {
        absl::StrAppend(out, content, "\n");  // no system slot: folded into the first turn
      } else {
        absl::StrAppend(out, "<<SYS>>\n", content, "\n<</SYS>>\n\n");
      }
    } else if (m.role == "user") {
      absl::StrAppend(out, content, " [/INST]");
    } else {
      absl::StrAppend(out, content, "</s>");
      inside_turn = false;
    }
  }
}

}  // namespace

std::string_view ChatTemplateName(ChatTemplate t) {
  for (const Named& n : kRendered) {
    if (n.value == t) return n.name;
  }
  return "?";
}

std::string ChatTemplateNames() {
  std::string out;
  for (const Named& n : kRendered) absl::StrAppend(&out, out.empty() ? "" : ", ", n.name);
  return out;
}

absl::StatusOr<ChatTemplate> DetectChatTemplate(std::string_view tmpl) {
  for (const Named& n : kRendered) {
    if (tmpl == n.name) return n.value;
  }
  for (const char* name : kNotRendered) {
    if (tmpl == name) return NotRendered(name);
  }
  auto has = [&](std::string_view marker) { return tmpl.find(marker) != std::string_view::npos; };
  // The order is llama.cpp's (llm_chat_detect_template): the first match wins.
  if (has("<|im_start|>")) {
    if (has("<|im_sep|>")) return NotRendered("phi4");
    if (has("<end_of_utterance>")) return NotRendered("smolvlm");
    return ChatTemplate::kChatml;
  }
  if (tmpl.starts_with("mistral") || has("[INST]")) {
    if (has("[SYSTEM_PROMPT]")) return ChatTemplate::kMistralV7;
    if (has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]")) {
      if (has(" [INST]")) return ChatTemplate::kMistralV1;
      if (has("\"[INST]\"")) return ChatTemplate::kMistralV3Tekken;
      return ChatTemplate::kMistralV3;
    }
    if (has("content.strip()")) return ChatTemplate::kLlama2SysStrip;
    if (has("bos_token + '[INST]")) return ChatTemplate::kLlama2SysBos;
    if (has("<<SYS>>")) return ChatTemplate::kLlama2Sys;
    return ChatTemplate::kLlama2;
  }
  if (has("<|assistant|>") && has("<|end|>")) return ChatTemplate::kPhi3;
  if (has("[gMASK]<sop>")) return ChatTemplate::kChatGlm4;
  if (has("<|assistant|>") && has("<|user|>")) {
    if (has("<|tool_declare|>")) return NotRendered("exaone-moe");
    return has("</s>") ? ChatTemplate::kFalcon3 : ChatTemplate::kGlmEdge;
  }
  if (has("<|{{ item['role'] }}|>") && has("<|begin_of_image|>")) return ChatTemplate::kGlmEdge;
  if (has("<|user|>") && has("<|endoftext|>")) return ChatTemplate::kZephyr;
  if (has("bos_token + message['role']")) return NotRendered("monarch");
  if (has("<start_of_turn>")) return NotRendered("gemma");
  if (has("'\\n\\nAssistant: ' + eos_token")) return NotRendered("orion");
  if (has("GPT4 Correct ")) return NotRendered("openchat");
  if (has("USER: ") && has("ASSISTANT: ")) {
    return NotRendered(has("SYSTEM: ") ? "vicuna-orca" : "vicuna");
  }
  if (has("### Instruction:") && has("<|EOT|>")) return NotRendered("deepseek");
  if (has("<|START_OF_TURN_TOKEN|>") && has("<|USER_TOKEN|>")) return NotRendered("command-r");
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) return ChatTemplate::kLlama3;
  if (has("[gMASK]sop")) return ChatTemplate::kChatGlm3;
  if (has("<用户>")) return NotRendered("minicpm");
  if (has("'Assistant: ' + message['content'] + eos_token")) return NotRendered("deepseek2");
  if (has("<｜Assistant｜>") && has("<｜User｜>") && has("<｜end▁of▁sentence｜>")) {
    return NotRendered("deepseek3");
  }
  if (has("[|system|]") && has("[|assistant|]") && has("[|endofturn|]")) {
    return NotRendered(has("[|tool|]") ? "exaone4" : "exaone3");
  }
  if (has("rwkv-world") || has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}")) {
    return NotRendered("rwkv-world");
  }
  if (has("<|start_of_role|>")) {
    if (has("<tool_call>") || has("<tools>")) {
      return NotRendered(has("g4_default_system_message") ? "granite-4.0" : "granite-4.1");
    }
    return NotRendered("granite");
  }
  if (has("message['role'] + additional_special_tokens[0] + message['content'] + "
          "additional_special_tokens[1]")) {
    return NotRendered("gigachat");
  }
  if (has("<|role_start|>")) return NotRendered("megrez");
  if (has(" Ассистент:")) return NotRendered("yandex");
  if (has("<role>ASSISTANT</role>") && has("'HUMAN'")) return NotRendered("bailing");
  if (has("<role>ASSISTANT</role>") && has("\"HUMAN\"") && has("<think>")) {
    return NotRendered("bailing-think");
  }
  if (has("<role>ASSISTANT</role>") && has("<role>HUMAN</role>") && has("<|role_end|>")) {
    return NotRendered("bailing2");
  }
  if (has("<|header_start|>") && has("<|header_end|>")) return NotRendered("llama4");
  if (has("<|endofuserprompt|>")) return NotRendered("dots1");
  if (has("<|extra_0|>") && has("<|extra_4|>")) return NotRendered("hunyuan-moe");
  if (has("<|start|>") && has("<|channel|>")) return ChatTemplate::kGptOss;
  return absl::InvalidArgumentError(absl::StrFormat(
      "the chat template is not one moegraph recognizes (nor one of llama.cpp's it renders); "
      "--chat-template picks one of: %s",
      ChatTemplateNames()));
}

std::string ApplyChatTemplate(ChatTemplate t, const std::vector<ChatMessage>& messages,
                              bool add_assistant) {
  std::string out;
  switch (t) {
    case ChatTemplate::kChatml:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
      }
      if (add_assistant) absl::StrAppend(&out, "<|im_start|>assistant\n");
      break;
    case ChatTemplate::kMistralV7:
    case ChatTemplate::kMistralV7Tekken: {
      const std::string space = t == ChatTemplate::kMistralV7 ? " " : "";
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          absl::StrAppend(&out, "[SYSTEM_PROMPT]", space, m.content, "[/SYSTEM_PROMPT]");
        } else if (m.role == "user") {
          absl::StrAppend(&out, "[INST]", space, m.content, "[/INST]");
        } else {
          absl::StrAppend(&out, space, m.content, "</s>");
        }
      }
      break;
    }
    case ChatTemplate::kMistralV1:
    case ChatTemplate::kMistralV3:
    case ChatTemplate::kMistralV3Tekken:
      Mistral(t, messages, &out);
      break;
    case ChatTemplate::kLlama2:
    case ChatTemplate::kLlama2Sys:
    case ChatTemplate::kLlama2SysBos:
    case ChatTemplate::kLlama2SysStrip:
      Llama2(t, messages, &out);
      break;
    case ChatTemplate::kPhi3:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|", m.role, "|>\n", m.content, "<|end|>\n");
      }
      if (add_assistant) absl::StrAppend(&out, "<|assistant|>\n");
      break;
    case ChatTemplate::kFalcon3:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|", m.role, "|>\n", m.content, "\n");
      }
      if (add_assistant) absl::StrAppend(&out, "<|assistant|>\n");
      break;
    case ChatTemplate::kChatGlm3:
    case ChatTemplate::kChatGlm4: {
      // llm_chat_apply_template: chatglm3's "sop" is text, chatglm4's <sop> a token.
      const bool glm4 = t == ChatTemplate::kChatGlm4;
      absl::StrAppend(&out, "[gMASK]", glm4 ? "<sop>" : "sop");
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|", m.role, "|>", glm4 ? "\n" : "\n ", m.content);
      }
      if (add_assistant) absl::StrAppend(&out, glm4 ? "<|assistant|>\n" : "<|assistant|>");
      break;
    }
    case ChatTemplate::kGlmEdge:
      for (const ChatMessage& m : messages) absl::StrAppend(&out, "<|", m.role, "|>\n", m.content);
      if (add_assistant) absl::StrAppend(&out, "<|assistant|>");
      break;
    case ChatTemplate::kZephyr:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|", m.role, "|>\n", m.content, "<|endoftext|>\n");
      }
      if (add_assistant) absl::StrAppend(&out, "<|assistant|>\n");
      break;
    case ChatTemplate::kLlama3:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n",
                        Trim(m.content), "<|eot_id|>");
      }
      if (add_assistant) absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatTemplate::kGptOss:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start|>", m.role, "<|message|>", m.content,
                        m.role == "assistant" ? "<|return|>" : "<|end|>");
      }
      if (add_assistant) absl::StrAppend(&out, "<|start|>assistant");
      break;
  }
  return out;
}

absl::StatusOr<ChatTemplate> FileChatTemplate(const GgufFile& file) {
  if (file.FindKey("tokenizer.chat_template") == nullptr) return ChatTemplate::kChatml;
  absl::StatusOr<std::string_view> jinja = file.GetString("tokenizer.chat_template");
  if (!jinja.ok()) return jinja.status();
  absl::StatusOr<ChatTemplate> t = DetectChatTemplate(*jinja);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tokenizer.chat_template: ", t.status().message()));
  }
  return t;
}

}  // namespace moegraph
