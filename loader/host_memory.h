// The host's memory as the kernel reports it, or as the user says to take it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"

namespace moegraph {

// The variable that overrides MemAvailable (docs/FLAGS.md): a size in bytes,
// or with K, M, G or T (binary).
inline constexpr absl::string_view kMemAvailableVar = "MOEGRAPH_MEM_AVAILABLE";

// What the host-memory decisions leave free of what is available: --load-mode
// auto (GgufFile::Load), --slots auto and --host-cache's default.
inline constexpr uint64_t kHostMemoryRailBytes = uint64_t{1} << 30;

// "512M", "1.5G", "1048576" in bytes; nullopt for anything else.
std::optional<uint64_t> ParseMemorySize(absl::string_view text);

// The room a memory cgroup leaves a process in it: `self_cgroup` is its
// /proc/self/cgroup, `root` where the hierarchies are mounted (/sys/fs/cgroup).
// cgroup v2: the least over its cgroup and their ancestors of memory.max less
// what they hold that is not page cache (memory.current - memory.stat's file);
// v1: memory.stat's hierarchical_memory_limit less usage_in_bytes less
// total_cache. nullopt where no limit applies or nothing can be read.
std::optional<uint64_t> CgroupMemoryAvailable(absl::string_view self_cgroup,
                                              const std::string& root);

// What a new host allocation can take without swapping: MOEGRAPH_MEM_AVAILABLE
// where set (and a size), else /proc/meminfo's MemAvailable, or the process's
// memory cgroup's room where that is less (a container's limit), in bytes; 0
// when none can be read.
uint64_t HostMemoryAvailable();

}  // namespace moegraph
