// moegraph serve's HTTP server (cpp-httplib): the OpenAI-compatible endpoints
// over one engine that decodes one sequence at a time. Requests wait in a
// bounded FIFO (full: 503 with Retry-After); an engine thread takes them in
// order. The KV cache keeps what the last request fed: the next one prefills
// only what follows the prefix they share (llama-server's prompt cache). A request whose client
// goes away (streamed or not) has its generation stopped at the next token, or is skipped if it
// has not started. Stop() (SIGINT/SIGTERM) closes the listener, ends the running generation at a
// token boundary and answers what is queued with 503.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/sample_math.h"
#include "quality/logprobs.h"
#include "reference/oracle.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace httplib {
class Server;
}

namespace moegraph {

// What the server drives, from its engine thread only.
class CompletionEngine {
 public:
  virtual ~CompletionEngine() = default;
  // prompt from position start (the KV cache below it kept from the earlier
  // calls, which fed at least start positions), then up to n_predict tokens
  // picked by sampling, each given to sink (which may stop generation); feeds
  // back all but the last.
  virtual absl::StatusOr<std::vector<int32_t>> Generate(const std::vector<int32_t>& prompt,
                                                        int start, int n_predict,
                                                        const SamplingParams& sampling,
                                                        const TokenSink& sink) = 0;
  // The log-probabilities of tokens[from..] each after the tokens before it,
  // with the top_n likeliest at each position (quality/logprobs.h), computed
  // from position start (the cache below it kept from the earlier calls;
  // start < from); the cache then holds all of tokens but the last.
  virtual absl::StatusOr<std::vector<TokenLogprobs>> Score(const std::vector<int32_t>& tokens,
                                                           int start, int from, int top_n) = 0;
  // The first position a generation from start computes again: start where
  // every position below it is kept (a KV cache), earlier where a recurrent
  // state cannot go back that far (Oracle::ResumePosition).
  virtual int ResumePosition(int start) const = 0;
  // The engine's counters for /metrics, read between generations: names
  // without the moegraph_ prefix (counters end in _total).
  virtual std::vector<std::pair<std::string, double>> Counters() = 0;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;      // 0: any free port (Bind returns it)
  std::string api_key;  // empty: no authentication
  int max_queue = 16;   // requests waiting while one generates
  size_t max_body_bytes = size_t{4} << 20;
  int timeout_seconds = 10;  // a connection's reads and writes
  int ctx = 4096;           // the engine's KV cache positions
  std::string model_name;   // /v1/models' id
  SamplingParams defaults;  // a request's sampling where it names none
  // Why the engine scores no tokens (logprobs are then refused); empty: it does.
  std::string no_scoring;
  // A line per finished request (its id, tokens, time to first token); null: none.
  std::FILE* log = nullptr;
};

class Server {
 public:
  // engine, tokenizer must outlive the server; the tokenizer serves every
  // thread at once (it keeps no state between calls).
  Server(const ServerOptions& options, CompletionEngine* engine, const Tokenizer* tokenizer,
         ChatTemplate chat_template);
  ~Server();

  // Binds the listening socket; returns the port, or an error naming --host and --port.
  absl::StatusOr<int> Bind();
  // Serves until Stop(); returns once the listener is closed and the engine
  // thread has ended.
  void Serve();
  // Safe from any thread; idempotent.
  void Stop();

 private:
  struct Job;
  void RegisterRoutes();
  // A request counted in responding_ has handed its reply over.
  void Responded();
  void EngineLoop();
  // Generates job's reply into it; EngineLoop marks it done once the engine is idle.
  void RunJob(Job& job);
  bool Enqueue(const std::shared_ptr<Job>& job);
  std::string Metrics();

  const ServerOptions options_;
  CompletionEngine* const engine_;
  const Tokenizer* const tokenizer_;
  const ChatTemplate chat_template_;
  std::unique_ptr<httplib::Server> http_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::pair<std::string, double>> engine_counters_;  // as of the last generation
  bool engine_busy_ = false;                                     // a request is generating
  int responding_ = 0;  // queued or running requests whose reply is not all handed to httplib
  uint64_t enqueued_ = 0;     // requests queued so far: their ids' numbers, in FIFO order
  std::vector<int32_t> fed_;  // engine thread: the tokens whose KV the cache holds
  std::atomic<bool> stopping_{false};
  std::thread engine_thread_;

  // /metrics
  std::atomic<uint64_t> requests_{0}, rejected_{0}, failed_{0}, cancelled_{0}, prompt_tokens_{0},
      cached_tokens_{0}, completion_tokens_{0};
  std::atomic<double> decode_seconds_{0.0};
};

}  // namespace moegraph
