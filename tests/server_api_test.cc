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

}  // namespace
}  // namespace moegraph
