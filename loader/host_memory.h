// The host's memory as the kernel reports it, or as the user says to take it.
#pragma once

#include <cstdint>
#include <optional>
#include "absl/strings/string_view.h"

namespace moegraph {

// The variable that overrides MemAvailable (docs/FLAGS.md): a size in bytes,
// or with K, M, G or T (binary).
inline constexpr absl::string_view kMemAvailableVar = "MOEGRAPH_MEM_AVAILABLE";

// "512M", "1.5G", "1048576" in bytes; nullopt for anything else.
std::optional<uint64_t> ParseMemorySize(absl::string_view text);

// What a new host allocation can take without swapping: MOEGRAPH_MEM_AVAILABLE
// where set (and a size), else /proc/meminfo's MemAvailable, in bytes; 0 when
// neither can be read.
uint64_t HostMemoryAvailable();

}  // namespace moegraph
