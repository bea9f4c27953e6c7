// moegraph: one binary, git-style subcommands, Abseil flags.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tools/commands.h"

ABSL_FLAG(std::string, m, "", "model file (GGUF)");
ABSL_FLAG(std::string, o, "", "output: a file path, or a format (md|json) for report commands");
ABSL_FLAG(std::string, p, "",
          "bench: prompt tokens of the pp test (empty or 0: no pp test); run, tokenize: the text");
ABSL_FLAG(std::string, f, "", "run, tokenize: read the text from this file instead of -p");
ABSL_FLAG(int32_t, ctx, 0,
          "context size: run: the KV cache (0 fits the prompt and the generated tokens); "
          "make-fixture: {arch}.context_length written (0: 4096)");

namespace moegraph {

absl::StatusOr<std::optional<std::string>> PromptText() {
  const std::string path = absl::GetFlag(FLAGS_f);
  const std::string prompt = absl::GetFlag(FLAGS_p);
  if (!path.empty() && !prompt.empty()) {
    return absl::InvalidArgumentError("-p TEXT and -f FILE: give one of them");
  }
  if (path.empty()) {
    if (prompt.empty()) return std::optional<std::string>();
    return std::optional<std::string>(prompt);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("-f " + path + ": cannot read the file");
  return std::optional<std::string>(
      std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
}

}  // namespace moegraph

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
};

constexpr Command kCommands[] = {
    {"inspect", "FILE: architecture, hyper-parameters and tensor table of a GGUF file",
     moegraph::RunInspect},
    {"make-fixture", "write a synthetic MoE model as GGUF (see --help for flags)",
     moegraph::RunMakeFixture},
    {"run",
     "-m FILE (-p TEXT | -f FILE | --tokens 1,2,3) -n N: greedy decode, prints the text "
     "as it comes (or ids) and tok/s",
     moegraph::RunRun},
    {"bench",
     "-m FILE [--arms ...] [--slots 16,32|auto] [-n 128] [-r 5]: arms side by side, "
     "llama-bench style",
     moegraph::RunBench},
    {"tokenize",
     "-m FILE -p TEXT | -f FILE [--ids] [--no-bos] [--no-parse-special]: text to "
     "token ids with the file's vocabulary, like llama-tokenize",
     moegraph::RunTokenize},
    {"trace", "stats FILE | synth -o FILE | convert IN OUT: routing traces (JSONL or binary)",
     moegraph::RunTrace},
    {"simulate",
     "--trace F --policy lru,slru,default,opt --slots 16,32,64: hit rates and cost model",
     moegraph::RunSimulate},
};

// Abseil flag names cannot hold '-', but llama.cpp-style flags do (--top-k):
// rewrite the name part of "--top-k=8" / "--top-k" to "--top_k". Values and
// positional arguments are left alone, and so is everything after "--".
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> out;
  bool positional_only = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") positional_only = true;
    if (!positional_only && i > 0 && arg.size() > 1 && arg[0] == '-') {
      size_t start = arg.find_first_not_of('-');
      size_t end = std::min(arg.find('='), arg.size());
      for (size_t j = start; j < end; ++j) {
        if (arg[j] == '-') arg[j] = '_';
      }
    }
    out.push_back(std::move(arg));
  }
  return out;
}

std::string Usage() {
  std::string s = "usage: moegraph COMMAND [flags] [args]\n\ncommands:\n";
  for (const Command& c : kCommands) s += "  " + std::string(c.name) + "  " + c.summary + "\n";
  s += "\n'moegraph COMMAND --help' lists the flags.";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(Usage());
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fprintf(argc < 2 ? stderr : stdout, "%s\n", Usage().c_str());
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    // Parse flags as if the subcommand were the program.
    std::vector<std::string> args = NormalizeFlagNames(argc, argv);
    std::vector<char*> sub_argv = {args[0].data()};
    for (int i = 2; i < argc; ++i) sub_argv.push_back(args[i].data());
    std::vector<char*> rest =
        absl::ParseCommandLine(static_cast<int>(sub_argv.size()), sub_argv.data());
    return c.run(std::vector<std::string>(rest.begin() + 1, rest.end()));
  }
  std::fprintf(stderr, "moegraph: unknown command '%s'\n\n%s\n", argv[1], Usage().c_str());
  return 2;
}
