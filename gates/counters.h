// Engagement counters as one snapshot, whatever the backend: the expert path's
// EngineCounters (both backends), and on CUDA the kernels' DeviceCounters and the
// host's HostCounters. A gate snapshots before and after its workload and
// asserts on the delta, so it can only pass if the arm it names really ran.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "capture/graph.h"
#include "cpu/cpu_backend.h"
#include "kernels/kernels.h"

namespace moegraph {

enum class Counter : uint8_t {
  // The expert path as both backends report it (EngineCounters).
  kSteps,
  kHits,
  kMisses,
  kEvictions,
  kBytesStaged,
  // Incremented by the CUDA kernels themselves (DeviceCounters): the residency
  // step's decisions, the stage copy, and the experts each pass computed.
  kDeviceHits,
  kDeviceMisses,
  kDeviceEvictions,
  kDeviceBytesStaged,
  kPassAExperts,
  kPassBExperts,
  kCopyWaits,
  kChainedLaunches,
  kDeviceSteps,
  // Incremented by the CUDA engine's host code (HostCounters).
  kGraphLaunches,
  kCaptures,
  kEagerSteps,
  kHostSyncs,
  kH2dMemcpys,
  kProgrammaticLaunches,
  kPromptSteps,
  kPrefillTokens,
  kPrefillExpertsInPlace,
  kPrefillExpertsStreamed,
  kPrefillBytesStreamed,
};
inline constexpr size_t kCounterCount = static_cast<size_t>(Counter::kPrefillBytesStreamed) + 1;

// "misses", "device.pass_b_experts", "host.host_syncs", ...
std::string_view CounterName(Counter counter);

// Values of the counters a backend has; the others are absent.
class CounterValues {
 public:
  bool has(Counter c) const { return present_[Index(c)]; }
  // 0 for an absent counter.
  uint64_t operator[](Counter c) const { return values_[Index(c)]; }
  void Set(Counter c, uint64_t value);

 private:
  static size_t Index(Counter c) { return static_cast<size_t>(c); }
  std::array<uint64_t, kCounterCount> values_{};
  std::array<bool, kCounterCount> present_{};
};

// One reading. On CUDA the device counters are a readback, which itself syncs
// the host: the host counters are read before it (host_begin) and after it
// (host_end), so a delta leaves the snapshots' own syncs out.
struct CounterSnapshot {
  CounterValues values;    // host counters: as of host_begin
  CounterValues host_end;  // host counters after the snapshot's readbacks (CUDA)
};

CounterSnapshot SnapshotOf(const EngineCounters& engine);
CounterSnapshot SnapshotOf(const EngineCounters& engine, const DeviceCounters& device,
                           const HostCounters& host_begin, const HostCounters& host_end);

// after - before for every counter present in both. A counter that went
// backwards (they only grow) or is present in one snapshot only is an error
// naming it.
absl::StatusOr<CounterValues> Delta(const CounterSnapshot& before, const CounterSnapshot& after);

}  // namespace moegraph
