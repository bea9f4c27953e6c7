// `moegraph serve` as a client sees it: the binary in a subprocess on a fixture
// carrying Qwen3's real vocabulary (tools/fetch-vocab.sh; skips without it),
// talked to over loopback with cpp-httplib's client. Replies equal `moegraph
// run`'s text for the same prompt, usage counts equal the tokenizer's, streams
// equal whole replies, bad requests get OpenAI error objects and leave the
// server serving, a full queue answers 503, a client that leaves mid-stream
// stops its generation, the API key guards all but /health, SIGTERM exits 0.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/serve_process.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using nlohmann::json;
using testing_util::Contains;
using testing_util::ProcessResult;
using testing_util::RunProcess;

std::string Qwen3Json() { return testing_util::Qwen3TokenizerJson(MOEGRAPH_SOURCE_DIR); }

// A TCP connection to port on this machine, or -1.
int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

class CliServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(Qwen3Json())) return;
    fixture_ = new std::string(testing_util::TempPath("serve-qwen3.gguf"));
    const ProcessResult made = testing_util::MakeVocabFixture(MOEGRAPH_BIN, Qwen3Json(), *fixture_);
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  static void TearDownTestSuite() {
    if (fixture_ != nullptr) std::remove(fixture_->c_str());
    delete fixture_;
    fixture_ = nullptr;
  }
  void SetUp() override {
    if (fixture_ == nullptr) {
      GTEST_SKIP() << Qwen3Json()
                   << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
    }
  }

  // A server on the fixture (or model) with extra flags; a client for it.
  std::unique_ptr<httplib::Client> Serve(const std::vector<std::string>& flags) {
    return ServeModel(*fixture_, flags);
  }
  std::unique_ptr<httplib::Client> ServeModel(const std::string& model,
                                              const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"-m", model, "--backend", "cpu"};
    args.insert(args.end(), flags.begin(), flags.end());
    port_ = server_.Start(args);
    EXPECT_GT(port_, 0) << server_.Log();
    auto client = std::make_unique<httplib::Client>("127.0.0.1", port_);
    client->set_read_timeout(60, 0);
    return client;
  }

  // `moegraph run`'s text for a prompt (greedy), with bytes that are not UTF-8
  // (a character cut off where generation stopped) as U+FFFD, as JSON carries it.
  static std::string RunText(const std::string& prompt, int n) {
    const ProcessResult r = RunProcess({MOEGRAPH_BIN, "run", "-m", *fixture_, "--backend", "cpu",
                                        "-p", prompt, "-n", std::to_string(n)});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const std::string text = r.out.ends_with("\n") ? r.out.substr(0, r.out.size() - 1) : r.out;
    return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace))
        .get<std::string>();
  }

  static int TokenCount(const std::string& text) {
    const ProcessResult r =
        RunProcess({MOEGRAPH_BIN, "tokenize", "-m", *fixture_, "-p", text, "--ids"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return static_cast<int>(json::parse(r.out).size());
  }

  static json Post(httplib::Client& c, const std::string& path, const json& body,
                   int want_status = 200) {
    const httplib::Result res = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res) << path << ": no answer";
    if (!res) return json();
    EXPECT_EQ(res->status, want_status) << path << " " << body.dump() << ": " << res->body;
    return json::parse(res->body, nullptr, false);
  }

  // A chat request of 6 tokens: "Hi"; after a reply to it, the reply and the question.
  static json ChatTurn(const json& reply, const std::string& question = "And then?") {
    json messages = {{{"role", "user"}, {"content", "Hi"}}};
    if (!reply.is_null()) {
      messages.push_back(
          {{"role", "assistant"}, {"content", reply["choices"][0]["message"]["content"]}});
      messages.push_back({{"role", "user"}, {"content", question}});
    }
    return {{"messages", messages}, {"max_tokens", 6}};
  }

  // The deltas (or texts) of a stream, and its last data line before [DONE].
  static std::string StreamText(httplib::Client& c, const std::string& path, json body,
                                json* last_chunk) {
    body["stream"] = true;
    std::string raw;
    const httplib::Result res = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return "";
    EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
    raw = res->body;
    std::string text;
    std::vector<std::string> data;
    std::regex event(R"(data: (.*)\n\n)");
    for (auto it = std::sregex_iterator(raw.begin(), raw.end(), event);
         it != std::sregex_iterator(); ++it) {
      data.push_back((*it)[1]);
    }
    EXPECT_GE(data.size(), 2u) << raw;
    if (data.size() < 2) return "";
    EXPECT_EQ(data.back(), "[DONE]");
    for (size_t i = 0; i + 1 < data.size(); ++i) {
      const json chunk = json::parse(data[i]);
      if (chunk.contains("error")) {  // an error event ends the stream
        *last_chunk = chunk;
        continue;
      }
      const json& choice = chunk["choices"][0];
      if (choice.contains("delta") && choice["delta"].contains("content")) {
        text += choice["delta"]["content"].get<std::string>();
      } else if (choice.contains("text")) {
        text += choice["text"].get<std::string>();
      }
      *last_chunk = chunk;
    }
    return text;
  }

  // moegraph_NAME's value in /metrics (-1: none).
  static int Metric(httplib::Client& c, const std::string& name) {
    const httplib::Result r = c.Get("/metrics");
    if (!r) return -1;
    std::smatch m;
    const std::regex value("\nmoegraph_" + name + " (\\d+)");
    return std::regex_search(r->body, m, value) ? std::stoi(m[1]) : -1;
  }

  static std::string* fixture_;
  testing_util::ServeProcess server_{MOEGRAPH_BIN};
  int port_ = -1;
};

std::string* CliServeTest::fixture_ = nullptr;

TEST_F(CliServeTest, CompletionsEqualRunAndCountAsTheTokenizer) {
  std::unique_ptr<httplib::Client> c = Serve({});
  ASSERT_TRUE(c->Get("/health"));
  EXPECT_EQ(c->Get("/health")->body, R"({"status":"ok"})");
  const json models = json::parse(c->Get("/v1/models")->body);
  EXPECT_EQ(models["data"][0]["id"], std::filesystem::path(*fixture_).filename().string());

  const std::string prompt = "The capital of France is";
  const json r = Post(*c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 12}});
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], RunText(prompt, 12));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"]["prompt_tokens"], TokenCount(prompt));
  EXPECT_EQ(r["usage"]["completion_tokens"], 12);

  // The same streamed: the chunks add up to the same text.
  json last;
  EXPECT_EQ(StreamText(*c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 12}}, &last),
            r["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(last["usage"]["completion_tokens"], 12);

  // A stop string inside that text: the text before it, finish_reason stop.
  // (One whole character from the middle, so the request stays valid UTF-8.)
  const std::string full = r["choices"][0]["text"];
  ASSERT_GE(full.size(), 6u);
  size_t at = full.size() / 2;
  while (at > 0 && (static_cast<unsigned char>(full[at]) & 0xC0) == 0x80) --at;
  size_t end = at + 1;
  while (end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) ++end;
  const std::string stop = full.substr(at, end - at);
  const json stopped =
      Post(*c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 12}, {"stop", stop}});
  EXPECT_EQ(stopped["choices"][0]["text"], full.substr(0, full.find(stop)));
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");

  // Tokenize and detokenize round-trip.
  const json ids = Post(*c, "/tokenize", {{"content", prompt}});
  EXPECT_EQ(static_cast<int>(ids["tokens"].size()), TokenCount(prompt));
  EXPECT_EQ(Post(*c, "/detokenize", {{"tokens", ids["tokens"]}})["content"], prompt);

  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

TEST_F(CliServeTest, ChatStreamsWhatItAnswersWhole) {
  std::unique_ptr<httplib::Client> c = Serve({});
  const json body = {{"messages",
                      {{{"role", "system"}, {"content", "Be brief."}},
                       {{"role", "user"}, {"content", "What is a mixture of experts?"}}}},
                     {"max_tokens", 10}};
  const json whole = Post(*c, "/v1/chat/completions", body);
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["choices"][0]["message"]["role"], "assistant");
  EXPECT_GT(whole["usage"]["prompt_tokens"].get<int>(), 10);
  json last;
  EXPECT_EQ(StreamText(*c, "/v1/chat/completions", body, &last),
            whole["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(last["object"], "chat.completion.chunk");
  EXPECT_EQ(last["usage"]["prompt_tokens"], whole["usage"]["prompt_tokens"]);
  EXPECT_EQ(last["usage"]["completion_tokens"], whole["usage"]["completion_tokens"]);
  // The stream repeats the prompt: all of it but one token comes from the cache.
  EXPECT_EQ(last["usage"]["prompt_tokens_details"]["cached_tokens"],
            whole["usage"]["prompt_tokens"].get<int>() - 1);

  const std::string metrics = c->Get("/metrics")->body;
  EXPECT_NE(metrics.find("moegraph_requests_total 2"), std::string::npos) << metrics;
  const int generated = 2 * whole["usage"]["completion_tokens"].get<int>();
  EXPECT_NE(metrics.find("moegraph_completion_tokens_total " + std::to_string(generated)),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("moegraph_expert_hits_total"), std::string::npos) << metrics;
  EXPECT_EQ(server_.Stop(SIGINT), 0) << server_.Log();
}

TEST_F(CliServeTest, BadRequestsGetErrorObjectsAndTheServerGoesOn) {
  std::unique_ptr<httplib::Client> c = Serve({"--ctx", "64", "--max-body", "2000"});
  const struct {
    std::string path, body;
    int status;
    std::string param;
  } cases[] = {
      {"/v1/chat/completions", "{\"messages\": [", 400, ""},
      {"/v1/chat/completions", "{\"messages\": []}", 400, "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "robot", "content": "x"}]})", 400,
       "messages[0].role"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 1000000})", 400, "max_tokens"},
      {"/v1/completions", "{\"prompt\": \"\xc3\x28\"}", 400, ""},
      {"/v1/completions",
       json{{"prompt", std::string(300, 'a') +
                           " b c d e f g h i j k l m n o p "
                           "q r s t u v w x y z 1 2 3 4 5 6 7 8 9 0 a b c d e f g h "
                           "i j k l m n o p q r s t u v w x y z"}}
           .dump(),
       400, "prompt"},
      {"/v1/completions", json{{"prompt", std::string(3000, 'a')}}.dump(), 413, ""},
      {"/v1/nothing", "{}", 404, ""},
  };
  for (const auto& k : cases) {
    const httplib::Result res = c->Post(k.path, k.body, "application/json");
    ASSERT_TRUE(res) << k.body;
    EXPECT_EQ(res->status, k.status) << k.path << " " << k.body << ": " << res->body;
    const json error = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(error.contains("error")) << res->body;
    EXPECT_TRUE(error["error"]["message"].is_string()) << res->body;
    if (!k.param.empty()) {
      EXPECT_EQ(error["error"]["param"], k.param) << res->body;
    }
  }
  // Still serving, and correctly.
  const json ok = Post(*c, "/v1/completions", {{"prompt", "Hello"}, {"max_tokens", 4}});
  EXPECT_EQ(ok["choices"][0]["text"], RunText("Hello", 4));
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// A browser's CORS preflight is answered without the API key and every reply
// allows any origin; OpenAI's content parts and a token-id prompt give the
// replies their text and token forms give.
TEST_F(CliServeTest, CorsContentPartsAndTokenIdPrompts) {
  std::unique_ptr<httplib::Client> c = Serve({"--api-key", "k"});
  const httplib::Result preflight =
      c->Options("/v1/chat/completions", {{"Origin", "http://localhost:3000"},
                                          {"Access-Control-Request-Method", "POST"},
                                          {"Access-Control-Request-Headers", "authorization"}});
  ASSERT_TRUE(preflight);
  EXPECT_EQ(preflight->status, 204) << preflight->body;
  EXPECT_EQ(preflight->get_header_value("Access-Control-Allow-Origin"), "*");
  EXPECT_EQ(preflight->get_header_value("Access-Control-Allow-Headers"), "authorization");
  c->set_bearer_token_auth("k");
  const json parts = Post(*c, "/v1/chat/completions",
                          {{"messages", {{{"role", "user"},
                                          {"content", {{{"type", "text"}, {"text", "Hi"}}}}}}},
                           {"max_tokens", 6}});
  const json plain = Post(*c, "/v1/chat/completions",
                          {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 6}});
  EXPECT_EQ(parts["choices"][0]["message"], plain["choices"][0]["message"]);
  const httplib::Result health = c->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->get_header_value("Access-Control-Allow-Origin"), "*");

  const httplib::Result ids = c->Post("/tokenize", R"({"content": "Hello"})", "application/json");
  ASSERT_TRUE(ids);
  const json tokens = json::parse(ids->body)["tokens"];
  const json by_ids = Post(*c, "/v1/completions", {{"prompt", tokens}, {"max_tokens", 4}});
  const json by_text = Post(*c, "/v1/completions", {{"prompt", "Hello"}, {"max_tokens", 4}});
  EXPECT_EQ(by_ids["choices"][0]["text"], by_text["choices"][0]["text"]);
  EXPECT_EQ(by_ids["usage"]["prompt_tokens"], tokens.size());
  Post(*c, "/v1/completions", {{"prompt", {1, 1 << 30}}, {"max_tokens", 4}}, 400);
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// Log-probabilities as evaluation harnesses ask for them: a greedy chat's
// tokens each the likeliest with its top_logprobs in order; an echoed prompt
// with its first token null (max_tokens 0: nothing generated); /completion's
// n_probs; a stream with logprobs refused by name. The scoring pass leaves the
// cache as it found the tokens: a plain request after it equals run's text.
TEST_F(CliServeTest, LogprobsOfChatCompletionsEchoAndNProbs) {
  std::unique_ptr<httplib::Client> c = Serve({"--ctx", "512"});
  const json chat = Post(*c, "/v1/chat/completions",
                         {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                          {"max_tokens", 6},
                          {"temperature", 0},
                          {"logprobs", true},
                          {"top_logprobs", 3}});
  const json content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), chat["usage"]["completion_tokens"].get<size_t>()) << chat.dump();
  for (const json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 3u) << t.dump();
    EXPECT_EQ(t["id"], t["top_logprobs"][0]["id"]) << "greedy picks the likeliest: " << t.dump();
    EXPECT_EQ(t["logprob"], t["top_logprobs"][0]["logprob"]) << t.dump();
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(),
              t["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_GE(t["top_logprobs"][1]["logprob"].get<double>(),
              t["top_logprobs"][2]["logprob"].get<double>());
  }

  const std::string prompt = "The capital of France is";
  const json echo = Post(*c, "/v1/completions",
                         {{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 2}});
  const json lp = echo["choices"][0]["logprobs"];
  const size_t n_prompt = echo["usage"]["prompt_tokens"];
  EXPECT_EQ(echo["usage"]["completion_tokens"], 0);
  EXPECT_EQ(echo["choices"][0]["text"], prompt);
  ASSERT_EQ(lp["tokens"].size(), n_prompt) << echo.dump();
  ASSERT_EQ(lp["token_logprobs"].size(), n_prompt);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t i = 1; i < n_prompt; ++i) {
    EXPECT_LT(lp["token_logprobs"][i].get<double>(), 0.0) << i;
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u) << i;
  }
  std::string joined;
  for (size_t i = 0; i < n_prompt; ++i) {
    EXPECT_EQ(lp["text_offset"][i], joined.size());
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, prompt);
  // Echo and a completion: the completion's tokens follow the prompt's.
  const json both = Post(*c, "/v1/completions",
                         {{"prompt", prompt}, {"max_tokens", 3}, {"echo", true}, {"logprobs", 0}});
  const json both_lp = both["choices"][0]["logprobs"];
  ASSERT_EQ(both_lp["tokens"].size(), n_prompt + both["usage"]["completion_tokens"].get<size_t>());
  for (size_t i = 1; i < n_prompt; ++i) {
    EXPECT_EQ(both_lp["token_logprobs"][i], lp["token_logprobs"][i]) << i;
  }
  const std::string run = RunText(prompt, 3);
  EXPECT_EQ(both["choices"][0]["text"], prompt + run);
  // After the scoring passes, the cache still answers as run does.
  EXPECT_EQ(Post(*c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 3}})["choices"][0]
                ["text"],
            run);

  const json native = Post(*c, "/completion", {{"prompt", prompt}, {"n_predict", 3}, {"n_probs", 2}});
  ASSERT_EQ(native["completion_probabilities"].size(), native["tokens_predicted"].get<size_t>());
  EXPECT_EQ(native["completion_probabilities"][0]["top_logprobs"].size(), 2u);

  const json streamed = Post(*c, "/v1/completions",
                             {{"prompt", prompt}, {"logprobs", 1}, {"stream", true}}, 400);
  EXPECT_EQ(streamed["error"]["param"], "logprobs");
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// lm-evaluation-harness's request (local-completions: the prompt as token ids,
// echo, logprobs 1, max_tokens 0 here) on the model trained here scores the
// prompt as `moegraph perplexity` does: a 64-token chunk's second half, from
// the echoed token_logprobs, is perplexity's first chunk.
TEST_F(CliServeTest, EchoedLogprobsEqualPerplexitysOnTheSameTokens) {
  const std::string model = MOEGRAPH_SOURCE_DIR "/models/kjv-moe-f16.gguf";
  const std::string text_file = MOEGRAPH_SOURCE_DIR "/models/kjv-held-out.txt";
  const ProcessResult ppl =
      RunProcess({MOEGRAPH_BIN, "perplexity", "-m", model, "-f", text_file, "-c", "64",
                  "--chunks", "1", "--backend", "cpu"});
  ASSERT_EQ(ppl.exit_code, 0) << ppl.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(ppl.err, m, std::regex(R"(\[1\]([0-9.]+),)"))) << ppl.err;
  const double chunk_ppl = std::stod(m[1]);

  std::ifstream in(text_file);
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  std::unique_ptr<httplib::Client> c = ServeModel(model, {"--ctx", "128"});
  const json tokenized = Post(*c, "/tokenize", {{"content", head}, {"add_special", true}});
  ASSERT_GE(tokenized["tokens"].size(), 64u);
  const json chunk(tokenized["tokens"].begin(), tokenized["tokens"].begin() + 64);
  const json reply = Post(*c, "/v1/completions",
                          {{"prompt", {chunk}},
                           {"max_tokens", 0},
                           {"echo", true},
                           {"logprobs", 1},
                           {"temperature", 0}});
  const json lp = reply["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 64u) << reply.dump();
  // Positions 32..62 predict tokens 33..63 (quality/perplexity.h).
  double nll = 0;
  for (int i = 33; i < 64; ++i) {
    nll -= lp["token_logprobs"][i].get<double>();
    // The harness's is_greedy: the token's value against the likeliest's.
    const json top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 1u);
    EXPECT_GE(top.begin().value().get<double>(), lp["token_logprobs"][i].get<double>());
  }
  const double echo_ppl = std::exp(nll / 31);
  EXPECT_NEAR(echo_ppl, chunk_ppl, 1e-4 * chunk_ppl)
      << "echo " << echo_ppl << ", perplexity [1]" << chunk_ppl;
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// llama-server's own endpoints for its clients: /completion (n_predict,
// content, stop, tokens_predicted; a stream without [DONE]), /props and
// /slots; its --slots switch (no count) is taken with a note.
TEST_F(CliServeTest, LlamaServersCompletionPropsAndSlots) {
  std::unique_ptr<httplib::Client> c = Serve({"--ctx", "512", "--slots"});
  EXPECT_TRUE(Contains(server_.Log(), "llama-server's switch for the /slots endpoint"))
      << server_.Log();
  const json whole = Post(*c, "/completion", {{"prompt", "Hello"}, {"n_predict", 4}});
  EXPECT_EQ(whole["content"], RunText("Hello", 4)) << whole.dump();
  EXPECT_EQ(whole["stop"], true);
  EXPECT_EQ(whole["tokens_predicted"], 4);
  EXPECT_EQ(whole["tokens_evaluated"], TokenCount("Hello"));
  EXPECT_EQ(whole["stop_type"], "limit");
  Post(*c, "/completion", {{"prompt", "Hello"}, {"n_predict", 0}}, 400);

  const httplib::Result stream = c->Post(
      "/completion", json{{"prompt", "Hello"}, {"n_predict", 4}, {"stream", true}}.dump(),
      "application/json");
  ASSERT_TRUE(stream);
  std::string text;
  json last;
  const std::regex event(R"(data: (.*)\n\n)");
  for (auto it = std::sregex_iterator(stream->body.begin(), stream->body.end(), event);
       it != std::sregex_iterator(); ++it) {
    last = json::parse((*it)[1].str());
    text += last["content"].get<std::string>();
  }
  EXPECT_EQ(text, whole["content"]);
  EXPECT_EQ(last["stop"], true) << stream->body;
  EXPECT_FALSE(Contains(stream->body, "[DONE]"));

  const httplib::Result props = c->Get("/props");
  ASSERT_TRUE(props);
  const json p = json::parse(props->body);
  EXPECT_EQ(p["total_slots"], 1);
  EXPECT_EQ(p["default_generation_settings"]["n_ctx"], 512);
  const httplib::Result slots = c->Get("/slots");
  ASSERT_TRUE(slots);
  const json s = json::parse(slots->body);
  ASSERT_EQ(s.size(), 1u) << slots->body;
  EXPECT_EQ(s[0]["is_processing"], false);
  // A client that has its whole reply finds the slot idle, every time (the
  // job is done only after the engine is).
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(c->Post("/completion", json{{"prompt", "Hi"}, {"n_predict", 1}}.dump(),
                        "application/json"));
    const httplib::Result after = c->Get("/slots");
    ASSERT_TRUE(after);
    EXPECT_EQ(json::parse(after->body)[0]["is_processing"], false) << "request " << i;
  }
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// curl -d sends application/x-www-form-urlencoded: a 100 KB body of that type
// is read as the JSON it is (httplib alone caps such bodies at 8 KB), held to
// --max-body like any other; a multipart body is refused by name.
TEST_F(CliServeTest, FormEncodedBodiesOverEightKilobytesAreReadAsJson) {
  std::unique_ptr<httplib::Client> c = Serve({"--max-body", "200000"});
  const std::string request = R"({"prompt": "Hello", "max_tokens": 4})";
  const std::string padded = request + std::string(100000, ' ');
  const httplib::Result ok =
      c->Post("/v1/completions", padded, "application/x-www-form-urlencoded");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(json::parse(ok->body)["choices"][0]["text"], RunText("Hello", 4));
  const httplib::Result tokens = c->Post(
      "/tokenize", R"({"content": "Hello"})" + std::string(50000, ' '),
      "application/x-www-form-urlencoded");
  ASSERT_TRUE(tokens);
  EXPECT_EQ(tokens->status, 200) << tokens->body;

  const httplib::Result over = c->Post("/v1/completions", request + std::string(300000, ' '),
                                       "application/x-www-form-urlencoded");
  ASSERT_TRUE(over);
  EXPECT_EQ(over->status, 413);
  EXPECT_NE(over->body.find("--max-body"), std::string::npos) << over->body;
  const httplib::Result multipart = c->Post(
      "/v1/completions", "--b\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n--b--\r\n",
      "multipart/form-data; boundary=b");
  ASSERT_TRUE(multipart);
  EXPECT_EQ(multipart->status, 415);
  EXPECT_NE(multipart->body.find("JSON"), std::string::npos) << multipart->body;
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// SIGTERM while one request generates and two wait: the running one ends at a
// token boundary with an error event (503: not a finish_reason, since it did
// not finish) and [DONE], the waiting ones get 503, and the process exits 0.
TEST_F(CliServeTest, SigtermEndsTheRunningGenerationAndAnswersTheQueueWith503) {
  std::unique_ptr<httplib::Client> c = Serve({"--max-queue", "4", "--ctx", "4096"});
  json last_chunk;
  std::string streamed;
  std::thread running([&] {
    httplib::Client own("127.0.0.1", port_);
    own.set_read_timeout(60, 0);
    streamed =
        StreamText(own, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 4000}}, &last_chunk);
  });
  for (int i = 0; i < 500 && Metric(*c, "requests_running") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<int> statuses(2, 0);
  std::vector<std::string> errors(2);
  std::vector<std::thread> waiting;
  for (int i = 0; i < 2; ++i) {
    waiting.emplace_back([&, i] {
      httplib::Client own("127.0.0.1", port_);
      own.set_read_timeout(60, 0);
      const httplib::Result r =
          own.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 5})", "application/json");
      if (!r) return;
      statuses[i] = r->status;
      errors[i] = r->body;
    });
  }
  for (int i = 0; i < 500 && Metric(*c, "queue_depth") != 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(Metric(*c, "queue_depth"), 2) << "the two requests are not waiting";
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
  running.join();
  for (std::thread& t : waiting) t.join();
  ASSERT_TRUE(last_chunk.contains("error")) << last_chunk.dump();
  EXPECT_EQ(last_chunk["error"]["code"], 503) << last_chunk.dump();
  EXPECT_TRUE(testing_util::Contains(last_chunk["error"]["message"].get<std::string>(),
                                     "shutting down: the generation ended after"))
      << last_chunk.dump();
  EXPECT_FALSE(streamed.empty());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(statuses[i], 503) << errors[i];
    EXPECT_TRUE(testing_util::Contains(errors[i], "shutting down")) << errors[i];
  }
  EXPECT_TRUE(testing_util::Contains(server_.Log(), "serve: SIGTERM, stopping")) << server_.Log();
}

TEST_F(CliServeTest, TheApiKeyGuardsAllButHealth) {
  std::unique_ptr<httplib::Client> c = Serve({"--api-key", "sesame"});
  EXPECT_EQ(c->Get("/health")->status, 200);
  EXPECT_EQ(c->Get("/v1/models")->status, 401);
  EXPECT_EQ(c->Get("/v1/models", {{"Authorization", "Bearer sesam"}})->status, 401);
  EXPECT_EQ(c->Get("/v1/models", {{"Authorization", "Bearer sesame!"}})->status, 401);
  const httplib::Result denied =
      c->Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", "application/json");
  ASSERT_TRUE(denied);
  EXPECT_EQ(denied->status, 401);
  EXPECT_TRUE(json::parse(denied->body).contains("error"));
  c->set_bearer_token_auth("sesame");
  EXPECT_EQ(c->Get("/v1/models")->status, 200);
  Post(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}});
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

TEST_F(CliServeTest, AFullQueueAnswers503AndALeavingClientStopsItsGeneration) {
  std::unique_ptr<httplib::Client> c = Serve({"--max-queue", "0", "--ctx", "4096"});
  // A long generation, streamed; the client leaves after its first chunk.
  std::atomic<bool> streaming{false};
  std::thread leaver([&] {
    httplib::Client l("127.0.0.1", port_);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = json{{"prompt", "Once"}, {"max_tokens", 4000}, {"stream", true}}.dump();
    req.set_header("Content-Type", "application/json");
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
      streaming = true;
      if (++chunks < 2) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the 503s happen now
      return false;
    };
    l.send(req);
  });
  // While it runs, the queue (0 waiting) is full. The probes start once it
  // streams: a probe the engine took first would answer the leaver 503 instead
  // (on a loaded machine its request can arrive after the first probe).
  for (int i = 0; i < 3000 && !streaming; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!streaming) {
    leaver.join();
    FAIL() << "the long generation never streamed: " << server_.Log();
  }
  int busy = 0;
  for (int i = 0; i < 100 && busy == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const httplib::Result r =
        c->Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", "application/json");
    ASSERT_TRUE(r);
    if (r->status == 503) {
      ++busy;
      EXPECT_EQ(r->get_header_value("Retry-After"), "1");
      EXPECT_TRUE(json::parse(r->body).contains("error"));
    }
  }
  leaver.join();
  EXPECT_EQ(busy, 1) << "no 503 while the engine was busy";
  // The abandoned generation ends at a token boundary: the next request runs.
  json ok;
  for (int i = 0; i < 100; ++i) {
    const httplib::Result r =
        c->Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
    ASSERT_TRUE(r);
    if (r->status == 200) {
      ok = json::parse(r->body);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(ok["usage"]["completion_tokens"], 2);
  const std::string metrics = c->Get("/metrics")->body;
  const std::regex tokens(R"(moegraph_completion_tokens_total (\d+))");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(metrics, m, tokens)) << metrics;
  EXPECT_LT(std::stoi(m[1]), 4000) << "the leaver's generation ran on";
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// A client that sends a whole-reply request and leaves before the reply has its
// generation stopped, and one that leaves while it waits in the queue is never
// started; the engine goes on with the next request.
TEST_F(CliServeTest, LeavingClientsOfWholeRepliesStopOrSkipTheirGenerations) {
  std::unique_ptr<httplib::Client> c = Serve({"--max-queue", "4", "--ctx", "4096"});
  const std::string request = [] {
    const std::string body = json{{"prompt", "Once"}, {"max_tokens", 4000}}.dump();
    return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           "Content-Length: " +
           std::to_string(body.size()) + "\r\n\r\n" + body;
  }();
  const auto connect_and_send = [this, &request] {
    const int fd = ConnectLoopback(port_);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(request.size()));
    return fd;
  };
  const auto metric = [&c](const std::string& name) { return Metric(*c, name); };
  const int running = connect_and_send();
  for (int i = 0; i < 500 && metric("requests_running") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int waiting = connect_and_send();
  for (int i = 0; i < 500 && metric("queue_depth") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(metric("queue_depth"), 1) << "the second request is not waiting";
  close(waiting);
  // Its handler looks every 100 ms: seen gone before the engine reaches it.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  close(running);
  // Both gone at a token boundary: a new request is answered in full.
  const json ok = Post(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(ok["usage"]["completion_tokens"], 2);
  EXPECT_EQ(metric("requests_abandoned_total"), 2);
  EXPECT_LT(metric("completion_tokens_total"), 4000) << "the leaver's generation ran on";
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
  const std::string log = server_.Log();
  EXPECT_TRUE(testing_util::Contains(log, "cmpl-1: prompt")) << log;
  EXPECT_TRUE(testing_util::Contains(log, "(client left)")) << log;
  EXPECT_TRUE(testing_util::Contains(log, "cmpl-2: client left before it started")) << log;
}

// The KV prefix a request shares with the previous one is not prefilled again
// (usage.prompt_tokens_details.cached_tokens, moegraph_prompt_tokens_cached_total),
// and the reply is the one a fresh server gives.
TEST_F(CliServeTest, ASharedPrefixIsNotPrefilledAgainAndChangesNothing) {
  std::unique_ptr<httplib::Client> c = Serve({});
  const json turn1 = ChatTurn(json());
  const json r1 = Post(*c, "/v1/chat/completions", turn1);
  EXPECT_EQ(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json turn2 = ChatTurn(r1);
  const json r2 = Post(*c, "/v1/chat/completions", turn2);
  const int cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GE(cached, r1["usage"]["prompt_tokens"].get<int>());
  EXPECT_LT(cached, r2["usage"]["prompt_tokens"].get<int>());
  // The same prompt again: all of it but the token whose logits pick the first.
  const json again = Post(*c, "/v1/chat/completions", turn2);
  EXPECT_EQ(again["usage"]["prompt_tokens_details"]["cached_tokens"],
            r2["usage"]["prompt_tokens"].get<int>() - 1);
  EXPECT_EQ(again["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]);
  const std::string metrics = c->Get("/metrics")->body;
  const std::string counted = "moegraph_prompt_tokens_cached_total " +
                              std::to_string(cached + r2["usage"]["prompt_tokens"].get<int>() - 1);
  EXPECT_NE(metrics.find(counted), std::string::npos) << counted << " in\n" << metrics;
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();

  std::unique_ptr<httplib::Client> fresh = Serve({});
  const json alone = Post(*fresh, "/v1/chat/completions", turn2);
  EXPECT_EQ(alone["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(alone["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]);
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// qwen35moe's recurrent state holds every position fed: a request resumes
// from the end of what was fed (the next turn of a chat) or from the newest
// checkpoint at or below what it shares (kStateCheckpoints: the start of each
// prompt and its position before its last token), and feeds the rest again.
// The same prompt again keeps all but its last token, as a KV cache does; an
// edited last question resumes at the start of its turn (the log says so);
// each reply is a fresh server's, one that scored a reply's logprobs between.
TEST_F(CliServeTest, ARecurrentModelResumesFromItsEndOrItsCheckpoints) {
  const std::string model = testing_util::TempPath("serve-qwen35.gguf");
  const ProcessResult made =
      testing_util::MakeVocabFixture(MOEGRAPH_BIN, Qwen3Json(), model, "qwen35moe");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  std::unique_ptr<httplib::Client> c = ServeModel(model, {});
  const json r1 = Post(*c, "/v1/chat/completions", ChatTurn(json()));
  const int turn1_tokens = r1["usage"]["prompt_tokens"].get<int>();
  const json turn2 = ChatTurn(r1);
  const json r2 = Post(*c, "/v1/chat/completions", turn2);
  const int turn2_tokens = r2["usage"]["prompt_tokens"].get<int>();
  const auto cached = [](const json& r) {
    return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  };
  EXPECT_GE(cached(r2), turn1_tokens);
  const json again = Post(*c, "/v1/chat/completions", turn2);
  EXPECT_EQ(cached(again), turn2_tokens - 1);
  EXPECT_EQ(again["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]);
  const json edited_turn = ChatTurn(r1, "And after that?");
  const json edited = Post(*c, "/v1/chat/completions", edited_turn);
  EXPECT_EQ(cached(edited), cached(r2));  // the checkpoint at the start of turn 2's prompt
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
  EXPECT_TRUE(testing_util::Contains(server_.Log(), "the recurrent state resumed at position"))
      << server_.Log();

  std::unique_ptr<httplib::Client> fresh = ServeModel(model, {});
  EXPECT_EQ(Post(*fresh, "/v1/chat/completions", turn2)["choices"][0]["message"]["content"],
            r2["choices"][0]["message"]["content"]);
  // Logprobs' scoring pass goes back to the checkpoint before the completion
  // and leaves the state at its end: the next request answers as before.
  json scored_turn = turn2;
  scored_turn["logprobs"] = true;
  const json scored = Post(*fresh, "/v1/chat/completions", scored_turn);
  EXPECT_EQ(scored["choices"][0]["logprobs"]["content"].size(),
            scored["usage"]["completion_tokens"].get<size_t>());
  EXPECT_EQ(Post(*fresh, "/v1/chat/completions", edited_turn)["choices"][0]["message"]["content"],
            edited["choices"][0]["message"]["content"]);
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
  std::remove(model.c_str());
}

// VmRSS of a process, in KiB (-1 where it cannot be read).
long RssKib(pid_t pid) {
  const std::string status =
      testing_util::ReadFileToString("/proc/" + std::to_string(pid) + "/status");
  const size_t at = status.find("VmRSS:");
  return at == std::string::npos ? -1 : std::stol(status.substr(at + 6));
}

// Bytes sent raw to the port; the reply's status line (empty: none).
std::string RawExchange(int port, const std::string& bytes, int timeout_ms) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256];
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  close(fd);
  const std::string reply = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  return reply.substr(0, reply.find("\r\n"));
}

// Clients that send half a request and wait hold a connection thread each
// until --timeout: 40 of them leave /health answering at once (a stall would
// last the 10 s timeout).
TEST_F(CliServeTest, FortyHalfSentRequestsDoNotStallHealth) {
  std::unique_ptr<httplib::Client> c = Serve({"--timeout", "10"});
  std::vector<int> held;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectLoopback(port_);
    ASSERT_GE(fd, 0);
    const std::string half = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le";
    ASSERT_GT(send(fd, half.data(), half.size(), MSG_NOSIGNAL), 0);
    held.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // all accepted and reading
  const auto start = std::chrono::steady_clock::now();
  const httplib::Result health = c->Get("/health");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  EXPECT_LT(seconds, 5.0) << "/health waited for the half-sent requests' timeout";
  for (const int fd : held) close(fd);
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// The numbers of the request ids in the server's per-request log lines, in the
// order the engine finished them ("serve: cmpl-N: prompt ...").
std::vector<int> FinishedIds(const std::string& log) {
  std::vector<int> ids;
  const std::regex line(R"(serve: (?:chat)?cmpl-(\d+): prompt )");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    ids.push_back(std::stoi((*it)[1]));
  }
  return ids;
}

// 8 clients x 20 requests at once: every one answered with its own prompt's
// text (each prompt's reply is first taken alone), none lost or mixed up, and
// served in FIFO order: a request's id numbers it in the queue, and the engine
// finishes them in that order.
TEST_F(CliServeTest, EightClientsTwentyRequestsEachGetTheirOwnRepliesInOrder) {
  std::unique_ptr<httplib::Client> c = Serve({"--max-queue", "16"});
  constexpr int kClients = 8, kRequests = 20;
  const auto prompt_of = [](int client, int i) {
    return "Client " + std::to_string(client) + " asks question " + std::to_string(i);
  };
  std::map<std::string, std::string> want;
  for (int k = 0; k < kClients; ++k) {
    for (int i = 0; i < kRequests; ++i) {
      const json r = Post(*c, "/v1/completions", {{"prompt", prompt_of(k, i)}, {"max_tokens", 3}});
      want[prompt_of(k, i)] = r["choices"][0]["text"];
    }
  }
  std::atomic<int> answered{0}, wrong{0};
  std::mutex ids_mu;
  std::set<std::string> reply_ids;
  std::vector<std::thread> clients;
  for (int k = 0; k < kClients; ++k) {
    clients.emplace_back([&, k] {
      httplib::Client own("127.0.0.1", port_);
      own.set_read_timeout(120, 0);
      for (int i = 0; i < kRequests; ++i) {
        const json body = {{"prompt", prompt_of(k, i)}, {"max_tokens", 3}};
        const httplib::Result r = own.Post("/v1/completions", body.dump(), "application/json");
        if (!r || r->status != 200) continue;
        ++answered;
        const json reply = json::parse(r->body);
        if (reply["choices"][0]["text"] != want[prompt_of(k, i)]) ++wrong;
        std::lock_guard<std::mutex> lock(ids_mu);
        reply_ids.insert(reply["id"].get<std::string>());
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(answered, kClients * kRequests);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(reply_ids.size(), static_cast<size_t>(kClients * kRequests));
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
  const std::vector<int> finished = FinishedIds(server_.Log());
  ASSERT_EQ(finished.size(), static_cast<size_t>(2 * kClients * kRequests)) << server_.Log();
  for (size_t i = 0; i < finished.size(); ++i) {
    ASSERT_EQ(finished[i], static_cast<int>(i) + 1) << "served out of queue order";
  }
  for (int n = kClients * kRequests + 1; n <= 2 * kClients * kRequests; ++n) {
    EXPECT_EQ(reply_ids.count("cmpl-" + std::to_string(n)), 1u) << n;
  }
}

// 2,000 malformed or hostile requests (bodies, headers, broken HTTP, requests
// left half sent, dropped after --timeout): the server still answers a good
// request correctly, and its memory grows by no more than a bound.
TEST_F(CliServeTest, TwoThousandHostileRequestsLeaveItServing) {
  // A small context bounds a flipped byte that drops max_tokens (chat then runs to the end).
  std::unique_ptr<httplib::Client> c =
      Serve({"--max-body", "65536", "--timeout", "1", "--ctx", "256"});
  const json good = {{"prompt", "Hello"}, {"max_tokens", 4}};
  const json first = Post(*c, "/v1/completions", good);
  const long rss_before = RssKib(server_.pid());
  ASSERT_GT(rss_before, 0);

  // Requests left half sent hold a connection until the read timeout.
  std::vector<std::thread> slow;
  for (int i = 0; i < 3; ++i) {
    slow.emplace_back([this] {
      RawExchange(port_, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                  500);
    });
  }
  std::mt19937 rng(11);
  const std::vector<std::string> paths = {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                          "/detokenize"};
  const std::string valid = R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2})";
  int answered_4xx = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string& path = paths[rng() % paths.size()];
    std::string body;
    switch (i % 8) {
      case 0:  // random bytes
        for (int n = rng() % 200; n > 0; --n) body += static_cast<char>(rng() % 256);
        break;
      case 1:  // a valid request cut short
        body = valid.substr(0, rng() % valid.size());
        break;
      case 2:  // wrong types
        body = R"({"messages":{"role":1},"max_tokens":"many","stream":3,"stop":{}})";
        break;
      case 3:  // deep nesting
        body = std::string(500, '[') + std::string(500, ']');
        break;
      case 4:  // numbers out of range
        body = R"({"prompt":"x","max_tokens":1e300,"temperature":-1e300,"top_k":99999999999})";
        break;
      case 5:  // a byte flipped in a valid request
        body = valid;
        body[rng() % body.size()] = static_cast<char>(rng() % 256);
        break;
      case 6: {  // broken HTTP on a raw socket
        const std::string raw[] = {
            "GARBAGE\r\n\r\n", "POST / HTTP/9.9\r\n\r\n",
            "GET /health HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\nContent-Length: "
            "99999999999999999999\r\n\r\n",
            std::string("GET /") + std::string(9000, 'a') + " HTTP/1.1\r\n\r\n"};
        RawExchange(port_, raw[rng() % 5], 150);
        continue;
      }
      default:  // huge header, hostile values
        body = valid;
        break;
    }
    httplib::Headers headers;
    if (i % 8 == 7) headers.emplace("X-Junk", std::string(4000, 'j'));
    const httplib::Result r = c->Post(path, headers, body, "application/json");
    if (!r || r->status >= 500) {
      ADD_FAILURE() << "request " << i << " to " << path << ": "
                    << (r ? r->body : "no answer: " + httplib::to_string(r.error()));
      break;
    }
    if (r->status >= 400) ++answered_4xx;
  }
  for (std::thread& t : slow) t.join();
  EXPECT_GT(answered_4xx, 1000);
  const json after = Post(*c, "/v1/completions", good);
  EXPECT_EQ(after["choices"][0]["text"], first["choices"][0]["text"]);
  const long rss_after = RssKib(server_.pid());
  EXPECT_LT(rss_after - rss_before, 64 * 1024) << rss_before << " KiB before, " << rss_after;
  EXPECT_EQ(server_.Stop(SIGTERM), 0) << server_.Log();
}

// A port another server holds is refused (no SO_REUSEPORT sharing): the second
// serve exits 1 naming the port before it reads the weights, the first still answers. --alias names the
// model. A synthetic vocabulary is enough for both.
TEST(CliServePortTest, ATakenPortIsRefusedAndTheFirstServerStillAnswers) {
  const std::string fixture = testing_util::TempPath("serve-port.gguf");
  ASSERT_EQ(RunProcess({MOEGRAPH_BIN, "make-fixture", "-o", fixture}).exit_code, 0);
  testing_util::ServeProcess first(MOEGRAPH_BIN);
  const int port = first.Start({"-m", fixture, "--backend", "cpu", "--alias", "my-model"});
  ASSERT_GT(port, 0) << first.Log();
  // timeout(1) ends a second server that wrongly listened, so the test fails, not hangs.
  // It binds before it reads the weights (--load-mode none says "load:" when it reads).
  const ProcessResult second =
      RunProcess({"/usr/bin/timeout", "60", MOEGRAPH_BIN, "serve", "-m", fixture, "--backend",
                  "cpu", "--port", std::to_string(port), "--load-mode", "none"});
  EXPECT_EQ(second.exit_code, 1) << second.err;
  EXPECT_FALSE(testing_util::Contains(second.err, "load: ")) << second.err;
  EXPECT_TRUE(
      testing_util::Contains(second.err, "--host 127.0.0.1 --port " + std::to_string(port) +
                                             ": the port is in use (another server listens there)"))
      << second.err;
  httplib::Client client("127.0.0.1", port);
  const httplib::Result health = client.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  const httplib::Result models = client.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "my-model") << models->body;
  EXPECT_EQ(first.Stop(SIGTERM), 0) << first.Log();
  std::remove(fixture.c_str());
}

// An IPv6 address is printed in brackets, as a URL takes it, and answers there.
TEST(CliServePortTest, AnIpv6AddressIsAUrlInBrackets) {
  std::ifstream inet6("/proc/net/if_inet6");
  const std::string addresses((std::istreambuf_iterator<char>(inet6)),
                              std::istreambuf_iterator<char>());
  if (!Contains(addresses, "00000000000000000000000000000001")) {
    GTEST_SKIP() << "no IPv6 loopback (::1) on this machine";
  }
  const std::string fixture = testing_util::TempPath("serve-ipv6.gguf");
  ASSERT_EQ(RunProcess({MOEGRAPH_BIN, "make-fixture", "-o", fixture}).exit_code, 0);
  testing_util::ServeProcess server(MOEGRAPH_BIN);
  const int port = server.Start({"-m", fixture, "--backend", "cpu", "--host", "::1"});
  ASSERT_GT(port, 0) << server.Log();
  EXPECT_TRUE(Contains(server.Log(), "listening on http://[::1]:" + std::to_string(port)))
      << server.Log();
  httplib::Client client("::1", port);
  const httplib::Result health = client.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(server.Stop(SIGTERM), 0) << server.Log();
  std::remove(fixture.c_str());
}

}  // namespace
}  // namespace moegraph
