#include "loader/host_memory.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace moegraph {

std::optional<uint64_t> ParseMemorySize(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  int shift = 0;
  if (!text.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(text.back()))) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: break;
    }
  }
  if (shift > 0) text.remove_suffix(1);
  double value = 0;
  if (text.empty() || !absl::SimpleAtod(text, &value) || !(value >= 0) ||
      value * static_cast<double>(uint64_t{1} << shift) >= 1.8e19) {
    return std::nullopt;
  }
  return static_cast<uint64_t>(value * static_cast<double>(uint64_t{1} << shift));
}

uint64_t HostMemoryAvailable() {
  if (const char* set = std::getenv(std::string(kMemAvailableVar).c_str());
      set != nullptr && *set != '\0') {
    const std::optional<uint64_t> bytes = ParseMemorySize(set);
    if (bytes.has_value() && *bytes > 0) return *bytes;
  }
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
