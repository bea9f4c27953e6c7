#include "loader/host_memory.h"

#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
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

namespace {

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<uint64_t> ReadNumber(const std::string& path) {
  const std::optional<std::string> text = ReadText(path);
  uint64_t n = 0;
  if (!text.has_value() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &n)) {
    return std::nullopt;
  }
  return n;
}

// The value of `key` in a memory.stat ("key value" lines).
std::optional<uint64_t> StatValue(const std::string& path, absl::string_view key) {
  const std::optional<std::string> text = ReadText(path);
  if (!text.has_value()) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    const std::vector<absl::string_view> kv = absl::StrSplit(line, ' ');
    uint64_t n = 0;
    if (kv.size() == 2 && kv[0] == key && absl::SimpleAtoi(kv[1], &n)) return n;
  }
  return std::nullopt;
}

// Limits at or above this are "none" (v1 writes 2^63 rounded to a page).
constexpr uint64_t kNoLimit = uint64_t{1} << 62;

uint64_t Room(uint64_t limit, uint64_t usage, uint64_t cache) {
  const uint64_t held = usage > cache ? usage - cache : 0;
  return limit > held ? limit - held : 0;
}

}  // namespace

std::optional<uint64_t> CgroupMemoryAvailable(absl::string_view self_cgroup,
                                              const std::string& root) {
  std::optional<uint64_t> room;
  for (absl::string_view line : absl::StrSplit(self_cgroup, '\n')) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const std::string path(f[2]);
    if (f[0] == "0" && f[1].empty()) {  // v2: this cgroup and each ancestor
      for (std::string dir = path;; dir = dir.substr(0, dir.rfind('/'))) {
        const std::string at = root + (dir == "/" ? "" : dir);
        const std::optional<uint64_t> max = ReadNumber(at + "/memory.max");  // "max": none
        const std::optional<uint64_t> current = ReadNumber(at + "/memory.current");
        const std::optional<uint64_t> file = StatValue(at + "/memory.stat", "file");
        if (max.has_value() && *max < kNoLimit && current.has_value()) {
          const uint64_t r = Room(*max, *current, file.value_or(0));
          room = room.has_value() ? std::min(*room, r) : r;
        }
        if (dir.empty() || dir == "/") break;
      }
      continue;
    }
    for (absl::string_view controller : absl::StrSplit(f[1], ',')) {
      if (controller != "memory") continue;
      const std::string at = root + "/memory" + (path == "/" ? "" : path);
      const std::optional<uint64_t> limit =
          StatValue(at + "/memory.stat", "hierarchical_memory_limit");
      const std::optional<uint64_t> usage = ReadNumber(at + "/memory.usage_in_bytes");
      const std::optional<uint64_t> cache = StatValue(at + "/memory.stat", "total_cache");
      if (limit.has_value() && *limit < kNoLimit && usage.has_value()) {
        const uint64_t r = Room(*limit, *usage, cache.value_or(0));
        room = room.has_value() ? std::min(*room, r) : r;
      }
    }
  }
  return room;
}

uint64_t HostMemoryAvailable() {
  if (const char* set = std::getenv(std::string(kMemAvailableVar).c_str());
      set != nullptr && *set != '\0') {
    const std::optional<uint64_t> bytes = ParseMemorySize(set);
    if (bytes.has_value() && *bytes > 0) return *bytes;
  }
  uint64_t available = 0;
  std::ifstream meminfo("/proc/meminfo");
  constexpr absl::string_view kKey = "MemAvailable:";
  for (std::string line; std::getline(meminfo, line);) {
    uint64_t kib = 0;
    if (!absl::StartsWith(line, kKey)) continue;
    const absl::string_view rest = absl::StripSuffix(
        absl::StripAsciiWhitespace(absl::string_view(line).substr(kKey.size())), " kB");
    available = absl::SimpleAtoi(rest, &kib) ? kib * 1024 : 0;
    break;
  }
  const std::optional<std::string> self = ReadText("/proc/self/cgroup");
  const std::optional<uint64_t> cgroup =
      self.has_value() ? CgroupMemoryAvailable(*self, "/sys/fs/cgroup") : std::nullopt;
  if (cgroup.has_value() && (available == 0 || *cgroup < available)) return *cgroup;
  return available;
}

}  // namespace moegraph
