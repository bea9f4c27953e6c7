// moegraph serve's cost per request beside the engine alone, on one model, in
// one run: a short prompt, 16 tokens, greedy, on the CPU backend with every
// expert resident (`moegraph run`'s default there).
//   BM_Run:         the engine's Generate called directly, as `moegraph run`
//                   does after loading (tokenized prompt in, tokens out)
//   BM_ServeWhole:  POST /v1/completions over loopback, the whole reply
//   BM_ServeStream: the same with "stream": true, read to [DONE]
// items_per_second is requests per second; ttft_ms the time from sending the
// request (Run: calling Generate) to the first token's arrival; tok/s the
// generated tokens per second. Two prompts alternate, so the server's prompt
// cache (the prefix shared with the last request) never spares a prefill that
// run does: both prefill every prompt token.
//
// Usage: moegraph_serve_bench -m MODEL.gguf [--threads N] [--benchmark_* flags]
// (the model needs a vocabulary: a real GGUF, or `make serve-bench`'s fixture).
#include <benchmark/benchmark.h>
#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/cpu_backend.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "server/server.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kTokens = 16;
const char* const kPrompts[2] = {"Tell me a short story about a dragon.",
                                 "Write a poem about the sea at night."};

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// The CPU backend as the server's engine (cmd_serve.cc's adapter, without the
// CUDA half).
class BackendEngine final : public CompletionEngine {
 public:
  explicit BackendEngine(CpuBackend* backend) : backend_(backend) {}
  absl::StatusOr<std::vector<int32_t>> Generate(const std::vector<int32_t>& prompt, int start,
                                                int n_predict, const SamplingParams& sampling,
                                                const TokenSink& sink) override {
    backend_->Truncate(start);
    return backend_->Generate(prompt, n_predict, nullptr, sink, sampling);
  }
  absl::StatusOr<std::vector<TokenLogprobs>> Score(const std::vector<int32_t>& tokens, int start,
                                                   int from, int top_n) override {
    return ScoreTokens(*backend_, tokens, start, from, top_n, /*piece=*/512);
  }
  int ResumePosition(int start) const override { return backend_->ResumePosition(start); }
  std::vector<std::pair<std::string, double>> Counters() override { return {}; }

 private:
  CpuBackend* backend_;
};

// Everything the benchmarks share: the model, the backend, a server on it.
struct Setup {
  std::unique_ptr<GgufFile> file;
  Model model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<CpuBackend> run_backend, serve_backend;  // a KV cache each
  std::unique_ptr<BackendEngine> engine;
  std::unique_ptr<Server> server;
  std::thread serving;
  int port = 0;
  std::vector<int32_t> prompt_ids[2];
};
Setup* setup = nullptr;

absl::Status Load(const std::string& path, int threads) {
  setup = new Setup();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  setup->file = *std::move(file);
  absl::StatusOr<Model> model = LoadModel(*setup->file);
  if (!model.ok()) return model.status();
  setup->model = *std::move(model);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*setup->file);
  if (!vocab.ok()) return vocab.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create(*std::move(vocab));
  if (!tokenizer.ok()) return tokenizer.status();
  setup->tokenizer = *std::move(tokenizer);
  absl::StatusOr<ChatTemplate> chat_template = FileChatTemplate(*setup->file);
  if (!chat_template.ok()) return chat_template.status();

  CpuBackendOptions options;
  options.max_ctx = 512;
  options.resident = true;
  options.fast.threads = threads;
  for (std::unique_ptr<CpuBackend>* backend : {&setup->run_backend, &setup->serve_backend}) {
    absl::StatusOr<std::unique_ptr<CpuBackend>> made =
        CpuBackend::Create(setup->model, nullptr, options);
    if (!made.ok()) return made.status();
    *backend = *std::move(made);
  }
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::vector<int32_t>> ids = setup->tokenizer->Tokenize(kPrompts[i], true, true);
    if (!ids.ok()) return ids.status();
    setup->prompt_ids[i] = *std::move(ids);
  }

  setup->engine = std::make_unique<BackendEngine>(setup->serve_backend.get());
  ServerOptions server_options;
  server_options.port = 0;
  server_options.ctx = options.max_ctx;
  server_options.model_name = "bench";
  setup->server = std::make_unique<Server>(server_options, setup->engine.get(),
                                           setup->tokenizer.get(), *chat_template);
  absl::StatusOr<int> port = setup->server->Bind();
  if (!port.ok()) return port.status();
  setup->port = *port;
  setup->serving = std::thread([] { setup->server->Serve(); });
  return absl::OkStatus();
}

void Unload() {
  setup->server->Stop();
  setup->serving.join();
  delete setup;
}

// ttft_ms: the first tokens' times summed, or none (a whole reply arrives at
// once: no first token before the last).
void Report(benchmark::State& state, int64_t tokens, std::optional<double> ttft_ms) {
  state.SetItemsProcessed(state.iterations());
  if (ttft_ms.has_value()) {
    state.counters["ttft_ms"] = benchmark::Counter(*ttft_ms, benchmark::Counter::kAvgIterations);
  }
  state.counters["tok/s"] =
      benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kAvgIterations);
}

void BM_Run(benchmark::State& state) {
  double ttft_ms = 0.0;
  int64_t tokens = 0;
  int which = 0;
  for (auto _ : state) {
    const Clock::time_point sent = Clock::now();
    bool first = true;
    const TokenSink sink = [&](int32_t token) {
      if (first) ttft_ms += MsSince(sent);
      first = false;
      if (setup->tokenizer->vocab().IsEog(token)) return false;
      ++tokens;
      return true;
    };
    setup->run_backend->Truncate(0);
    absl::StatusOr<std::vector<int32_t>> out =
        setup->run_backend->Generate(setup->prompt_ids[which], kTokens, nullptr, sink);
    if (!out.ok()) return state.SkipWithError(std::string(out.status().message()).c_str());
    which ^= 1;
  }
  Report(state, tokens, ttft_ms);
}

void BM_ServeWhole(benchmark::State& state) {
  httplib::Client client("127.0.0.1", setup->port);
  client.set_keep_alive(true);
  client.set_tcp_nodelay(true);
  int64_t tokens = 0;
  int which = 0;
  for (auto _ : state) {
    const json body = {{"prompt", kPrompts[which]}, {"max_tokens", kTokens}, {"temperature", 0}};
    const httplib::Result r = client.Post("/v1/completions", body.dump(), "application/json");
    if (!r || r->status != 200) return state.SkipWithError("the request failed");
    tokens += json::parse(r->body)["usage"]["completion_tokens"].get<int64_t>();
    which ^= 1;
  }
  Report(state, tokens, std::nullopt);
}

void BM_ServeStream(benchmark::State& state) {
  httplib::Client client("127.0.0.1", setup->port);
  client.set_keep_alive(true);
  client.set_tcp_nodelay(true);
  double ttft_ms = 0.0;
  int64_t tokens = 0;
  int which = 0;
  for (auto _ : state) {
    const json body = {
        {"prompt", kPrompts[which]}, {"max_tokens", kTokens}, {"temperature", 0}, {"stream", true}};
    std::string events;
    bool first = true;
    const Clock::time_point sent = Clock::now();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      if (first) ttft_ms += MsSince(sent);
      first = false;
      events.append(data, n);
      return true;
    };
    const httplib::Result r = client.send(req);
    if (!r || r->status != 200) return state.SkipWithError("the request failed");
    // The last event before [DONE] carries usage.
    const size_t usage = events.rfind("data: {");
    if (usage == std::string::npos) return state.SkipWithError("no usage event");
    const json last = json::parse(events.substr(usage + 6, events.find('\n', usage) - usage - 6));
    tokens += last["usage"]["completion_tokens"].get<int64_t>();
    which ^= 1;
  }
  Report(state, tokens, ttft_ms);
}

BENCHMARK(BM_Run)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ServeWhole)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ServeStream)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::string model;
  int threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "-m" || arg == "--model") && i + 1 < argc) {
      model = argv[++i];
    } else if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "moegraph_serve_bench: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  if (model.empty()) {
    std::fprintf(stderr,
                 "usage: moegraph_serve_bench -m MODEL.gguf [--threads N] [--benchmark_* flags]\n");
    return 2;
  }
  if (const absl::Status loaded = moegraph::Load(model, threads); !loaded.ok()) {
    std::fprintf(stderr, "moegraph_serve_bench: %s\n", std::string(loaded.message()).c_str());
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  moegraph::Unload();
  return 0;
}
