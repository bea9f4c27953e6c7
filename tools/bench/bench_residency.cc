// Host residency throughput on synthetic Qwen3-30B-A3B-shaped traces (48 layers,
// 128 experts, top-8) with a 1536-slot global pool (a quarter of the 6144 keys):
// - BM_PolicyStep: one policy stepping every row of a 1,000-token trace, in
//   layer-steps per second (what the CPU backend and the host arm pay per layer);
// - BM_SimulateTrace: the whole simulator on a 10,000-token trace, validation and
//   OPT's next-use table included, as `moegraph simulate` runs it.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "residency/simulator.h"
#include "residency/trace.h"
#include "residency/trace_synth.h"

namespace moegraph {
namespace {

constexpr int32_t kSlots = 1536;

// Synthesized once per length and kept for the whole run.
const RoutingTrace* SynthTrace(int64_t n_steps) {
  SynthSpec spec;
  spec.n_steps = n_steps;
  spec.seed = 11;
  absl::StatusOr<RoutingTrace> trace = SynthesizeTrace(spec);
  return trace.ok() ? new RoutingTrace(*std::move(trace)) : nullptr;
}

int64_t PresentRows(const RoutingTrace& trace) {
  int64_t rows = 0;
  for (int64_t step = 0; step < trace.n_steps; ++step) {
    for (int32_t layer = 0; layer < trace.n_layer; ++layer) rows += trace.present(step, layer);
  }
  return rows;
}

void BM_PolicyStep(benchmark::State& state, std::string policy) {
  static const RoutingTrace* trace = SynthTrace(1000);
  if (trace == nullptr) {
    state.SkipWithError("SynthesizeTrace failed");
    return;
  }
  absl::StatusOr<SimTrace> sim = SimTrace::Create(*trace);
  if (!sim.ok()) {
    state.SkipWithError(std::string(sim.status().message()).c_str());
    return;
  }
  sim->next_use();  // OPT's table is a per-trace cost, not a per-step one
  const SimConfig config{policy, kSlots, PoolMode::kGlobal, kDefaultProtectedFrac};
  int64_t hits = 0;
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<SimPolicy>> sim_policy = MakeSimPolicy(*sim, config);
    if (!sim_policy.ok()) {
      state.SkipWithError(std::string(sim_policy.status().message()).c_str());
      return;
    }
    for (int64_t step = 0; step < trace->n_steps; ++step) {
      for (int32_t layer = 0; layer < trace->n_layer; ++layer) {
        if (trace->present(step, layer)) {
          hits += (*sim_policy)->Step(step, layer, trace->row(step, layer)).hits;
        }
      }
    }
  }
  benchmark::DoNotOptimize(hits);
  state.SetItemsProcessed(state.iterations() * PresentRows(*trace));
}

void BM_SimulateTrace(benchmark::State& state, std::string policy) {
  static const RoutingTrace* trace = SynthTrace(10000);
  if (trace == nullptr) {
    state.SkipWithError("SynthesizeTrace failed");
    return;
  }
  const SimConfig config{policy, kSlots, PoolMode::kGlobal, kDefaultProtectedFrac};
  double hit_rate = 0;
  for (auto _ : state) {
    absl::StatusOr<SimTrace> sim = SimTrace::Create(*trace);
    absl::StatusOr<SimResult> result =
        sim.ok() ? Simulate(*sim, config) : absl::StatusOr<SimResult>(sim.status());
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    hit_rate = result->hit_rate();
  }
  state.SetItemsProcessed(state.iterations() * PresentRows(*trace));
  state.counters["hit_%"] = 100.0 * hit_rate;
}

BENCHMARK_CAPTURE(BM_PolicyStep, lru, "lru")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PolicyStep, slru, "slru")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PolicyStep, default, "default")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PolicyStep, opt, "opt")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SimulateTrace, lru, "lru")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SimulateTrace, slru, "slru")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SimulateTrace, default, "default")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SimulateTrace, opt, "opt")->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph
