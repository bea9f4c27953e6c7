// The server's request parsing (each bad field named), stop strings, and the
// JSON shapes of its responses, without HTTP.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/api.h"

namespace moegraph {
namespace {

using nlohmann::json;

constexpr int kContext = 512;

absl::StatusOr<CompletionRequest> Chat(const std::string& body) {
  SamplingParams defaults;
  defaults.temperature = 0.5f;
  defaults.seed = 7;
  return ParseCompletionRequest(body, /*chat=*/true, defaults, kContext);
}

TEST(ServerApiTest, ChatRequestFieldsAndDefaults) {
  absl::StatusOr<CompletionRequest> r = Chat(
      R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],
          "max_tokens":12,"top_k":5,"stop":["\n\n","END"],"stream":true})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 2u);
  EXPECT_EQ(r->messages[1].role, "user");
  EXPECT_EQ(r->messages[1].content, "Hi");
  EXPECT_EQ(r->max_tokens, 12);
  EXPECT_EQ(r->sampling.top_k, 5);
  EXPECT_EQ(r->sampling.temperature, 0.5f);  // the server's default
  EXPECT_EQ(r->sampling.seed, 7u);
  EXPECT_EQ(r->stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_TRUE(r->stream);

  // Chat runs to the end by default; completions stop at 16, as OpenAI's.
  EXPECT_EQ(Chat(R"({"messages":[{"role":"user","content":"x"}]})")->max_tokens, -1);
  absl::StatusOr<CompletionRequest> c =
      ParseCompletionRequest(R"({"prompt":"x","stop":"."})", false, {}, kContext);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_tokens, 16);
  EXPECT_EQ(c->stop, std::vector<std::string>{"."});
}

// What OpenAI clients and llama-server's users send: content as an array of
// text parts (joined by newlines, as llama.cpp's concat_content_parts), a
// prompt as token ids or a one-prompt batch, seed -1 (random).
TEST(ServerApiTest, ContentPartsTokenIdPromptsAndARandomSeed) {
  absl::StatusOr<CompletionRequest> parts = Chat(
      R"({"messages":[{"role":"user","content":[{"type":"text","text":"Hi"},
                                                 {"type":"text","text":"there"}]}]})");
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(parts->messages[0].content, "Hi\nthere");
  const absl::StatusOr<CompletionRequest> image = Chat(
      R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})");
  ASSERT_FALSE(image.ok());
  EXPECT_NE(std::string(image.status().message()).find("'messages[0].content[0]'"),
            std::string::npos)
      << image.status();

  for (const char* body : {R"({"prompt":[1, 2, 3]})", R"({"prompt":[[1, 2, 3]]})"}) {
    absl::StatusOr<CompletionRequest> ids = ParseCompletionRequest(body, false, {}, kContext);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(ids->prompt_ids, (std::vector<int32_t>{1, 2, 3})) << body;
  }
  absl::StatusOr<CompletionRequest> batch =
      ParseCompletionRequest(R"({"prompt":["one prompt"]})", false, {}, kContext);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ(batch->prompt, "one prompt");
  for (const char* bad : {R"({"prompt":[1, -2]})", R"({"prompt":["a", "b"]})", R"({"prompt":[]})"}) {
    EXPECT_FALSE(ParseCompletionRequest(bad, false, {}, kContext).ok()) << bad;
  }

  // -1: a seed drawn per request (63 bits: two draws do not collide).
  const auto seed = [](const char* body) { return Chat(body)->sampling.seed; };
  const char* random = R"({"messages":[{"role":"user","content":"x"}],"seed":-1})";
  EXPECT_NE(seed(random), seed(random));
  EXPECT_EQ(seed(R"({"messages":[{"role":"user","content":"x"}],"seed":5})"), 5u);
}

TEST(ServerApiTest, EveryBadFieldIsNamed) {
  const struct {
    const char* body;
    const char* names;
  } cases[] = {
      {"{not json", "not valid JSON"},
      {"[1, 2]", "JSON object"},
      {"{\"messages\":\"hi\"}", "'messages' must be an array"},
      {"{\"messages\":[]}", "'messages' must hold at least one"},
      {"{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", "'messages[0].role'"},
      {"{\"messages\":[{\"role\":\"user\"}]}", "'messages[0].content'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":-1}",
       "'max_tokens' is -1"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":100000000}",
       "'max_tokens' is 100000000"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":\"8\"}",
       "'max_tokens' must be an integer"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":-1}",
       "'temperature'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_p\":0}", "'top_p'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"seed\":-3}", "'seed'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[1]}", "'stop'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":\"yes\"}", "'stream'"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", "UTF-8"},
  };
  for (const auto& c : cases) {
    const absl::StatusOr<CompletionRequest> r = Chat(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(std::string(r.status().message()).find(c.names), std::string::npos)
        << c.body << ": " << r.status();
  }
  EXPECT_FALSE(ParseCompletionRequest("{\"prompt\":3}", false, {}, kContext).ok());
  // The field as an error object's param.
  EXPECT_EQ(ErrorField(Chat("{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}").status()),
            "messages[0].role");
  EXPECT_EQ(ErrorField(Chat("{\"messages\":[],\"top_p\":0}").status()), "messages");
  EXPECT_EQ(ErrorField(Chat("{not json").status()), "");
}

TEST(ServerApiTest, StopStringsCutTheTextAndHoldBackWhatMayBeginOne) {
  StopScanner s({"END", "\n\n"});
  EXPECT_EQ(s.Push("Hello E"), "Hello ");  // "E" may begin "END"
  EXPECT_EQ(s.Push("x"), "Ex");            // it did not
  EXPECT_EQ(s.Push(" and\n"), " and");
  EXPECT_FALSE(s.stopped());
  EXPECT_EQ(s.Push("\nmore"), "");  // "\n\n": stop, the rest dropped
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.Push("ignored"), "");
  EXPECT_EQ(s.Flush(), "");

  StopScanner split({"END"});
  EXPECT_EQ(split.Push("abcEN"), "abc");
  EXPECT_EQ(split.Push("D tail"), "");
  EXPECT_TRUE(split.stopped());

  StopScanner none({});
  EXPECT_EQ(none.Push("all of it"), "all of it");
  StopScanner unfinished({"END"});
  EXPECT_EQ(unfinished.Push("the E"), "the ");
  EXPECT_EQ(unfinished.Flush(), "E");  // generation ended first: the held text is text
}

TEST(ServerApiTest, ResponsesHaveOpenAisShapes) {
  const json chat = CompletionJson(true, "chatcmpl-1", 100, "m.gguf", "Hi!", "stop", {5, 2});
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "Hi!");
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chat["usage"]["total_tokens"], 7);

  const json text = CompletionJson(false, "cmpl-1", 100, "m.gguf", "abc", "length", {1, 3});
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "abc");

  const json chunk = ChunkJson(true, "chatcmpl-1", 100, "m.gguf", "Hi", "", nullptr);
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "Hi");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  const Usage usage{4, 2};
  const json last = ChunkJson(true, "chatcmpl-1", 100, "m.gguf", "", "length", &usage);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(last["usage"]["completion_tokens"], 2);

  const json error = ErrorJson("'messages' must be an array", 400, "messages");
  EXPECT_EQ(error["error"]["type"], "invalid_request_error");
  EXPECT_EQ(error["error"]["param"], "messages");
  EXPECT_EQ(ErrorJson("down", 503)["error"]["type"], "server_error");
}

// Log-probabilities as clients ask for them: completions' logprobs N and echo
// (max_tokens 0 then allowed: lm-evaluation-harness scores a prompt so), chat's
// logprobs true with top_logprobs N, llama-server's n_probs; each bad value named.
TEST(ServerApiTest, LogprobsEchoAndNProbsAreReadAndCheckedByName) {
  const auto completions = [](const char* body) {
    return ParseCompletionRequest(body, false, {}, kContext);
  };
  absl::StatusOr<CompletionRequest> harness =
      completions(R"({"prompt":[[1,2,3]],"max_tokens":0,"logprobs":1,"echo":true,"temperature":0})");
  ASSERT_TRUE(harness.ok()) << harness.status();
  EXPECT_EQ(harness->logprobs, 1);
  EXPECT_TRUE(harness->echo);
  EXPECT_EQ(harness->max_tokens, 0);
  EXPECT_EQ(completions(R"({"prompt":"x"})")->logprobs, -1);
  EXPECT_EQ(completions(R"({"prompt":"x","logprobs":null})")->logprobs, -1);

  EXPECT_EQ(Chat(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})")->logprobs, 0);
  EXPECT_EQ(Chat(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,
                     "top_logprobs":5})")->logprobs, 5);
  EXPECT_EQ(Chat(R"({"messages":[{"role":"user","content":"x"}],"logprobs":false})")->logprobs,
            -1);

  absl::StatusOr<CompletionRequest> native =
      ParseNativeCompletionRequest(R"({"prompt":"x","n_predict":4,"n_probs":3})", {}, kContext);
  ASSERT_TRUE(native.ok()) << native.status();
  EXPECT_EQ(native->logprobs, 3);
  EXPECT_EQ(ParseNativeCompletionRequest(R"({"prompt":"x","n_probs":0})", {}, kContext)->logprobs,
            -1);

  const struct {
    bool chat;
    const char* body;
    const char* field;
  } bad[] = {
      {false, R"({"prompt":"x","max_tokens":0})", "max_tokens"},
      {false, R"({"prompt":"x","logprobs":21})", "logprobs"},
      {false, R"({"prompt":"x","logprobs":-2})", "logprobs"},
      {false, R"({"prompt":"x","logprobs":true})", "logprobs"},
      {false, R"({"prompt":"x","echo":1})", "echo"},
      {false, R"({"prompt":"x","logprobs":1,"stream":true})", "logprobs"},
      {true, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", "top_logprobs"},
      {true, R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":30})",
       "top_logprobs"},
      {true, R"({"messages":[{"role":"user","content":"x"}],"logprobs":3})", "logprobs"},
  };
  for (const auto& c : bad) {
    const absl::StatusOr<CompletionRequest> r =
        ParseCompletionRequest(c.body, c.chat, {}, kContext);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(ErrorField(r.status()), c.field) << c.body << ": " << r.status();
  }
  for (const char* body : {R"({"prompt":"x","n_probs":21})", R"({"prompt":"x","n_probs":-1})",
                           R"({"prompt":"x","n_probs":2,"stream":true})"}) {
    const absl::StatusOr<CompletionRequest> r = ParseNativeCompletionRequest(body, {}, kContext);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ErrorField(r.status()), "n_probs") << body << ": " << r.status();
  }
}

// OpenAI's completions logprobs (an echoed first token null, offsets into the
// text) and the per-token array of chat and llama-server's /completion.
TEST(ServerApiTest, LogprobsHaveOpenAisAndLlamaServersShapes) {
  const TokenText text = [](int32_t t) { return "ab" + std::to_string(t); };
  const std::vector<int32_t> tokens = {4, 5, 6};
  const std::vector<TokenLogprobs> scored = {{5, -0.5, {{5, -0.5}, {9, -1.5}}},
                                             {6, -2.0, {{8, -0.25}, {6, -2.0}}}};
  const json legacy = CompletionsLogprobsJson(tokens, scored, text);
  EXPECT_EQ(legacy["tokens"], json({"ab4", "ab5", "ab6"}));
  EXPECT_TRUE(legacy["token_logprobs"][0].is_null());
  EXPECT_TRUE(legacy["top_logprobs"][0].is_null());
  EXPECT_EQ(legacy["token_logprobs"][1], -0.5);
  EXPECT_EQ(legacy["top_logprobs"][2], json({{"ab8", -0.25}, {"ab6", -2.0}}));
  EXPECT_EQ(legacy["text_offset"], json({0, 3, 6}));
  // Without an echo every token is scored.
  const std::vector<int32_t> completion = {5, 6};
  EXPECT_EQ(CompletionsLogprobsJson(completion, scored, text)["token_logprobs"], json({-0.5, -2.0}));

  const json array = TokenLogprobsArray(scored, text);
  ASSERT_EQ(array.size(), 2u);
  EXPECT_EQ(array[1]["id"], 6);
  EXPECT_EQ(array[1]["token"], "ab6");
  EXPECT_EQ(array[1]["bytes"], json({'a', 'b', '6'}));
  EXPECT_EQ(array[1]["logprob"], -2.0);
  ASSERT_EQ(array[1]["top_logprobs"].size(), 2u);
  EXPECT_EQ(array[1]["top_logprobs"][0], json({{"id", 8}, {"token", "ab8"}, {"bytes", {'a', 'b', '8'}},
                                              {"logprob", -0.25}}));

  const json chat = CompletionJson(true, "chatcmpl-1", 1, "m", "x", "stop", {1, 1},
                                   {{"content", array}});
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"], array);
  EXPECT_TRUE(CompletionJson(true, "chatcmpl-1", 1, "m", "x", "stop", {1, 1})["choices"][0]
                  ["logprobs"].is_null());
  const Usage usage{1, 2};
  EXPECT_EQ(NativeCompletionJson("m", "", "limit", &usage, array)["completion_probabilities"],
            array);
  EXPECT_FALSE(NativeCompletionJson("m", "", "limit", &usage).contains("completion_probabilities"));
}

}  // namespace
}  // namespace moegraph
