// The OpenAI-compatible API's requests and responses, apart from HTTP: parsing
// and checking a request body (each error names its field), the stop strings,
// and the JSON of completions, chunks, models and errors, in the shapes of
// OpenAI's API (and llama-server's where OpenAI has none).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/sample_math.h"
#include "quality/logprobs.h"
#include "text/chat_template.h"

namespace moegraph {

// POST /v1/completions (a raw prompt) or /v1/chat/completions (messages).
struct CompletionRequest {
  bool chat = false;
  std::vector<ChatMessage> messages;  // chat
  std::string prompt;                 // completions: text, or
  std::vector<int32_t> prompt_ids;    // its token ids (fed as they are, no BOS added)
  int max_tokens = -1;                // -1: until end of generation or the context; 0: echo only
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool stream = false;
  // Log-probabilities asked for: -1 none, else the likeliest this many
  // alternatives with each token's own (completions' logprobs, chat's
  // top_logprobs, /completion's n_probs).
  int logprobs = -1;
  bool echo = false;  // completions: the prompt is given back (and scored) before the completion
};

// The most alternatives a position's logprobs list (OpenAI's chat limit).
inline constexpr int kMaxTopLogprobs = 20;

// The body of a request (JSON). Fields absent take the server's defaults
// (sampling: the serve command's flags; max_tokens: 16 for completions, as
// OpenAI's, until the end for chat). Errors (InvalidArgument) name the field:
// malformed JSON, a wrong type, an unknown role, no messages, a max_tokens
// below 1 (0 with echo) or above max_tokens_limit, sampling outside its
// ranges, logprobs outside [0, kMaxTopLogprobs] or with stream (they are not
// streamed), chat's top_logprobs without logprobs, invalid UTF-8.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body, bool chat,
                                                         const SamplingParams& defaults,
                                                         int max_tokens_limit);

// The field an error of ParseCompletionRequest names (an error object's
// "param"), or "" where it names none (malformed JSON).
std::string ErrorField(const absl::Status& error);

// Text as generated, less any stop string: Push returns what may be shown now,
// holding back an end that could begin a stop string; after a stop string the
// rest is dropped and stopped() is true.
class StopScanner {
 public:
  explicit StopScanner(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string Push(std::string_view text);
  // What is held back, at the end of generation.
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

// {"error": {"message", "type", "param", "code"}}: type is
// invalid_request_error (4xx) or server_error (5xx).
nlohmann::json ErrorJson(std::string_view message, int status, std::string_view param = {});

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;  // of prompt_tokens, those the KV cache held already
};

// A whole completion: "text_completion" with choices[0].text, or
// "chat.completion" with choices[0].message; finish_reason "stop" or "length";
// choices[0].logprobs as given (null: none asked for).
nlohmann::json CompletionJson(bool chat, std::string_view id, int64_t created,
                              std::string_view model, std::string_view text,
                              std::string_view finish_reason, const Usage& usage,
                              const nlohmann::json& logprobs = nullptr);

// A token's text (its piece, as generation shows it).
using TokenText = std::function<std::string(int32_t token)>;

// OpenAI's logprobs of /v1/completions: {"tokens", "token_logprobs",
// "top_logprobs" ({text: logprob}), "text_offset" (bytes into the choice's
// text)} over tokens, whose last scored.size() have values; those before them
// (an echoed prompt's first token) have null.
nlohmann::json CompletionsLogprobsJson(absl::Span<const int32_t> tokens,
                                       absl::Span<const TokenLogprobs> scored,
                                       const TokenText& text);

// A token per element, {"id", "token", "bytes", "logprob", "top_logprobs":
// [{"id", "token", "bytes", "logprob"}]}: OpenAI's chat logprobs "content"
// (with llama-server's "id") and llama-server's completion_probabilities
// (probs_vector_to_json in tools/server/server-task.cpp, post_sampling_probs
// false).
nlohmann::json TokenLogprobsArray(absl::Span<const TokenLogprobs> scored, const TokenText& text);

// One server-sent event's data: a chunk of text ("chat.completion.chunk" with
// choices[0].delta, or "text_completion"); finish_reason null until the last,
// which carries usage too.
nlohmann::json ChunkJson(bool chat, std::string_view id, int64_t created, std::string_view model,
                         std::string_view text, std::string_view finish_reason, const Usage* usage);

// llama-server's own /completion (tools/server/README): a reply or a stream
// event: {"content", "stop"}, and on the last (stop true) "model",
// "tokens_predicted", "tokens_evaluated", "stop_type" ("eos", "word" or
// "limit") and "id_slot"; with n_probs, "completion_probabilities"
// (TokenLogprobsArray).
nlohmann::json NativeCompletionJson(std::string_view model, std::string_view text,
                                    std::string_view stop_type, const Usage* usage,
                                    const nlohmann::json& probabilities = nullptr);

// Its request: n_predict (-1 or absent: until the end) in place of
// max_tokens, n_probs in place of logprobs, else the /v1/completions fields;
// errors name n_predict and n_probs.
absl::StatusOr<CompletionRequest> ParseNativeCompletionRequest(std::string_view body,
                                                               const SamplingParams& defaults,
                                                               int max_tokens_limit);

}  // namespace moegraph
