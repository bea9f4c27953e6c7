// Subcommands of the moegraph CLI. Each takes the positional arguments left
// after Abseil flag parsing (argv[0] and the subcommand name removed) and
// returns the process exit status. Flags live next to the command that reads
// them; flags shared by several commands are declared here.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, m);  // model file
ABSL_DECLARE_FLAG(std::string, o);  // output file or format

namespace moegraph {

int RunInspect(const std::vector<std::string>& args);
int RunMakeFixture(const std::vector<std::string>& args);
int RunRun(const std::vector<std::string>& args);

}  // namespace moegraph
