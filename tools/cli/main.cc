// moegraph: one binary, git-style subcommands, Abseil flags.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "tools/cli/commands.h"

ABSL_FLAG(std::string, m, "", "model file (GGUF)");
ABSL_FLAG(std::string, o, "", "output: a file path, or a format (md|json) for report commands");
ABSL_FLAG(std::string, p, "",
          "bench: prompt tokens of the pp test (empty or 0: no pp test); run, tokenize: the text");
ABSL_FLAG(std::string, f, "", "run, tokenize: read the text from this file instead of -p");
ABSL_FLAG(int32_t, ctx, 0,
          "context size: run: the KV cache (0 fits the prompt and the generated tokens); "
          "make-fixture: {arch}.context_length written (0: 4096)");

namespace moegraph {

absl::StatusOr<uint64_t> SeedFlagOr(uint64_t command_default) {
  const int64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == kUnsetFlag) return command_default;
  if (seed < 0) {
    return absl::InvalidArgumentError("--seed " + std::to_string(seed) + " is negative");
  }
  return static_cast<uint64_t>(seed);
}

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
  // The flags this command reads, comma-separated (Abseil flags are global;
  // this keeps one command from taking another's).
  const char* flags;
};

constexpr Command kCommands[] = {
    {"inspect", "FILE: architecture, hyper-parameters and tensor table of a GGUF file",
     moegraph::RunInspect, ""},
    {"make-fixture", "write a synthetic MoE model as GGUF (see --help for flags)",
     moegraph::RunMakeFixture,
     "o,arch,layers,experts,top_k,embd,ff,shared_ff,heads,kv_heads,head_dim,vocab,tokenizer_json,"
     "pad_vocab,quant,router_skew,seed,expert_variants,legacy_experts,tied_output,ctx"},
    {"run",
     "-m FILE (-p TEXT | -f FILE | --tokens 1,2,3) -n N: greedy decode, prints the text "
     "as it comes (or ids) and tok/s",
     moegraph::RunRun,
     "m,p,f,tokens,n,ignore_eos,special,temp,top_k,top_p,min_p,seed,ctx,backend,slots,arm,"
     "steps_per_launch,t,kv_type"},
    {"chat",
     "-m FILE [--system TEXT] [--chat-template NAME]: a conversation, one message a line "
     "(a terminal or a pipe; EOF ends), the KV cache kept between turns",
     moegraph::RunChat,
     "m,system,chat_template,verbose_prompt,n,special,temp,top_k,top_p,min_p,seed,ctx,backend,"
     "slots,arm,steps_per_launch,t,kv_type"},
    {"serve",
     "-m FILE [--host 127.0.0.1] [--port 8080] [--api-key KEY]: an OpenAI-compatible HTTP "
     "server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, "
     "/tokenize, /detokenize)",
     moegraph::RunServe,
     "m,host,port,api_key,max_queue,max_body,timeout,temp,top_k,top_p,min_p,seed,ctx,backend,"
     "slots,arm,steps_per_launch,t,kv_type"},
    {"bench",
     "-m FILE [--arms ...] [--slots 16,32|auto] [-n 128] [-r 5]: arms side by side, "
     "llama-bench style",
     moegraph::RunBench,
     "m,p,n,arms,slots,r,o,routing_trace,record_routing,ctx,backend,steps_per_launch,t,kv_type"},
    {"tokenize",
     "-m FILE -p TEXT | -f FILE [--ids] [--no-bos] [--no-parse-special]: text to "
     "token ids with the file's vocabulary, like llama-tokenize",
     moegraph::RunTokenize, "m,p,f,ids,no_bos,no_parse_special"},
    {"trace", "stats FILE | synth -o FILE | convert IN OUT: routing traces (JSONL or binary)",
     moegraph::RunTrace, "o,experts,layers,top_k,steps,zipf,reuse,drift,weights,seed"},
    {"simulate",
     "--trace F --policy lru,slru,default,opt --slots 16,32,64: hit rates and cost model",
     moegraph::RunSimulate,
     "trace,policy,slots,pool,protected_frac,experts,block_mib,pcie_gbps,hbm_gbps,ram_gbps,"
     "resident_ms,o"},
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

std::vector<std::string> FlagsOf(const Command& c) {
  return absl::StrSplit(c.flags, ',', absl::SkipEmpty());
}

// How the user writes a flag: -m, --top-k.
std::string Spelled(const std::string& name) {
  return (name.size() == 1 ? "-" : "--") + absl::StrReplaceAll(name, {{"_", "-"}});
}

// `moegraph COMMAND --help`: the command's own flags, with their defaults.
int PrintCommandHelp(const Command& c) {
  std::printf("usage: moegraph %s %s\n", c.name, c.summary);
  const std::vector<std::string> names = FlagsOf(c);
  if (names.empty()) {
    std::printf("\n%s takes no flags.\n", c.name);
    return 0;
  }
  std::printf("\nflags (docs/FLAGS.md has the details):\n");
  for (const std::string& name : names) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      std::fprintf(stderr, "moegraph: internal error: %s lists the undefined flag %s\n", c.name,
                   name.c_str());
      return 3;
    }
    // A help that names a default itself has one that depends on the command.
    const std::string help = flag->Help();
    const std::string fallback = flag->DefaultValue();
    const bool show = !fallback.empty() && help.find("default") == std::string::npos;
    std::printf("  %s\n      %s%s\n", Spelled(name).c_str(), help.c_str(),
                show ? (" (default: " + fallback + ")").c_str() : "");
  }
  return 0;
}

// The index in args (names already normalized) of the first flag the command
// does not read; 0 when there is none. A flag's separate value is skipped, as
// Abseil parses it.
size_t ForeignFlag(const Command& c, const std::vector<std::string>& args) {
  const std::vector<std::string> own = FlagsOf(c);
  auto is_own = [&](const std::string& name) {
    return std::find(own.begin(), own.end(), name) != own.end();
  };
  for (size_t i = 2; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    const size_t start = arg.find_first_not_of('-');
    const size_t equals = arg.find('=');
    const std::string name =
        arg.substr(start, equals == std::string::npos ? equals : equals - start);
    if (is_own(name)) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (equals == std::string::npos && flag != nullptr && !flag->IsOfType<bool>()) ++i;
      continue;
    }
    // --noflag for a boolean flag.
    if (name.starts_with("no") && is_own(name.substr(2))) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr && flag->IsOfType<bool>()) continue;
    }
    return i;
  }
  return 0;
}

bool AsksForHelp(const std::vector<std::string>& args) {
  for (size_t i = 2; i < args.size() && args[i] != "--"; ++i) {
    if (args[i] == "--help" || args[i] == "-help" || args[i] == "-h") return true;
  }
  return false;
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
    std::vector<std::string> args = NormalizeFlagNames(argc, argv);
    if (AsksForHelp(args)) return PrintCommandHelp(c);
    if (const size_t foreign = ForeignFlag(c, args); foreign != 0) {
      const std::string as_written(argv[foreign], std::strcspn(argv[foreign], "="));
      std::fprintf(stderr, "moegraph %s: %s is not a flag of %s; 'moegraph %s --help' lists them\n",
                   c.name, as_written.c_str(), c.name, c.name);
      return 2;
    }
    // Parse flags as if the subcommand were the program.
    std::vector<char*> sub_argv = {args[0].data()};
    for (int i = 2; i < argc; ++i) sub_argv.push_back(args[i].data());
    std::vector<char*> rest =
        absl::ParseCommandLine(static_cast<int>(sub_argv.size()), sub_argv.data());
    return c.run(std::vector<std::string>(rest.begin() + 1, rest.end()));
  }
  std::fprintf(stderr, "moegraph: unknown command '%s'\n\n%s\n", argv[1], Usage().c_str());
  return 2;
}
