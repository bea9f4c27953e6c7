// The host's memory as the kernel reports it.
#pragma once

#include <cstdint>

namespace moegraph {

// What a new host allocation can take without swapping: /proc/meminfo's
// MemAvailable, in bytes; 0 when it cannot be read.
uint64_t HostMemoryAvailable();

}  // namespace moegraph
