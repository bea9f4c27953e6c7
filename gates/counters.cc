#include "gates/counters.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

constexpr std::array<std::string_view, kCounterCount> kNames = {
    "steps",
    "hits",
    "misses",
    "evictions",
    "bytes_staged",
    "device.hits",
    "device.misses",
    "device.evictions",
    "device.bytes_staged",
    "device.pass_a_experts",
    "device.pass_b_experts",
    "device.copy_waits",
    "device.chained_launches",
    "device.steps",
    "host.graph_launches",
    "host.captures",
    "host.eager_steps",
    "host.host_syncs",
    "host.h2d_memcpys",
    "host.programmatic_launches",
    "host.prompt_steps",
    "host.prefill_tokens",
    "host.prefill_experts_in_place",
    "host.prefill_experts_streamed",
    "host.prefill_bytes_streamed",
};

bool IsHostCounter(Counter c) { return c >= Counter::kGraphLaunches; }

void SetEngine(const EngineCounters& e, CounterValues& v) {
  v.Set(Counter::kSteps, e.steps);
  v.Set(Counter::kHits, e.hits);
  v.Set(Counter::kMisses, e.misses);
  v.Set(Counter::kEvictions, e.evictions);
  v.Set(Counter::kBytesStaged, e.bytes_staged);
}

void SetHost(const HostCounters& h, CounterValues& v) {
  v.Set(Counter::kGraphLaunches, h.graph_launches);
  v.Set(Counter::kCaptures, h.captures);
  v.Set(Counter::kEagerSteps, h.eager_steps);
  v.Set(Counter::kHostSyncs, h.host_syncs);
  v.Set(Counter::kH2dMemcpys, h.h2d_memcpys);
  v.Set(Counter::kProgrammaticLaunches, h.programmatic_launches);
  v.Set(Counter::kPromptSteps, h.prompt_steps);
  v.Set(Counter::kPrefillTokens, h.prefill_tokens);
  v.Set(Counter::kPrefillExpertsInPlace, h.prefill_experts_in_place);
  v.Set(Counter::kPrefillExpertsStreamed, h.prefill_experts_streamed);
  v.Set(Counter::kPrefillBytesStreamed, h.prefill_bytes_streamed);
}

}  // namespace

std::string_view CounterName(Counter counter) { return kNames[static_cast<size_t>(counter)]; }

void CounterValues::Set(Counter c, uint64_t value) {
  values_[Index(c)] = value;
  present_[Index(c)] = true;
}

CounterSnapshot SnapshotOf(const EngineCounters& engine) {
  CounterSnapshot s;
  SetEngine(engine, s.values);
  return s;
}

CounterSnapshot SnapshotOf(const EngineCounters& engine, const DeviceCounters& device,
                           const HostCounters& host_begin, const HostCounters& host_end) {
  CounterSnapshot s;
  SetEngine(engine, s.values);
  s.values.Set(Counter::kDeviceHits, device.hits);
  s.values.Set(Counter::kDeviceMisses, device.misses);
  s.values.Set(Counter::kDeviceEvictions, device.evictions);
  s.values.Set(Counter::kDeviceBytesStaged, device.bytes_staged);
  s.values.Set(Counter::kPassAExperts, device.pass_a_experts);
  s.values.Set(Counter::kPassBExperts, device.pass_b_experts);
  s.values.Set(Counter::kCopyWaits, device.copy_waits);
  s.values.Set(Counter::kChainedLaunches, device.chained_launches);
  s.values.Set(Counter::kDeviceSteps, device.steps);
  SetHost(host_begin, s.values);
  SetHost(host_end, s.host_end);
  return s;
}

absl::StatusOr<CounterValues> Delta(const CounterSnapshot& before, const CounterSnapshot& after) {
  CounterValues delta;
  for (size_t i = 0; i < kCounterCount; ++i) {
    const Counter c = static_cast<Counter>(i);
    // Host counters start from where the earlier snapshot's own readbacks left them.
    const CounterValues& start = IsHostCounter(c) ? before.host_end : before.values;
    if (!start.has(c) && !after.values.has(c)) continue;
    if (start.has(c) != after.values.has(c)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("counter %s is in one snapshot only", Av(CounterName(c))));
    }
    if (after.values[c] < start[c]) {
      return absl::InternalError(absl::StrFormat("counter %s went backwards: %d, then %d",
                                                 Av(CounterName(c)), start[c], after.values[c]));
    }
    delta.Set(c, after.values[c] - start[c]);
  }
  return delta;
}

}  // namespace moegraph
