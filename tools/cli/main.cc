// moegraph: one binary, git-style subcommands, Abseil flags behind llama.cpp's
// spellings (tools/cli/command_line.h).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tools/cli/command_line.h"
#include "tools/cli/commands.h"

// Shared by several commands; tools/cli/command_line.cc says what each means to each.
ABSL_FLAG(std::string, m, "", "model file (GGUF)");
ABSL_FLAG(std::string, o, "", "output: a file, or a format");
ABSL_FLAG(std::string, p, "", "the prompt text, or bench's prompt lengths");
ABSL_FLAG(std::string, f, "", "read the text from this file instead of -p");
ABSL_FLAG(int32_t, ctx, 0, "context size");
ABSL_FLAG(bool, verbose, false, "more start-up lines");
ABSL_FLAG(bool, escape, true, "process escapes in -p and -f's text, as llama.cpp does");
ABSL_FLAG(bool, no_escape, false, "take -p and -f's text as it is");

namespace moegraph {

absl::StatusOr<uint64_t> SeedFlagOr(uint64_t command_default) {
  const int64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == kUnsetFlag) return command_default;
  if (seed < 0) {
    return absl::InvalidArgumentError("--seed " + std::to_string(seed) + " is negative");
  }
  return static_cast<uint64_t>(seed);
}

absl::StatusOr<int32_t> TokensToGenerate(int32_t command_default) {
  const std::string text = absl::GetFlag(FLAGS_n);
  if (text.empty()) return command_default;
  int32_t n = 0;
  if (!absl::SimpleAtoi(text, &n)) {
    return absl::InvalidArgumentError("-n '" + text + "' is not a token count");
  }
  if (n < kUntilTheEnd) {
    return absl::InvalidArgumentError("-n " + text +
                                      ": tokens to generate must be 0 or more (-1: until the end)");
  }
  return n;
}

namespace {

std::atomic<bool> g_interrupted{false};

void OnInterrupt(int) {
  if (g_interrupted.exchange(true)) {
    constexpr char kNewline[] = "\n";
    (void)!write(STDERR_FILENO, kNewline, 1);
    _exit(130);
  }
}

}  // namespace

void CatchInterrupts() {
  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  action.sa_flags = 0;  // no SA_RESTART: a blocking read of stdin returns
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
}

bool Interrupted() { return g_interrupted.load(); }

void ClearInterrupted() { g_interrupted.store(false); }

void ExitInterrupted() {
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(130);
}

InterruptsBlocked::InterruptsBlocked() {
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  pthread_sigmask(SIG_BLOCK, &block, &previous_);
}

InterruptsBlocked::~InterruptsBlocked() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }

std::string ProcessEscapes(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out += text[i];
      continue;
    }
    const char c = text[++i];
    switch (c) {
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case '\'':
      case '"':
      case '\\': out += c; break;
      default: {
        // \xHH with two hex digits is that byte; anything else stays as it was.
        const auto hex = [](char h) {
          return absl::ascii_isdigit(h) ? h - '0' : (h | 0x20) - 'a' + 10;
        };
        if (c == 'x' && i + 2 < text.size() && absl::ascii_isxdigit(text[i + 1]) &&
            absl::ascii_isxdigit(text[i + 2])) {
          out += static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2]));
          i += 2;
        } else {
          out += '\\';
          out += c;
        }
      }
    }
  }
  return out;
}

absl::StatusOr<std::optional<std::string>> PromptText() {
  const std::string path = absl::GetFlag(FLAGS_f);
  const std::string prompt = absl::GetFlag(FLAGS_p);
  if (!path.empty() && !prompt.empty()) {
    return absl::InvalidArgumentError("-p TEXT and -f FILE: give one of them");
  }
  const bool escape = absl::GetFlag(FLAGS_escape) && !absl::GetFlag(FLAGS_no_escape);
  if (path.empty()) {
    if (prompt.empty()) return std::optional<std::string>();
    return std::optional<std::string>(escape ? ProcessEscapes(prompt) : prompt);
  }
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return absl::InvalidArgumentError("-f " + path + ": is a folder, not a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("-f " + path + ": cannot read the file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError("-f " + path + ": reading the file failed");
  return std::optional<std::string>(escape ? ProcessEscapes(text) : std::move(text));
}

}  // namespace moegraph

namespace {

using moegraph::cli::CommandSpec;

int Main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::fputs(moegraph::cli::Usage().c_str(), stderr);
    return 2;
  }
  const std::string& first = args[0];
  if (first == "--help" || first == "-h" || first == "help") {
    if (first == "help" && args.size() > 1) {
      const CommandSpec* c = moegraph::cli::FindCommand(args[1]);
      if (c == nullptr) {
        std::fprintf(stderr, "moegraph help: no command '%s'\n\n%s", args[1].c_str(),
                     moegraph::cli::Usage().c_str());
        return 2;
      }
      std::fputs(moegraph::cli::CommandHelp(*c).c_str(), stdout);
      return 0;
    }
    std::fputs(moegraph::cli::Usage().c_str(), stdout);
    return 0;
  }
  if (first == "--version" || first == "version") {
    std::fputs(moegraph::cli::VersionLine().c_str(), stdout);
    return 0;
  }
  const CommandSpec* c = moegraph::cli::FindCommand(first);
  if (c == nullptr) {
    std::fprintf(stderr, "moegraph: unknown command '%s'\n\n%s", first.c_str(),
                 moegraph::cli::Usage().c_str());
    return 2;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (moegraph::cli::AsksFor(rest, "help")) {
    std::fputs(moegraph::cli::CommandHelp(*c).c_str(), stdout);
    return 0;
  }
  if (moegraph::cli::AsksFor(rest, "version")) {
    std::fputs(moegraph::cli::VersionLine().c_str(), stdout);
    return 0;
  }
  absl::StatusOr<moegraph::cli::CommandLine> line = moegraph::cli::Rewrite(*c, rest);
  if (!line.ok()) {
    std::fprintf(stderr, "moegraph %s: %s\n", std::string(c->name).c_str(),
                 std::string(line.status().message()).c_str());
    return 2;
  }
  for (const std::string& note : line->notes) std::fprintf(stderr, "%s\n", note.c_str());
  // Abseil parses the flags as if the command were the program.
  std::string program = absl::StrCat("moegraph ", c->name);
  std::vector<char*> sub_argv = {program.data()};
  for (std::string& arg : line->args) sub_argv.push_back(arg.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(sub_argv.size()), sub_argv.data());
  return c->run(std::vector<std::string>(positional.begin() + 1, positional.end()));
}

}  // namespace

int main(int argc, char** argv) {
  // Every error a user can cause is a Status with a message naming its flag or
  // file; an exception that escapes anyway still ends in one line, not an abort.
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moegraph: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "moegraph: internal error: an unknown exception\n");
  }
  return 1;
}
