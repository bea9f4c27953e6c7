// The moegraph command line before Abseil parses it: the commands and the flags
// each reads (with that command's meaning, a value placeholder and the
// default, for `COMMAND --help`), llama.cpp's spellings mapped to moegraph's,
// llama.cpp's flags that mean nothing here turned into notes, and a flag no
// command knows answered with the nearest one it does.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moegraph::cli {

struct FlagDoc {
  absl::string_view name;   // Abseil's name: ctx, top_k
  absl::string_view value;  // placeholder of the value (N, FILE, ...); empty for a boolean
  absl::string_view help;   // what it means to this command, its default included
};

struct CommandSpec {
  absl::string_view name;
  absl::string_view synopsis;  // after "moegraph NAME "
  absl::string_view summary;   // one line for `moegraph --help`
  int (*run)(const std::vector<std::string>& args);
  std::vector<FlagDoc> flags;
};

const std::vector<CommandSpec>& Commands();
const CommandSpec* FindCommand(absl::string_view name);

// How the user writes a flag: -m, --top-k.
std::string Spelled(absl::string_view name);

// `moegraph --help` and `moegraph COMMAND --help`.
std::string Usage();
std::string CommandHelp(const CommandSpec& command);

// "moegraph 0.1.0 (git 1a2b3c4), built with ..." for --version.
std::string VersionLine();

// The arguments after the command name, with flag names normalized (dashes
// in a name are underscores, as Abseil spells them), each llama.cpp spelling
// replaced by moegraph's flag, and llama.cpp's flags that have no meaning here
// removed (with their values) and described in notes. Errors (exit status 2):
// a flag this command does not read, with the nearest one it does; a
// llama.cpp flag refused with the reason; -ctk and -ctv with different types.
struct CommandLine {
  std::vector<std::string> args;
  std::vector<std::string> notes;
};
absl::StatusOr<CommandLine> Rewrite(const CommandSpec& command,
                                    const std::vector<std::string>& args);

// Whether args (after the command name) ask for help or the version.
bool AsksFor(const std::vector<std::string>& args, absl::string_view what);

}  // namespace moegraph::cli
