#include "loader/host_memory.h"

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace moegraph {

uint64_t HostMemoryAvailable() {
  std::ifstream meminfo("/proc/meminfo");
  constexpr absl::string_view kKey = "MemAvailable:";
  for (std::string line; std::getline(meminfo, line);) {
    uint64_t kib = 0;
    if (!absl::StartsWith(line, kKey)) continue;
    const absl::string_view rest = absl::StripSuffix(
        absl::StripAsciiWhitespace(absl::string_view(line).substr(kKey.size())), " kB");
    return absl::SimpleAtoi(rest, &kib) ? kib * 1024 : 0;
  }
  return 0;
}

}  // namespace moegraph
