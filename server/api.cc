#include "server/api.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moegraph {
namespace {

using nlohmann::json;

// OpenAI's default for /v1/completions; chat goes on to the end.
constexpr int kCompletionsDefaultTokens = 16;

// The payload ErrorField reads.
constexpr char kFieldPayload[] = "moegraph.server/field";

absl::Status FieldError(const std::string& field, const std::string& what) {
  absl::Status error = absl::InvalidArgumentError(absl::StrCat("'", field, "' ", what));
  error.SetPayload(kFieldPayload, absl::Cord(field));
  return error;
}

absl::StatusOr<float> Number(const json& body, const std::string& field, float fallback) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number()) return FieldError(field, "must be a number");
  return it->get<float>();
}

absl::StatusOr<int64_t> Integer(const json& body, const std::string& field, int64_t fallback) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  return it->get<int64_t>();
}

absl::StatusOr<bool> Boolean(const json& body, const std::string& field) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) return FieldError(field, "must be true or false");
  return it->get<bool>();
}

// A count of alternatives in [0, kMaxTopLogprobs] (absent or null: fallback).
absl::StatusOr<int> Alternatives(const json& body, const std::string& field, int fallback) {
  absl::StatusOr<int64_t> n = Integer(body, field, fallback);
  if (!n.ok()) return n.status();
  if (*n != fallback && (*n < 0 || *n > kMaxTopLogprobs)) {
    return FieldError(field, absl::StrFormat("is %d; it must be in [0, %d]", *n, kMaxTopLogprobs));
  }
  return static_cast<int>(*n);
}

// Completions: logprobs N (the alternatives) and echo; chat: logprobs true
// and top_logprobs N (OpenAI's; N needs logprobs, as llama-server says).
absl::Status ReadLogprobs(const json& body, bool chat, CompletionRequest* r) {
  if (!chat) {
    absl::StatusOr<int> n = Alternatives(body, "logprobs", -1);
    absl::StatusOr<bool> echo = Boolean(body, "echo");
    if (!n.ok()) return n.status();
    if (!echo.ok()) return echo.status();
    r->logprobs = *n;
    r->echo = *echo;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> wanted = Boolean(body, "logprobs");
  absl::StatusOr<int> top = Alternatives(body, "top_logprobs", -1);
  if (!wanted.ok()) return wanted.status();
  if (!top.ok()) return top.status();
  if (*top >= 0 && !*wanted) return FieldError("top_logprobs", "needs logprobs: true");
  r->logprobs = *wanted ? std::max(*top, 0) : -1;
  return absl::OkStatus();
}

absl::Status ReadMessages(const json& body, std::vector<ChatMessage>* out) {
  const auto it = body.find("messages");
  if (it == body.end() || !it->is_array()) return FieldError("messages", "must be an array");
  if (it->empty()) return FieldError("messages", "must hold at least one message");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return FieldError(at, "must be an object");
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return FieldError(at + ".role", "must be a string");
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant") {
      return FieldError(at + ".role",
                        absl::StrCat("'", r, "' is not one of system, user, assistant"));
    }
    // A string, or OpenAI's array of parts: the text parts joined by newlines,
    // as llama.cpp's concat_content_parts (common/chat.cpp) joins them.
    const auto content = m.find("content");
    std::string text;
    if (content != m.end() && content->is_array()) {
      for (size_t p = 0; p < content->size(); ++p) {
        const json& part = (*content)[p];
        const std::string part_at = absl::StrCat(at, ".content[", p, "]");
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
            !part.contains("text") || !part["text"].is_string()) {
          return FieldError(part_at, "must be a text part ({\"type\": \"text\", \"text\": ...}); "
                                     "this server reads text only");
        }
        if (!text.empty()) text += '\n';
        text += part["text"].get<std::string>();
      }
    } else if (content == m.end() || !content->is_string()) {
      return FieldError(at + ".content", "must be a string or an array of text parts");
    } else {
      text = content->get<std::string>();
    }
    out->push_back({r, std::move(text)});
  }
  return absl::OkStatus();
}

absl::Status ReadStop(const json& body, std::vector<std::string>* out) {
  const auto it = body.find("stop");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    if (!it->get<std::string>().empty()) out->push_back(it->get<std::string>());
    return absl::OkStatus();
  }
  if (!it->is_array()) return FieldError("stop", "must be a string or an array of strings");
  for (const json& s : *it) {
    if (!s.is_string()) return FieldError("stop", "must be a string or an array of strings");
    if (!s.get<std::string>().empty()) out->push_back(s.get<std::string>());
  }
  return absl::OkStatus();
}

json UsageJson(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens}}}};
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body_text, bool chat,
                                                         const SamplingParams& defaults,
                                                         int max_tokens_limit) {
  // nlohmann's parser rejects invalid UTF-8 in strings, so text is valid below.
  const json body = json::parse(body_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError("the body is not valid JSON (or not valid UTF-8)");
  }
  if (!body.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  if (chat) {
    if (absl::Status s = ReadMessages(body, &r.messages); !s.ok()) return s;
  } else {
    // A string, token ids, or a one-element array of either (OpenAI's batch
    // form; one prompt a request here).
    json prompt = body.contains("prompt") ? body["prompt"] : json();
    if (prompt.is_array() && prompt.size() == 1 && (prompt[0].is_string() || prompt[0].is_array())) {
      prompt = prompt[0];
    }
    if (prompt.is_string()) {
      r.prompt = prompt.get<std::string>();
    } else if (prompt.is_array() && !prompt.empty()) {
      for (const json& id : prompt) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
          return FieldError("prompt", "must be a string or an array of token ids");
        }
        r.prompt_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    } else {
      return FieldError("prompt", "must be a string or an array of token ids (one prompt)");
    }
  }
  if (absl::Status s = ReadLogprobs(body, chat, &r); !s.ok()) return s;
  const char* tokens_field =
      body.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  absl::StatusOr<int64_t> max_tokens = Integer(
      body, tokens_field, chat ? -1 : std::min(kCompletionsDefaultTokens, max_tokens_limit));
  if (!max_tokens.ok()) return max_tokens.status();
  // 0 with echo: the prompt scored, nothing generated (lm-evaluation-harness).
  const int least = r.echo ? 0 : 1;
  if (body.contains(tokens_field) && (*max_tokens < least || *max_tokens > max_tokens_limit)) {
    return FieldError(tokens_field,
                      absl::StrFormat("is %d; it must be in [%d, %d] (the context%s)", *max_tokens,
                                      least, max_tokens_limit, r.echo ? "" : "; 0 with echo"));
  }
  r.max_tokens = static_cast<int>(*max_tokens);

  r.sampling = defaults;
  absl::StatusOr<float> temperature = Number(body, "temperature", defaults.temperature);
  absl::StatusOr<float> top_p = Number(body, "top_p", defaults.top_p);
  absl::StatusOr<float> min_p = Number(body, "min_p", defaults.min_p);
  absl::StatusOr<int64_t> top_k = Integer(body, "top_k", defaults.top_k);
  absl::StatusOr<int64_t> seed = Integer(body, "seed", static_cast<int64_t>(defaults.seed));
  for (const absl::Status& s :
       {temperature.status(), top_p.status(), min_p.status(), top_k.status(), seed.status()}) {
    if (!s.ok()) return s;
  }
  if (!(*temperature >= 0.0f && *temperature <= 100.0f)) {
    return FieldError("temperature", "must be in [0, 100]");
  }
  if (!(*top_p > 0.0f && *top_p <= 1.0f)) return FieldError("top_p", "must be in (0, 1]");
  if (!(*min_p >= 0.0f && *min_p <= 1.0f)) return FieldError("min_p", "must be in [0, 1]");
  if (*top_k < 0 || *top_k > INT32_MAX) return FieldError("top_k", "must be 0 (off) or positive");
  // -1 is a random seed, as llama-server's LLAMA_DEFAULT_SEED.
  if (*seed == -1) {
    std::random_device device;
    *seed = static_cast<int64_t>((uint64_t{device()} << 32 | device()) >> 1);
  }
  if (*seed < 0) return FieldError("seed", "must not be negative (-1: random)");
  r.sampling.temperature = *temperature;
  r.sampling.top_p = *top_p;
  r.sampling.min_p = *min_p;
  r.sampling.top_k = static_cast<int32_t>(*top_k);
  r.sampling.seed = static_cast<uint64_t>(*seed);

  if (absl::Status s = ReadStop(body, &r.stop); !s.ok()) return s;
  if (absl::StatusOr<bool> stream = Boolean(body, "stream"); !stream.ok()) {
    return stream.status();
  } else {
    r.stream = *stream;
  }
  if (r.stream && r.logprobs >= 0) {
    return FieldError("logprobs", "is not streamed here: ask without stream");
  }
  return r;
}

std::string ErrorField(const absl::Status& error) {
  const auto field = error.GetPayload(kFieldPayload);  // Abseil's optional in Debian 12
  return field.has_value() ? std::string(*field) : "";
}

std::string StopScanner::Push(std::string_view text) {
  if (stopped_) return "";
  pending_.append(text);
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  // Hold back the longest end of pending_ that begins some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopScanner::Flush() {
  std::string out = stopped_ ? "" : std::move(pending_);
  pending_.clear();
  return out;
}

json ErrorJson(std::string_view message, int status, std::string_view param) {
  json error = {{"message", message},
                {"type", status >= 500 ? "server_error" : "invalid_request_error"},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", status}};
  return {{"error", error}};
}

json CompletionJson(bool chat, std::string_view id, int64_t created, std::string_view model,
                    std::string_view text, std::string_view finish_reason, const Usage& usage,
                    const json& logprobs) {
  json choice = {{"index", 0}, {"finish_reason", finish_reason}, {"logprobs", logprobs}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  return {{"id", id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})},
          {"usage", UsageJson(usage)}};
}

json ChunkJson(bool chat, std::string_view id, int64_t created, std::string_view model,
               std::string_view text, std::string_view finish_reason, const Usage* usage) {
  json choice = {{"index", 0},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (chat) {
    choice["delta"] = finish_reason.empty() ? json{{"content", text}} : json::object();
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  json chunk = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", json::array({choice})}};
  if (usage != nullptr) {
    chunk["usage"] = UsageJson(*usage);
  }
  return chunk;
}

json CompletionsLogprobsJson(absl::Span<const int32_t> tokens,
                             absl::Span<const TokenLogprobs> scored, const TokenText& text) {
  json pieces = json::array(), values = json::array(), tops = json::array(),
       offsets = json::array();
  const size_t unscored = tokens.size() - scored.size();
  size_t offset = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string piece = text(tokens[i]);
    pieces.push_back(piece);
    offsets.push_back(offset);
    offset += piece.size();
    if (i < unscored) {
      values.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    const TokenLogprobs& t = scored[i - unscored];
    values.push_back(t.logprob);
    json top = json::object();
    for (const auto& [id, logprob] : t.top) top[text(id)] = logprob;
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(pieces)},
          {"token_logprobs", std::move(values)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

json TokenLogprobsArray(absl::Span<const TokenLogprobs> scored, const TokenText& text) {
  const auto entry = [&text](int32_t id, double logprob) {
    const std::string piece = text(id);
    return json{{"id", id},
                {"token", piece},
                {"bytes", std::vector<uint8_t>(piece.begin(), piece.end())},
                {"logprob", logprob}};
  };
  json out = json::array();
  for (const TokenLogprobs& t : scored) {
    json top = json::array();
    for (const auto& [id, logprob] : t.top) top.push_back(entry(id, logprob));
    json e = entry(t.token, t.logprob);
    e["top_logprobs"] = std::move(top);
    out.push_back(std::move(e));
  }
  return out;
}

json NativeCompletionJson(std::string_view model, std::string_view text,
                          std::string_view stop_type, const Usage* usage,
                          const json& probabilities) {
  json reply = {{"content", text}, {"stop", usage != nullptr}, {"id_slot", 0}};
  if (usage != nullptr) {
    reply["model"] = model;
    reply["tokens_predicted"] = usage->completion_tokens;
    reply["tokens_evaluated"] = usage->prompt_tokens;
    reply["tokens_cached"] = usage->cached_tokens;
    reply["stop_type"] = stop_type;
  }
  if (!probabilities.is_null()) reply["completion_probabilities"] = probabilities;
  return reply;
}

absl::StatusOr<CompletionRequest> ParseNativeCompletionRequest(std::string_view body_text,
                                                               const SamplingParams& defaults,
                                                               int max_tokens_limit) {
  json body = json::parse(body_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError("the body is not valid JSON (or not valid UTF-8)");
  }
  if (!body.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  absl::StatusOr<int64_t> n_predict = Integer(body, "n_predict", -1);
  if (!n_predict.ok()) return n_predict.status();
  if (*n_predict == 0 || *n_predict < -1 || *n_predict > max_tokens_limit) {
    return FieldError("n_predict", absl::StrFormat("is %d; it must be -1 (until the end) or in "
                                                   "[1, %d] (the context)",
                                                   *n_predict, max_tokens_limit));
  }
  absl::StatusOr<int64_t> n_probs = Integer(body, "n_probs", 0);
  if (!n_probs.ok()) return n_probs.status();
  if (*n_probs < 0 || *n_probs > kMaxTopLogprobs) {
    return FieldError("n_probs", absl::StrFormat("is %d; it must be in [0, %d] (0: none)",
                                                 *n_probs, kMaxTopLogprobs));
  }
  for (const char* field :
       {"n_predict", "max_tokens", "max_completion_tokens", "n_probs", "logprobs", "echo"}) {
    body.erase(field);
  }
  const auto stream = body.find("stream");
  if (*n_probs > 0 && stream != body.end() && *stream == true) {
    return FieldError("n_probs", "is not streamed here: ask without stream");
  }
  if (*n_predict > 0) body["max_tokens"] = *n_predict;
  if (*n_probs > 0) body["logprobs"] = *n_probs;
  absl::StatusOr<CompletionRequest> r =
      ParseCompletionRequest(body.dump(), /*chat=*/false, defaults, max_tokens_limit);
  if (r.ok() && *n_predict < 0) r->max_tokens = -1;
  return r;
}

}  // namespace moegraph
