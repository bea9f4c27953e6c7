// moegraph serve: the OpenAI-compatible HTTP server (server/) over the engine
// `run` makes (the CPU backend or CUDA, the same flags). The port is bound
// before the weights are read (as llama-server binds first): a taken port fails
// at once, and a client that connects meanwhile waits for the load. SIGINT and SIGTERM stop it: the listener closes, the running
// generation ends at a token boundary, the queued requests get 503, exit 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "server/server.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

// What each flag means: tools/cli/command_line.cc.
ABSL_FLAG(std::string, host, "127.0.0.1", "the address to listen on");
ABSL_FLAG(int32_t, port, 8080, "the port to listen on (0: any free port)");
ABSL_FLAG(std::string, api_key, "", "the API key requests must send");
ABSL_FLAG(std::string, alias, "", "the model's id (empty: the file name)");
ABSL_FLAG(int32_t, max_queue, 16, "requests that may wait for the engine");
ABSL_FLAG(int64_t, max_body, 4 << 20, "the largest request body in bytes");
ABSL_FLAG(int32_t, timeout, 10, "seconds a connection may take to send its request");

namespace moegraph {
namespace {

constexpr int kServeDefaultContext = 4096;

// The decoder as the server's engine (given once the weights are in, before
// Server::Serve calls it).
class DecoderEngine final : public CompletionEngine {
 public:
  void Use(Decoder* decoder) { decoder_ = decoder; }
  absl::StatusOr<std::vector<int32_t>> Generate(const std::vector<int32_t>& prompt, int start,
                                                int n_predict, const SamplingParams& sampling,
                                                const TokenSink& sink) override {
    MG_RETURN_IF_ERROR(decoder_->SetSampling(sampling));
    GenerateStats stats;
    return decoder_->Generate(prompt, n_predict, start, &stats, sink);
  }
  absl::StatusOr<std::vector<TokenLogprobs>> Score(const std::vector<int32_t>& tokens, int start,
                                                   int from, int top_n) override {
    return decoder_->Score(tokens, start, from, top_n);
  }
  int ResumePosition(int start) const override { return decoder_->ResumePosition(start); }
  std::vector<std::pair<std::string, double>> Counters() override {
    absl::StatusOr<std::vector<std::pair<std::string, double>>> c = decoder_->Counters();
    return c.ok() ? *std::move(c) : std::vector<std::pair<std::string, double>>();
  }

 private:
  Decoder* decoder_ = nullptr;
};

absl::Status Serve() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.api_key = absl::GetFlag(FLAGS_api_key);
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  const int64_t max_body = absl::GetFlag(FLAGS_max_body);
  options.ctx = absl::GetFlag(FLAGS_ctx) == 0 ? kServeDefaultContext : absl::GetFlag(FLAGS_ctx);
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--port %d is not a port (0 to 65535)", options.port));
  }
  // The HTTP pool has a thread per request that may wait.
  constexpr int kMaxQueue = 4096;
  if (options.max_queue < 0 || options.max_queue > kMaxQueue) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max-queue %d is not in [0, %d]", options.max_queue, kMaxQueue));
  }
  if (max_body < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("--max-body %d must be positive", max_body));
  }
  options.max_body_bytes = static_cast<size_t>(max_body);
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout);
  if (options.timeout_seconds < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--timeout %d must be at least 1 second", options.timeout_seconds));
  }
  if (options.ctx < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("--ctx %d must not be negative (0: %d)",
                                                      options.ctx, kServeDefaultContext));
  }
  MG_ASSIGN_OR_RETURN(DecoderFlags flags, ReadDecoderFlags());
  options.defaults = flags.sampling;
  if (flags.cuda) options.no_scoring = kCudaScoresNoTokens;
  options.log = stderr;

  // Signals go to the watcher thread only: blocked here, before any thread starts.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Model model, LoadModel(*file));
  MG_RETURN_IF_ERROR(ApplyExpertsUsed(flags, path, &model, stderr));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer,
                      Tokenizer::Create(std::move(vocab)));
  MG_ASSIGN_OR_RETURN(const ChatTemplate chat_template, FileChatTemplate(*file));
  const std::string alias = absl::GetFlag(FLAGS_alias);
  options.model_name = alias.empty() ? std::filesystem::path(path).filename().string() : alias;
  MG_RETURN_IF_ERROR(CheckContext(model, flags.cuda, flags.cpu, options.ctx, stderr));
  MG_RETURN_IF_ERROR(AutoHostCache(model, options.ctx, &flags, stderr));
  MG_RETURN_IF_ERROR(CheckHostCache(model, flags.host_cache_bytes));

  DecoderEngine engine;
  Server server(options, &engine, tokenizer.get(), chat_template);
  MG_ASSIGN_OR_RETURN(const int port, server.Bind());
  MG_RETURN_IF_ERROR(ReadWeights(file.get(), flags.load, stderr));
  std::fprintf(stderr, "%s(requests may name their own sampling)\nchat template: %s; context %d\n",
               StartupLines(flags).c_str(), std::string(ChatTemplateName(chat_template)).c_str(),
               options.ctx);
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder,
                      Decoder::Create(model, flags, options.ctx, stderr));
  engine.Use(decoder.get());
  // An IPv6 address goes in brackets in a URL (RFC 3986).
  const std::string url_host =
      options.host.find(':') != std::string::npos ? "[" + options.host + "]" : options.host;
  std::fprintf(stderr, "serve: listening on http://%s:%d (%s)\n", url_host.c_str(), port,
               options.api_key.empty() ? "no API key" : "API key required");
  std::fflush(stderr);

  std::thread watcher([&server, stop_signals] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    std::fprintf(stderr, "serve: %s, stopping\n", signal == SIGINT ? "SIGINT" : "SIGTERM");
    server.Stop();
  });
  server.Serve();
  // Serve also returns when the listener fails; the watcher then needs a signal.
  pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  std::fprintf(stderr, "serve: stopped\n");
  return absl::OkStatus();
}

}  // namespace

int RunServe(const std::vector<std::string>& args) { return RunModelCommand("serve", args, Serve); }

}  // namespace moegraph
