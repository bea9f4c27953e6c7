// Subcommands of the moegraph CLI. Each takes the positional arguments left
// after Abseil flag parsing (argv[0] and the subcommand name removed) and
// returns the process exit status. Flags live next to the command that reads
// them; flags shared by several commands are declared here.
#pragma once

#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

ABSL_DECLARE_FLAG(std::string, m);  // model file
ABSL_DECLARE_FLAG(std::string, o);  // output file or format
ABSL_DECLARE_FLAG(int32_t, ctx);    // context size
// Shared by make-fixture, trace and simulate; 0 means the command's own default.
ABSL_DECLARE_FLAG(int32_t, layers);
ABSL_DECLARE_FLAG(int32_t, experts);
// Shared by make-fixture and trace synth (experts per token) and run (sampling's
// top-k); kUnsetTopK means the command's default (TopKFlagOr).
ABSL_DECLARE_FLAG(int32_t, top_k);
// Shared by make-fixture and trace synth (the bytes written) and run (the
// sampler's draws; -1 is random, as llama.cpp's); kUnsetFlag means the command's
// default.
ABSL_DECLARE_FLAG(int64_t, seed);
// Shared by run, chat (a number; empty: the command's default) and bench (a list).
ABSL_DECLARE_FLAG(std::string, n);
// Shared by run, chat, serve and bench: more start-up lines.
ABSL_DECLARE_FLAG(bool, verbose);
// Shared by simulate (a list) and run (N or auto); empty means the command's default.
ABSL_DECLARE_FLAG(std::string, slots);
// Shared by bench (the pp test's prompt length, a number; empty: no pp test) and
// tokenize (the text), as llama-bench's and llama-cli's -p.
ABSL_DECLARE_FLAG(std::string, p);
// Shared by run and tokenize: the text from a file instead of -p.
ABSL_DECLARE_FLAG(std::string, f);
// Shared by run and chat: print control tokens' text too.
ABSL_DECLARE_FLAG(bool, special);
// Shared by bench and perplexity: write the routing the run used to this trace file.
ABSL_DECLARE_FLAG(std::string, record_routing);

namespace moegraph {

inline constexpr int32_t kUnsetFlag = -1;
// --top-k's unset: llama.cpp's -1 (and any value <= 0) is sampling's "off".
inline constexpr int32_t kUnsetTopK = std::numeric_limits<int32_t>::min();
inline constexpr int32_t kRunDefaultTokens = 16;
// -n -1, as llama.cpp: until end-of-generation or the context is full.
inline constexpr int32_t kUntilTheEnd = -1;

// -n for run and chat: empty is command_default, -1 is kUntilTheEnd; another
// negative value, or one that is not a number, is an error naming -n.
absl::StatusOr<int32_t> TokensToGenerate(int32_t command_default);

// A shared numeric flag whose 0 stands for the command's own default.
template <typename T>
T FlagOr(const absl::Flag<T>& flag, T command_default) {
  const T value = absl::GetFlag(flag);
  return value != T{0} ? value : command_default;
}

// --top-k for the experts per token: unset or 0 is the command's default.
inline int32_t TopKFlagOr(int32_t command_default) {
  const int32_t k = absl::GetFlag(FLAGS_top_k);
  return k == kUnsetTopK || k == 0 ? command_default : k;
}

// --seed for make-fixture and trace synth: unset is the command's default;
// another negative value is an error naming the flag.
absl::StatusOr<uint64_t> SeedFlagOr(uint64_t command_default);

// A command that reads its model from -m and everything else from flags:
// exit status 1, with "moegraph NAME: " and the reason on stderr, for a
// positional argument or a failed `run`; else 0.
inline int RunModelCommand(const char* name, const std::vector<std::string>& args,
                           absl::Status (*run)()) {
  if (!args.empty()) {
    std::fprintf(stderr, "moegraph %s: unexpected argument '%s' (the model goes in -m FILE)\n",
                 name, args[0].c_str());
    return 1;
  }
  const absl::Status status = run();
  if (!status.ok()) {
    std::fprintf(stderr, "moegraph %s: %s\n", name, std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

// The text of -p or -f (not both; a file that cannot be read names it), or
// none; its escapes processed unless --no-escape.
absl::StatusOr<std::optional<std::string>> PromptText();

// Ctrl-C in run and chat, as llama-cli takes it: the first sets Interrupted()
// (a generation stops at its next token; a read of stdin returns, the handler
// not restarting it) and the command prints its summary and calls
// ExitInterrupted(); a second ends the process at once. Both exit 130.
void CatchInterrupts();
bool Interrupted();
void ClearInterrupted();
[[noreturn]] void ExitInterrupted();
// While one lives, SIGINT is blocked on this thread, so threads started then
// (the CPU pool's, the CUDA runtime's) never take it and it lands on the main
// thread, whose blocking read it interrupts.
class InterruptsBlocked {
 public:
  InterruptsBlocked();
  ~InterruptsBlocked();
  InterruptsBlocked(const InterruptsBlocked&) = delete;
  InterruptsBlocked& operator=(const InterruptsBlocked&) = delete;

 private:
  sigset_t previous_;
};

// llama.cpp's string_process_escapes (common/common.cpp): the escapes \n \r
// \t \' \" \\ and \xHH become their characters; any other backslash stays.
std::string ProcessEscapes(std::string_view text);

int RunInspect(const std::vector<std::string>& args);
int RunMakeFixture(const std::vector<std::string>& args);
int RunRun(const std::vector<std::string>& args);
int RunTrace(const std::vector<std::string>& args);
int RunSimulate(const std::vector<std::string>& args);
int RunBench(const std::vector<std::string>& args);
int RunTokenize(const std::vector<std::string>& args);
int RunChat(const std::vector<std::string>& args);
int RunServe(const std::vector<std::string>& args);
int RunGgufSplit(const std::vector<std::string>& args);
int RunPerplexity(const std::vector<std::string>& args);
int RunQuantize(const std::vector<std::string>& args);

}  // namespace moegraph
