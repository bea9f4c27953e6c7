// The gate harness: the runner on fake gates (result lines, --only, summary and
// exit code, CUDA-only gates skipped on the CPU backend), the counter delta
// arithmetic, the assertions failing on outcomes a working engine never gives
// (an arm whose counters stayed flat, a flipped logit bit, a state that differs
// from its replay), and moegraph-gates as a user runs it.
#include "gates/gates.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gates/counters.h"
#include "gates/engines.h"
#include "gates/gate.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;
using testing_util::MessageHas;
using testing_util::ProcessResult;
using testing_util::RunProcess;

Gate FakeGate(const std::string& name, GateResult result, bool needs_cuda = false,
              int* runs = nullptr) {
  return {name, "a fake gate named " + name, needs_cuda, [result, runs](GateContext&) {
            if (runs != nullptr) ++*runs;
            return result;
          }};
}

std::vector<const Gate*> Pointers(const std::vector<Gate>& gates) {
  std::vector<const Gate*> out;
  for (const Gate& gate : gates) out.push_back(&gate);
  return out;
}

TEST(GateRunnerTest, PrintsOneLinePerGateAndTheSummaryAndFailsOnAnyFail) {
  const std::vector<Gate> gates = {FakeGate("good", Pass("it ran")),
                                   FakeGate("bad", Fail("misses did not move")),
                                   FakeGate("later", Skip("not today"))};
  GateContext context;
  std::vector<std::string> lines;
  const RunSummary summary =
      RunGates(Pointers(gates), context, [&](const std::string& line) { lines.push_back(line); });
  EXPECT_EQ(lines,
            (std::vector<std::string>{"PASS good: it ran", "FAIL bad: misses did not move",
                                      "SKIP later: not today", "1 passed, 1 failed, 1 skipped"}));
  EXPECT_EQ(summary.exit_code(), 1);

  const std::vector<Gate> fine = {FakeGate("good", Pass("ran")), FakeGate("later", Skip("no"))};
  lines.clear();
  const RunSummary ok =
      RunGates(Pointers(fine), context, [&](const std::string& line) { lines.push_back(line); });
  EXPECT_EQ(ok.exit_code(), 0);
  EXPECT_EQ(lines.back(), "1 passed, 0 failed, 1 skipped");
}

TEST(GateRunnerTest, CudaOnlyGatesSkipOnTheCpuBackendWithoutRunning) {
  int runs = 0;
  const std::vector<Gate> gates = {FakeGate("gpu", Pass("would pass"), true, &runs)};
  GateContext context;
  context.backend = Backend::kCpu;
  context.cuda_skip_reason = "needs a CUDA device";
  std::vector<std::string> lines;
  RunSummary summary =
      RunGates(Pointers(gates), context, [&](const std::string& line) { lines.push_back(line); });
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(lines.front(), "SKIP gpu: needs a CUDA device");
  EXPECT_EQ(summary.skipped, 1);

  context.backend = Backend::kCuda;
  lines.clear();
  summary =
      RunGates(Pointers(gates), context, [&](const std::string& line) { lines.push_back(line); });
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(lines.front(), "PASS gpu: would pass");
}

TEST(GateRunnerTest, OnlySelectsNamedGatesInRegistryOrderAndRejectsUnknownNames) {
  const std::vector<Gate> gates = {FakeGate("a", Pass("")), FakeGate("b", Pass("")),
                                   FakeGate("c", Pass(""))};
  absl::StatusOr<std::vector<const Gate*>> all = SelectGates(gates, "");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 3u);

  absl::StatusOr<std::vector<const Gate*>> two = SelectGates(gates, "c, a");
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0]->name, "a");
  EXPECT_EQ((*two)[1]->name, "c");

  absl::StatusOr<std::vector<const Gate*>> unknown = SelectGates(gates, "a,zz");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(MessageHas(unknown.status(), "--only")) << unknown.status();
  EXPECT_TRUE(MessageHas(unknown.status(), "'zz'")) << unknown.status();
  EXPECT_TRUE(MessageHas(unknown.status(), "a, b, c")) << unknown.status();
}

TEST(GateRunnerTest, TheRegistryHasTheIssuesGatesWithDescriptions) {
  const std::vector<Gate> gates = AllGates();
  const std::string list = ListGates(gates);
  for (const char* name : {"cache-bit-identity", "graph-eager-identity", "policy-simulation",
                           "readback-count", "door-engagement", "door-engagement-cuda",
                           "prefill-keeps-decode-set", "oracle-nmse", "anchor-replay"}) {
    EXPECT_TRUE(Contains(list, name));
  }
  for (const Gate& gate : gates) {
    EXPECT_FALSE(gate.description.empty()) << gate.name;
    const bool cuda_only = gate.name == "graph-eager-identity" || gate.name == "readback-count" ||
                           gate.name == "door-engagement-cuda" ||
                           gate.name == "prefill-keeps-decode-set";
    EXPECT_EQ(gate.needs_cuda, cuda_only) << gate.name;
  }
}

TEST(CounterDeltaTest, EngineCountersSubtractFieldByField) {
  const EngineCounters before{10, 4, 6, 2, 600};
  const EngineCounters after{15, 7, 14, 9, 1400};
  absl::StatusOr<CounterValues> d = Delta(SnapshotOf(before), SnapshotOf(after));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)[Counter::kSteps], 5u);
  EXPECT_EQ((*d)[Counter::kHits], 3u);
  EXPECT_EQ((*d)[Counter::kMisses], 8u);
  EXPECT_EQ((*d)[Counter::kEvictions], 7u);
  EXPECT_EQ((*d)[Counter::kBytesStaged], 800u);
  EXPECT_FALSE(d->has(Counter::kHostSyncs));
  EXPECT_FALSE(d->has(Counter::kPassAExperts));
}

TEST(CounterDeltaTest, HostCountersLeaveTheSnapshotsOwnReadbacksOut) {
  const EngineCounters engine{};
  DeviceCounters device_before{};
  device_before.pass_b_experts = 3;
  DeviceCounters device_after = device_before;
  device_after.pass_b_experts = 11;
  HostCounters begin{};
  begin.host_syncs = 10;
  begin.graph_launches = 4;
  HostCounters end = begin;
  end.host_syncs = 12;  // the snapshot's two readbacks
  HostCounters later = end;
  later.host_syncs = 15;  // three syncs of work
  later.graph_launches = 6;
  const CounterSnapshot before = SnapshotOf(engine, device_before, begin, end);
  const CounterSnapshot after = SnapshotOf(engine, device_after, later, later);
  absl::StatusOr<CounterValues> d = Delta(before, after);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)[Counter::kHostSyncs], 3u);
  EXPECT_EQ((*d)[Counter::kGraphLaunches], 2u);
  EXPECT_EQ((*d)[Counter::kPassBExperts], 8u);
  EXPECT_EQ((*d)[Counter::kEagerSteps], 0u);
  EXPECT_TRUE(d->has(Counter::kEagerSteps));
}

TEST(CounterDeltaTest, ACounterGoingBackwardsOrMissingOnOneSideIsAnError) {
  absl::StatusOr<CounterValues> backwards =
      Delta(SnapshotOf(EngineCounters{5, 0, 9, 0, 0}), SnapshotOf(EngineCounters{6, 0, 8, 0, 0}));
  ASSERT_FALSE(backwards.ok());
  EXPECT_TRUE(MessageHas(backwards.status(), "misses went backwards")) << backwards.status();

  const CounterSnapshot cuda =
      SnapshotOf(EngineCounters{}, DeviceCounters{}, HostCounters{}, HostCounters{});
  absl::StatusOr<CounterValues> mixed = Delta(SnapshotOf(EngineCounters{}), cuda);
  ASSERT_FALSE(mixed.ok());
  EXPECT_TRUE(MessageHas(mixed.status(), "in one snapshot only")) << mixed.status();
}

// Decodes with equal tokens and logits and the counters of arms that ran.
struct IdentityCase {
  Transcript cached;
  Transcript staged;
  CounterValues cache_delta;
  CounterValues stage_delta;
};

constexpr uint64_t kSelectedPerStep = 6;

IdentityCase WorkingArms() {
  IdentityCase c;
  c.cached.tokens = {1, 2, 3};
  c.cached.logits = {0.5f, -1.0f, 2.0f, 0.25f, 3.0f, -0.0f};
  c.staged = c.cached;
  c.cache_delta =
      Delta(SnapshotOf(EngineCounters{}), SnapshotOf(EngineCounters{3, 7, 11, 5, 0})).value();
  c.stage_delta = Delta(SnapshotOf(EngineCounters{}),
                        SnapshotOf(EngineCounters{3, 0, 3 * kSelectedPerStep, 0, 0}))
                      .value();
  return c;
}

GateResult Check(const IdentityCase& c) {
  return CheckCacheBitIdentity(c.cached, c.staged, c.cache_delta, c.stage_delta, kSelectedPerStep);
}

TEST(CacheBitIdentityCheckTest, PassesOnlyWhenEveryArmRanAndTheBitsAgree) {
  const GateResult ok = Check(WorkingArms());
  EXPECT_EQ(ok.outcome, Outcome::kPass) << ok.detail;

  // The cache arm never missed: its counters stayed flat, so the gate proves nothing.
  IdentityCase no_misses = WorkingArms();
  no_misses.cache_delta =
      Delta(SnapshotOf(EngineCounters{}), SnapshotOf(EngineCounters{3, 18, 0, 0, 0})).value();
  GateResult r = Check(no_misses);
  EXPECT_EQ(r.outcome, Outcome::kFail);
  EXPECT_TRUE(Contains(r.detail, "misses did not move"));

  IdentityCase flat = WorkingArms();
  flat.cache_delta = Delta(SnapshotOf(EngineCounters{}), SnapshotOf(EngineCounters{})).value();
  EXPECT_EQ(Check(flat).outcome, Outcome::kFail);

  // The stage arm hit: the door did not turn the cache off.
  IdentityCase stage_hit = WorkingArms();
  stage_hit.stage_delta =
      Delta(SnapshotOf(EngineCounters{}), SnapshotOf(EngineCounters{3, 2, 16, 0, 0})).value();
  r = Check(stage_hit);
  EXPECT_EQ(r.outcome, Outcome::kFail);
  EXPECT_TRUE(Contains(r.detail, "MOEGRAPH_MOE_CACHE=0"));

  // The stage arm ran no step at all.
  IdentityCase stage_idle = WorkingArms();
  stage_idle.stage_delta = flat.cache_delta;
  EXPECT_EQ(Check(stage_idle).outcome, Outcome::kFail);

  // One flipped bit in the last row (-0.0f vs 0.0f compare equal as floats).
  IdentityCase bits = WorkingArms();
  bits.staged.logits.back() = 0.0f;
  r = Check(bits);
  EXPECT_EQ(r.outcome, Outcome::kFail);
  EXPECT_TRUE(Contains(r.detail, "step 2"));

  IdentityCase tokens = WorkingArms();
  tokens.staged.tokens[1] = 9;
  EXPECT_EQ(Check(tokens).outcome, Outcome::kFail);
}

TEST(CompareResidencyTest, NamesTheFirstArrayAndIndexThatDiffer) {
  ResidencySnapshot a;
  a.table = {0, -1, 1};
  a.owner = {0, 2};
  a.stamp = {4, 7};
  a.seg = {1, 0};
  a.n_protected = {1};
  a.clock = {8};
  ResidencySnapshot b = a;
  EXPECT_TRUE(CompareResidency(a, b).ok());
  b.stamp[1] = 6;
  const absl::Status stamp = CompareResidency(a, b);
  ASSERT_FALSE(stamp.ok());
  EXPECT_TRUE(MessageHas(stamp, "stamp[1] is 7, the replay has 6")) << stamp;
  b = a;
  b.clock.push_back(1);
  EXPECT_TRUE(MessageHas(CompareResidency(a, b), "clock has 1 entries, the replay 2"));
}

TEST(NmseTest, IsZeroForEqualRowsAndScalesWithTheError) {
  const std::vector<float> want = {1.0f, -2.0f, 2.0f};
  EXPECT_EQ(Nmse(want, want), 0.0);
  EXPECT_DOUBLE_EQ(Nmse({1.0f, -2.0f, 1.0f}, want), 1.0 / 9.0);
}

TEST(GatesBinaryTest, PassesEveryCpuGateAndFailsWhenTheCacheNeverEvicts) {
  const ProcessResult run = RunProcess({MOEGRAPH_GATES_BIN, "--backend", "cpu"});
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_TRUE(Contains(run.out, "PASS cache-bit-identity: "));
  EXPECT_TRUE(Contains(run.out, "SKIP graph-eager-identity: "));
  EXPECT_TRUE(Contains(run.out, "\n5 passed, 0 failed, 4 skipped\n"));

  // Every expert fits: nothing is evicted, so the gates anchored on evictions fail.
  const ProcessResult all_fit = RunProcess({MOEGRAPH_GATES_BIN, "--backend", "cpu", "--slots", "48",
                                            "--only", "cache-bit-identity,oracle-nmse"});
  EXPECT_EQ(all_fit.exit_code, 1) << all_fit.out << all_fit.err;
  EXPECT_TRUE(Contains(all_fit.out, "FAIL cache-bit-identity: arm cache: evictions did not move"));
  EXPECT_TRUE(Contains(all_fit.out, "PASS oracle-nmse: "));
  EXPECT_TRUE(Contains(all_fit.out, "1 passed, 1 failed, 0 skipped"));
}

TEST(GatesBinaryTest, UsageErrorsExitTwoNamingTheFlag) {
  const ProcessResult unknown = RunProcess({MOEGRAPH_GATES_BIN, "--only", "nope"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_TRUE(Contains(unknown.err, "--only: no gate named 'nope'"));
  const ProcessResult backend = RunProcess({MOEGRAPH_GATES_BIN, "--backend", "tpu"});
  EXPECT_EQ(backend.exit_code, 2);
  EXPECT_TRUE(Contains(backend.err, "--backend 'tpu'"));
  const ProcessResult list = RunProcess({MOEGRAPH_GATES_BIN, "--list"});
  EXPECT_EQ(list.exit_code, 0);
  EXPECT_TRUE(Contains(list.out, "anchor-replay"));
  for (const char* help : {"-h", "--help"}) {
    const ProcessResult r = RunProcess({MOEGRAPH_GATES_BIN, help});
    EXPECT_EQ(r.exit_code, 0) << help << ": " << r.err;
    EXPECT_TRUE(Contains(r.out, "usage: moegraph-gates")) << r.out;
    EXPECT_TRUE(Contains(r.out, "  --only NAME[,NAME...]\n")) << r.out;
  }
}

}  // namespace
}  // namespace moegraph
