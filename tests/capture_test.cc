// The doors (pure resolution from --arm and an environment) and the decode walk
// as data: its order per layer, where host syncs and device-to-host copies may
// appear, fork/join pairing around the staged slots, and S-step repetition. No
// device is needed: the walk is checked as a list, and run with fake callables.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "capture/doors.h"
#include "capture/walk.h"
#include "residency/simulator.h"

namespace moegraph {
namespace {

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  return [vars](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

ResolvedDoors Resolve(std::optional<Arm> arm, std::map<std::string, std::string> vars = {}) {
  absl::StatusOr<ResolvedDoors> r = ResolveDoors(arm, FakeEnv(std::move(vars)));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ResolvedDoors();
}

TEST(DoorsTest, DefaultsAreTheGraphArmWithHazard) {
  const ResolvedDoors r = Resolve(std::nullopt);
  EXPECT_EQ(r.arm, Arm::kGraph);
  EXPECT_TRUE(r.doors.graph);
  EXPECT_TRUE(r.doors.moe_cache);
  EXPECT_FALSE(r.doors.split_passes);
  EXPECT_TRUE(r.doors.programmatic_launch);
  EXPECT_TRUE(r.doors.batched_prefill);
  EXPECT_TRUE(r.doors.batch_matmul);
  EXPECT_TRUE(r.doors.amx);
  EXPECT_TRUE(r.doors.read_overlap);
  EXPECT_TRUE(r.doors.chained_matvecs);
  EXPECT_FALSE(r.doors.resident);
  EXPECT_EQ(r.doors.residency, ResidencyMode::kDevice);
  EXPECT_EQ(r.doors.policy, ResidencyPolicy::kHazard);
  EXPECT_DOUBLE_EQ(r.doors.protected_frac, kDefaultProtectedFrac);
  for (const char* door :
       {"MOEGRAPH_GRAPH=1 (default)", "MOEGRAPH_MOE_CACHE=1 (default)",
        "MOEGRAPH_RESIDENCY=device (default)", "MOEGRAPH_POLICY=hazard (default)",
        "MOEGRAPH_PROTECTED_FRAC=0.80 (default)", "MOEGRAPH_SPLIT_PASSES=0 (default)",
        "MOEGRAPH_CHAIN=1 (default)", "MOEGRAPH_PDL=1 (default)", "MOEGRAPH_PREFILL=batched (default)",
        "MOEGRAPH_BATCH_MATMUL=1 (default)", "MOEGRAPH_AMX=1 (default)",
        "MOEGRAPH_READ_OVERLAP=1 (default)"}) {
    EXPECT_NE(r.banner.find(door), std::string::npos) << door << "\n" << r.banner;
  }
}

TEST(DoorsTest, EachArmSetsItsDoors) {
  const ResolvedDoors resident = Resolve(Arm::kResident);
  EXPECT_EQ(resident.arm, Arm::kResident);
  EXPECT_TRUE(resident.doors.resident);
  EXPECT_TRUE(resident.doors.graph);

  const ResolvedDoors eager = Resolve(Arm::kEager);
  EXPECT_EQ(eager.arm, Arm::kEager);
  EXPECT_FALSE(eager.doors.graph);
  EXPECT_NE(eager.banner.find("MOEGRAPH_GRAPH=0 (--arm)"), std::string::npos) << eager.banner;

  const ResolvedDoors host = Resolve(Arm::kHost);
  EXPECT_EQ(host.arm, Arm::kHost);
  EXPECT_EQ(host.doors.residency, ResidencyMode::kHost);
  EXPECT_FALSE(host.doors.graph);

  const ResolvedDoors stage = Resolve(Arm::kStage);
  EXPECT_EQ(stage.arm, Arm::kStage);
  EXPECT_FALSE(stage.doors.moe_cache);

  EXPECT_EQ(Resolve(Arm::kGraph).arm, Arm::kGraph);
}

TEST(DoorsTest, AVariableSetInTheEnvironmentWinsOverTheArmAndTheBannerSaysSo) {
  const ResolvedDoors r = Resolve(Arm::kGraph, {{"MOEGRAPH_GRAPH", "0"}});
  EXPECT_EQ(r.arm, Arm::kEager);
  EXPECT_NE(r.banner.find("MOEGRAPH_GRAPH=0 (env)"), std::string::npos) << r.banner;
  EXPECT_NE(r.banner.find("MOEGRAPH_GRAPH=0 from the environment overrides --arm graph"),
            std::string::npos)
      << r.banner;

  // The cache door from the environment beats --arm host and --arm resident.
  EXPECT_EQ(Resolve(Arm::kHost, {{"MOEGRAPH_MOE_CACHE", "0"}}).arm, Arm::kStage);
  EXPECT_EQ(Resolve(Arm::kResident, {{"MOEGRAPH_MOE_CACHE", "0"}}).arm, Arm::kStage);
  // Host residency from the environment beats --arm stage, and runs eager.
  const ResolvedDoors host = Resolve(Arm::kStage, {{"MOEGRAPH_RESIDENCY", "host"}});
  EXPECT_EQ(host.arm, Arm::kHost);
  EXPECT_TRUE(host.doors.moe_cache);
  EXPECT_FALSE(host.doors.graph);
  EXPECT_NE(host.banner.find("overrides --arm stage"), std::string::npos) << host.banner;
  // MOEGRAPH_GRAPH=1 beats --arm host: the device policy in a graph.
  const ResolvedDoors graph = Resolve(Arm::kHost, {{"MOEGRAPH_GRAPH", "1"}});
  EXPECT_EQ(graph.arm, Arm::kGraph);
  EXPECT_EQ(graph.doors.residency, ResidencyMode::kDevice);
  // Without --arm, the environment alone picks the arm.
  const ResolvedDoors env_host = Resolve(std::nullopt, {{"MOEGRAPH_RESIDENCY", "host"}});
  EXPECT_EQ(env_host.arm, Arm::kHost);
  EXPECT_FALSE(env_host.doors.graph);
  EXPECT_NE(env_host.banner.find("implies MOEGRAPH_GRAPH=0"), std::string::npos)
      << env_host.banner;
}

TEST(DoorsTest, PolicyFractionPassesAndPdlComeFromTheEnvironment) {
  const ResolvedDoors r = Resolve(std::nullopt, {{"MOEGRAPH_POLICY", "lru"},
                                                 {"MOEGRAPH_PROTECTED_FRAC", "0.5"},
                                                 {"MOEGRAPH_SPLIT_PASSES", "1"},
                                                 {"MOEGRAPH_CHAIN", "0"},
                                                 {"MOEGRAPH_PDL", "0"},
                                                 {"MOEGRAPH_PREFILL", "steps"},
                                                 {"MOEGRAPH_BATCH_MATMUL", "0"},
                                                 {"MOEGRAPH_AMX", "0"},
                                                 {"MOEGRAPH_READ_OVERLAP", "0"}});
  EXPECT_EQ(r.doors.policy, ResidencyPolicy::kLru);
  EXPECT_DOUBLE_EQ(r.doors.protected_frac, 0.5);
  EXPECT_TRUE(r.doors.split_passes);
  EXPECT_FALSE(r.doors.chained_matvecs);
  EXPECT_NE(r.banner.find("MOEGRAPH_CHAIN=0 (env)"), std::string::npos) << r.banner;
  EXPECT_FALSE(r.doors.programmatic_launch);
  EXPECT_NE(r.banner.find("MOEGRAPH_PDL=0 (env)"), std::string::npos) << r.banner;
  EXPECT_FALSE(r.doors.batched_prefill);
  EXPECT_NE(r.banner.find("MOEGRAPH_PREFILL=steps (env)"), std::string::npos) << r.banner;
  EXPECT_FALSE(r.doors.batch_matmul);
  EXPECT_NE(r.banner.find("MOEGRAPH_BATCH_MATMUL=0 (env)"), std::string::npos) << r.banner;
  EXPECT_FALSE(r.doors.amx);
  EXPECT_NE(r.banner.find("MOEGRAPH_AMX=0 (env)"), std::string::npos) << r.banner;
  EXPECT_FALSE(r.doors.read_overlap);
  EXPECT_NE(r.banner.find("MOEGRAPH_READ_OVERLAP=0 (env)"), std::string::npos) << r.banner;
  EXPECT_NE(r.banner.find("MOEGRAPH_POLICY=lru (env)"), std::string::npos) << r.banner;

  const ResolvedDoors slru = Resolve(std::nullopt, {{"MOEGRAPH_POLICY", "slru"},
                                                    {"MOEGRAPH_PROTECTED_FRAC", "0.25"}});
  EXPECT_EQ(slru.doors.policy, ResidencyPolicy::kSlru);
  EXPECT_DOUBLE_EQ(slru.doors.protected_frac, 0.25);
}

TEST(DoorsTest, BadValuesAndContradictionsNameTheVariables) {
  const std::vector<std::pair<std::string, std::string>> bad = {{"MOEGRAPH_GRAPH", "yes"},
                                                                {"MOEGRAPH_MOE_CACHE", "2"},
                                                                {"MOEGRAPH_RESIDENCY", "gpu"},
                                                                {"MOEGRAPH_POLICY", "opt"},
                                                                {"MOEGRAPH_PROTECTED_FRAC", "1.0"},
                                                                {"MOEGRAPH_PROTECTED_FRAC", "-0.1"},
                                                                {"MOEGRAPH_PROTECTED_FRAC", "x"},
                                                                {"MOEGRAPH_SPLIT_PASSES", "true"},
                                                                {"MOEGRAPH_PDL", "on"},
                                                                {"MOEGRAPH_PREFILL", "1"},
                                                                {"MOEGRAPH_BATCH_MATMUL", "on"},
                                                                {"MOEGRAPH_AMX", "yes"}};
  for (const auto& [name, value] : bad) {
    absl::StatusOr<ResolvedDoors> r = ResolveDoors(std::nullopt, FakeEnv({{name, value}}));
    ASSERT_FALSE(r.ok()) << name << "=" << value;
    EXPECT_NE(std::string(r.status().message()).find(name + "='" + value + "'"),
              std::string::npos)
        << r.status();
  }
  absl::StatusOr<ResolvedDoors> both =
      ResolveDoors(std::nullopt, FakeEnv({{"MOEGRAPH_RESIDENCY", "host"},
                                          {"MOEGRAPH_GRAPH", "1"}}));
  ASSERT_FALSE(both.ok());
  EXPECT_NE(std::string(both.status().message()).find("MOEGRAPH_GRAPH=1"), std::string::npos);
  EXPECT_NE(std::string(both.status().message()).find("MOEGRAPH_RESIDENCY=host"),
            std::string::npos);
  absl::StatusOr<ResolvedDoors> cache =
      ResolveDoors(std::nullopt, FakeEnv({{"MOEGRAPH_RESIDENCY", "host"},
                                          {"MOEGRAPH_MOE_CACHE", "0"}}));
  ASSERT_FALSE(cache.ok());
  EXPECT_NE(std::string(cache.status().message()).find("MOEGRAPH_MOE_CACHE=0"),
            std::string::npos);

  absl::StatusOr<Arm> arm = ParseArm("gpu");
  ASSERT_FALSE(arm.ok());
  EXPECT_NE(std::string(arm.status().message()).find("--arm 'gpu'"), std::string::npos);
  for (Arm a : {Arm::kResident, Arm::kGraph, Arm::kEager, Arm::kHost, Arm::kStage}) {
    absl::StatusOr<Arm> parsed = ParseArm(ArmName(a));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, a);
  }
}

TEST(DoorsTest, TheProcessEnvironmentTreatsAnEmptyValueAsUnset) {
  ASSERT_EQ(setenv("MOEGRAPH_TEST_DOOR", "", 1), 0);
  EXPECT_FALSE(ProcessEnv()("MOEGRAPH_TEST_DOOR").has_value());
  ASSERT_EQ(setenv("MOEGRAPH_TEST_DOOR", "0", 1), 0);
  EXPECT_EQ(ProcessEnv()("MOEGRAPH_TEST_DOOR"), std::optional<std::string>("0"));
  unsetenv("MOEGRAPH_TEST_DOOR");
  EXPECT_FALSE(ProcessEnv()("MOEGRAPH_TEST_DOOR").has_value());
}

// ---- the walk ----

std::vector<StepOp> OpsOf(const StepWalk& walk, int step, int layer) {
  std::vector<StepOp> ops;
  for (const WalkEntry& e : walk.entries) {
    if (e.step == step && e.layer == layer) ops.push_back(e.op);
  }
  return ops;
}

WalkConfig Config(SlotMode mode, int n_layer = 3, int steps = 1) {
  WalkConfig c;
  c.n_layer = n_layer;
  c.steps = steps;
  c.slot_mode = mode;
  return c;
}

TEST(WalkTest, ALayerOfTheDevicePolicyArmRunsInTheDesignsOrder) {
  WalkConfig c = Config(SlotMode::kDevicePolicy);
  const StepWalk walk = BuildWalk(c);
  using O = StepOp;
  const std::vector<StepOp> want = {O::kQkv,           O::kAttention, O::kAttnOut,
                                    O::kRouter,        O::kResidencyStep, O::kStageCopy,
                                    O::kGateUpReady,   O::kDownReady};
  for (int layer = 0; layer < c.n_layer; ++layer) EXPECT_EQ(OpsOf(walk, 0, layer), want);
  // The copy runs on the main stream, right before the pass that waits for it.
  for (const WalkEntry& e : walk.entries) EXPECT_EQ(e.stream, WalkStream::kMain) << EntryLabel(e);
  EXPECT_EQ(OpsOf(walk, 0, -1),
            (std::vector<StepOp>{O::kEmbed, O::kLmHead, O::kSample, O::kTokenCopy}));
  // Layers follow each other: the step starts with embed and ends with the token.
  EXPECT_EQ(walk.entries.front().op, StepOp::kEmbed);
  EXPECT_EQ(walk.entries.back().op, StepOp::kTokenCopy);
  int last_layer = -1;
  for (const WalkEntry& e : walk.entries) {
    if (e.layer < 0) continue;
    EXPECT_GE(e.layer, last_layer);
    last_layer = e.layer;
  }
  // Split passes: the copy on the copy stream, hits before the join.
  c.split_passes = true;
  EXPECT_EQ(OpsOf(BuildWalk(c), 0, 1),
            (std::vector<StepOp>{O::kQkv, O::kAttention, O::kAttnOut, O::kRouter,
                                 O::kResidencyStep, O::kForkRecord, O::kForkWait, O::kStageCopy,
                                 O::kJoinRecord, O::kGateUpHits, O::kDownHits, O::kJoinWait,
                                 O::kGateUpMisses, O::kDownMisses}));
}

TEST(WalkTest, SharedExpertRunsBeforeTheCopyOrOverlapsItWhenSplit) {
  WalkConfig c = Config(SlotMode::kDevicePolicy, 1);
  c.shared_expert = true;
  c.shared_expert_gated = true;
  using O = StepOp;
  // The one pass must follow the copy directly (it starts without waiting for
  // the kernel before it), so the shared expert runs before the copy.
  EXPECT_EQ(OpsOf(BuildWalk(c), 0, 0),
            (std::vector<StepOp>{O::kQkv, O::kAttention, O::kAttnOut, O::kRouter, O::kResidencyStep,
                                 O::kShexpGateUp, O::kShexpDown, O::kShexpLogit, O::kStageCopy,
                                 O::kGateUpReady, O::kDownReady}));
  // glm4moe's shared expert has no gate: no logit.
  c.shared_expert_gated = false;
  EXPECT_EQ(OpsOf(BuildWalk(c), 0, 0),
            (std::vector<StepOp>{O::kQkv, O::kAttention, O::kAttnOut, O::kRouter, O::kResidencyStep,
                                 O::kShexpGateUp, O::kShexpDown, O::kStageCopy, O::kGateUpReady,
                                 O::kDownReady}));
  c.split_passes = true;
  EXPECT_EQ(OpsOf(BuildWalk(c), 0, 0),
            (std::vector<StepOp>{O::kQkv, O::kAttention, O::kAttnOut, O::kRouter, O::kResidencyStep,
                                 O::kForkRecord, O::kForkWait, O::kStageCopy, O::kJoinRecord,
                                 O::kGateUpHits, O::kDownHits, O::kShexpGateUp, O::kShexpDown,
                                 O::kJoinWait, O::kGateUpMisses, O::kDownMisses}));
}

// A shared expert that rides the expert passes (rank k) has no gate/up or down
// launch of its own, and one whose gate is the router's last row no logit
// launch: a MoE layer of qwen35moe has 6 kernel nodes resident and 8 on the
// graph arm, where it had 9 and 11.
TEST(WalkTest, ASharedExpertInTheExpertPassesAndItsGateInTheRouterHaveNoLaunches) {
  using O = StepOp;
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kResident, SlotMode::kHostPolicy}) {
    for (bool split : {false, true}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(mode)) + (split ? " split" : ""));
      WalkConfig c = Config(mode, 2);
      c.split_passes = split;
      c.shared_expert = c.shared_expert_gated = true;
      const StepWalk own = BuildWalk(c);
      c.shared_expert_in_passes = {true, false};
      const StepWalk in_passes = BuildWalk(c);
      c.shared_gate_in_router = {true, false};
      const StepWalk folded = BuildWalk(c);
      std::vector<StepOp> want = OpsOf(own, 0, 0);
      std::erase_if(want, [](StepOp op) { return op == O::kShexpGateUp || op == O::kShexpDown; });
      EXPECT_EQ(OpsOf(in_passes, 0, 0), want);
      std::erase(want, O::kShexpLogit);
      EXPECT_EQ(OpsOf(folded, 0, 0), want);
      EXPECT_EQ(KernelsInLayer(folded, 0), KernelsInLayer(own, 0) - 3);
      EXPECT_EQ(OpsOf(folded, 0, 1), OpsOf(own, 0, 1));
      if (mode == SlotMode::kResident) EXPECT_EQ(KernelsInLayer(folded, 0), 6);
      if (mode == SlotMode::kDevicePolicy && !split) EXPECT_EQ(KernelsInLayer(folded, 0), 8);
    }
  }
}

// glm4moe's leading dense layers: attention, then the dense FFN's two launches,
// no routing and nothing on the copy stream; the MoE layers after them as ever.
TEST(WalkTest, ADenseLeadingLayerRunsItsFfnAndNoExperts) {
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kResident, SlotMode::kHostPolicy}) {
    WalkConfig c = Config(mode, 3);
    c.n_dense_lead = 1;
    const StepWalk walk = BuildWalk(c);
    using O = StepOp;
    EXPECT_EQ(OpsOf(walk, 0, 0), (std::vector<StepOp>{O::kQkv, O::kAttention, O::kAttnOut,
                                                      O::kDenseGateUp, O::kDenseDown}));
    EXPECT_EQ(KernelsInLayer(walk, 0), 5);
    const StepWalk moe = BuildWalk(Config(mode, 3));
    for (int layer = 1; layer < 3; ++layer) EXPECT_EQ(OpsOf(walk, 0, layer), OpsOf(moe, 0, layer));
  }
}

// qwen35moe: a Gated DeltaNet layer's mixer is its projections' one launch and
// the mixer's (the state never leaves the device), then attn_out as attention's;
// so every layer, either kind, has the same kernel nodes, and the rest of the
// layer is unchanged. Qwen3.5-35B-A3B's plan: three DeltaNet layers, then one
// gated attention layer.
TEST(WalkTest, AGatedDeltaNetLayerRunsItsMixerInTwoLaunchesThenAttnOut) {
  using M = LayerMixer;
  using O = StepOp;
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kResident, SlotMode::kHostPolicy}) {
    WalkConfig c = Config(mode, 8);
    c.shared_expert = c.shared_expert_gated = true;
    const StepWalk attention = BuildWalk(c);
    for (int il = 0; il < 8; ++il) {
      c.mixers.push_back(il % 4 == 3 ? M::kGatedAttention : M::kDeltaNet);
    }
    const StepWalk walk = BuildWalk(c);
    for (int il = 0; il < 8; ++il) {
      SCOPED_TRACE(il);
      std::vector<StepOp> ops = OpsOf(walk, 0, il);
      std::vector<StepOp> want = OpsOf(attention, 0, il);
      if (il % 4 != 3) {
        ASSERT_EQ(std::vector<StepOp>(want.begin(), want.begin() + 2),
                  (std::vector<StepOp>{O::kQkv, O::kAttention}));
        want[0] = O::kDeltaNetProj;
        want[1] = O::kDeltaNetMix;
      }
      EXPECT_EQ(ops, want);
      EXPECT_EQ(KernelsInLayer(walk, il), KernelsInLayer(attention, il));
    }
  }
}

TEST(WalkTest, ArmsChangeOnlyTheSlotDecisionAndThePasses) {
  using O = StepOp;
  const std::vector<StepOp> resident = OpsOf(BuildWalk(Config(SlotMode::kResident)), 0, 1);
  const std::vector<StepOp> resident_tail(resident.end() - 3, resident.end());
  EXPECT_EQ(resident_tail, (std::vector<StepOp>{O::kRouter, O::kGateUpAll, O::kDownAll}));
  for (StepOp op : resident) {
    EXPECT_NE(StepOpStream(op), WalkStream::kCopy) << StepOpName(op);
    EXPECT_NE(StepOpKind(op), EntryKind::kEventRecord) << StepOpName(op);
  }

  const std::vector<StepOp> stage = OpsOf(BuildWalk(Config(SlotMode::kStageAll)), 0, 1);
  const std::vector<StepOp> stage_tail(stage.end() - 4, stage.end());
  EXPECT_EQ(stage_tail, (std::vector<StepOp>{O::kStageAllSlots, O::kStageCopy, O::kGateUpReady,
                                             O::kDownReady}));

  // The host arm's copies set no flags: its one pass runs after the join.
  WalkConfig host_config = Config(SlotMode::kHostPolicy);
  const std::vector<StepOp> host = OpsOf(BuildWalk(host_config), 0, 1);
  const std::vector<StepOp> host_tail(host.end() - 11, host.end());
  EXPECT_EQ(host_tail,
            (std::vector<StepOp>{O::kHostReadSelection, O::kHostWaitSelection, O::kHostPolicyStep,
                                 O::kHostWriteSlots, O::kForkRecord, O::kForkWait,
                                 O::kHostStageCopy, O::kJoinRecord, O::kJoinWait, O::kGateUpAll,
                                 O::kDownAll}));
  host_config.split_passes = true;
  const std::vector<StepOp> host_split = OpsOf(BuildWalk(host_config), 0, 1);
  const std::vector<StepOp> host_split_tail(host_split.end() - 6, host_split.end());
  EXPECT_EQ(host_split_tail,
            (std::vector<StepOp>{O::kJoinRecord, O::kGateUpHits, O::kDownHits, O::kJoinWait,
                                 O::kGateUpMisses, O::kDownMisses}));
}

// The node count a captured graph has per layer, per arm (qwen3moe's shape):
// the norms, QK-norm, RoPE, the KV append, the attention merge, top-k and the
// combine are epilogues of the ops before them, and q/k/v one launch (24 on the
// device arm at first, 20 before the epilogues).
TEST(WalkTest, KernelLaunchesPerLayerOfEachArm) {
  struct Want {
    SlotMode mode;
    bool split;
    int kernels;
  };
  // The host arm's copies are cudaMemcpyAsync calls, not kernels.
  for (const Want& want :
       {Want{SlotMode::kDevicePolicy, false, 8}, Want{SlotMode::kResident, false, 6},
        Want{SlotMode::kStageAll, false, 8}, Want{SlotMode::kHostPolicy, false, 6},
        Want{SlotMode::kDevicePolicy, true, 10}, Want{SlotMode::kHostPolicy, true, 8}}) {
    WalkConfig c = Config(want.mode);
    c.split_passes = want.split;
    const StepWalk walk = BuildWalk(c);
    for (int layer = 0; layer < c.n_layer; ++layer) {
      EXPECT_EQ(KernelsInLayer(walk, layer), want.kernels)
          << "mode " << static_cast<int>(want.mode) << " split " << want.split;
    }
  }
}

// MOEGRAPH_CHAIN: a MoE layer's attn_out and router are one launch, and so is
// every one pass over all ranks (the resident arm's, the device arms' after
// the stage copy, the host arm's after the join), each in its pair's place;
// split passes and a dense layer keep theirs. qwen3moe's layer: 4 kernel nodes
// resident, 6 on the graph arm.
TEST(WalkTest, ChainedLaunchesTakeTheirPairsPlaces) {
  using O = StepOp;
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kResident, SlotMode::kStageAll,
                        SlotMode::kHostPolicy}) {
    for (bool split : {false, true}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(mode)) + (split ? " split" : ""));
      WalkConfig c = Config(mode, 2);
      c.split_passes = split;
      c.n_dense_lead = 1;
      const StepWalk pairs = BuildWalk(c);
      c.chained_matvecs = true;
      const StepWalk chained = BuildWalk(c);
      EXPECT_EQ(OpsOf(chained, 0, 0), OpsOf(pairs, 0, 0));  // the dense layer
      std::vector<StepOp> want;
      for (StepOp op : OpsOf(pairs, 0, 1)) {
        if (op == O::kAttnOut) want.push_back(O::kAttnOutRouter);
        if (op == O::kGateUpAll) want.push_back(O::kExpertFfnAll);
        if (op == O::kGateUpReady) want.push_back(O::kExpertFfnReady);
        if (op != O::kAttnOut && op != O::kRouter && op != O::kGateUpAll && op != O::kDownAll &&
            op != O::kGateUpReady && op != O::kDownReady) {
          want.push_back(op);
        }
      }
      EXPECT_EQ(OpsOf(chained, 0, 1), want);
      const bool one_pass = !split || mode == SlotMode::kResident || mode == SlotMode::kStageAll;
      EXPECT_EQ(KernelsInLayer(chained, 1), KernelsInLayer(pairs, 1) - (one_pass ? 2 : 1));
      if (mode == SlotMode::kResident) EXPECT_EQ(KernelsInLayer(chained, 1), 4);
      if (mode == SlotMode::kDevicePolicy && !split) EXPECT_EQ(KernelsInLayer(chained, 1), 6);
    }
  }
}

TEST(WalkTest, OnlyTheTokenLeavesTheDeviceAndOnlyTheHostArmSyncs) {
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kResident, SlotMode::kStageAll,
                        SlotMode::kHostPolicy}) {
    for (int steps : {1, 4}) {
      WalkConfig c = Config(mode, 3, steps);
      c.shared_expert = true;
      const StepWalk walk = BuildWalk(c);
      int syncs = 0;
      int token_copies = 0;
      for (size_t i = 0; i < walk.entries.size(); ++i) {
        const WalkEntry& e = walk.entries[i];
        if (e.kind == EntryKind::kHostSync) {
          ++syncs;
          EXPECT_EQ(mode, SlotMode::kHostPolicy) << EntryLabel(e);
        }
        if (e.kind == EntryKind::kHostWork || e.kind == EntryKind::kMemcpyH2D) {
          EXPECT_EQ(mode, SlotMode::kHostPolicy) << EntryLabel(e);
        }
        if (e.kind != EntryKind::kMemcpyD2H) continue;
        if (e.op == StepOp::kTokenCopy) {
          ++token_copies;
          EXPECT_EQ(i, walk.entries.size() - 1) << "the token copy ends the walk";
        } else {
          EXPECT_EQ(mode, SlotMode::kHostPolicy) << EntryLabel(e);
          EXPECT_EQ(e.op, StepOp::kHostReadSelection);
        }
      }
      EXPECT_EQ(token_copies, 1);
      // The host arm: one sync per MoE layer per step (the token's is the runner's).
      EXPECT_EQ(syncs, mode == SlotMode::kHostPolicy ? 3 * steps : 0);
    }
  }
}

TEST(WalkTest, EveryForkJoinsBeforeAnyReadOfTheStagedSlots) {
  for (SlotMode mode : {SlotMode::kDevicePolicy, SlotMode::kStageAll, SlotMode::kHostPolicy}) {
    for (bool split : {true, false}) {
      WalkConfig c = Config(mode, 2, 2);
      c.split_passes = split;
      c.shared_expert = true;
      const StepWalk walk = BuildWalk(c);
      for (int step = 0; step < 2; ++step) {
        for (int layer = 0; layer < 2; ++layer) {
          std::map<StepOp, int> at;  // index in the walk of each op of this layer
          std::vector<StepOp> copy_ops;
          for (size_t i = 0; i < walk.entries.size(); ++i) {
            const WalkEntry& e = walk.entries[i];
            if (e.step != step || e.layer != layer) continue;
            EXPECT_EQ(at.count(e.op), 0u) << "one of each op per layer: " << EntryLabel(e);
            at[e.op] = static_cast<int>(i);
            if (e.stream == WalkStream::kCopy) copy_ops.push_back(e.op);
          }
          const StepOp decision = mode == SlotMode::kDevicePolicy ? StepOp::kResidencyStep
                                  : mode == SlotMode::kStageAll   ? StepOp::kStageAllSlots
                                                                  : StepOp::kHostWriteSlots;
          if (OnePassWaitsForCopies(c)) {
            // No fork: the decision, the copy, then right after it the pass
            // whose missed ranks wait for their flags.
            EXPECT_TRUE(copy_ops.empty());
            EXPECT_EQ(at.count(StepOp::kForkRecord) + at.count(StepOp::kJoinWait), 0u);
            EXPECT_LT(at[decision], at[StepOp::kStageCopy]);
            EXPECT_EQ(at[StepOp::kGateUpReady], at[StepOp::kStageCopy] + 1);
            EXPECT_EQ(at[StepOp::kDownReady], at[StepOp::kGateUpReady] + 1);
            continue;
          }
          // The copy stream does exactly wait, copy, record.
          const StepOp copy_op =
              mode == SlotMode::kHostPolicy ? StepOp::kHostStageCopy : StepOp::kStageCopy;
          EXPECT_EQ(copy_ops,
                    (std::vector<StepOp>{StepOp::kForkWait, copy_op, StepOp::kJoinRecord}));
          ASSERT_TRUE(at.count(StepOp::kJoinWait));
          EXPECT_LT(at[StepOp::kForkRecord], at[StepOp::kForkWait]);
          EXPECT_LT(at[StepOp::kJoinRecord], at[StepOp::kJoinWait]);
          // The slot decision precedes the fork; passes that read staged slots follow the join.
          EXPECT_LT(at[decision], at[StepOp::kForkRecord]);
          for (StepOp reads_staged :
               {StepOp::kGateUpMisses, StepOp::kDownMisses, StepOp::kGateUpAll, StepOp::kDownAll}) {
            if (at.count(reads_staged)) {
              EXPECT_GT(at[reads_staged], at[StepOp::kJoinWait]) << StepOpName(reads_staged);
            }
          }
          // Hits overlap the copies: they run between the fork and the join wait.
          for (StepOp hits : {StepOp::kGateUpHits, StepOp::kDownHits, StepOp::kShexpDown}) {
            if (!at.count(hits)) continue;
            EXPECT_GT(at[hits], at[StepOp::kForkRecord]) << StepOpName(hits);
            EXPECT_LT(at[hits], at[StepOp::kJoinWait]) << StepOpName(hits);
          }
          const bool has_hits_pass = at.count(StepOp::kGateUpHits) > 0;
          EXPECT_EQ(has_hits_pass, split && mode != SlotMode::kStageAll);
          EXPECT_EQ(at.count(StepOp::kGateUpAll) > 0, !has_hits_pass);
        }
      }
    }
  }
}

TEST(WalkTest, SStepsRepeatTheStepBlockSTimesAndCopyTheTokenOnce) {
  WalkConfig one = Config(SlotMode::kDevicePolicy, 2, 1);
  WalkConfig four = one;
  four.steps = 4;
  const StepWalk a = BuildWalk(one);
  const StepWalk b = BuildWalk(four);
  const size_t block = a.entries.size() - 1;  // without the token copy
  ASSERT_EQ(b.entries.size(), 4 * block + 1);
  for (int s = 0; s < 4; ++s) {
    for (size_t i = 0; i < block; ++i) {
      const WalkEntry& x = a.entries[i];
      const WalkEntry& y = b.entries[s * block + i];
      EXPECT_EQ(y.op, x.op);
      EXPECT_EQ(y.layer, x.layer);
      EXPECT_EQ(y.stream, x.stream);
      EXPECT_EQ(y.step, s);
    }
  }
  EXPECT_EQ(b.entries.back().op, StepOp::kTokenCopy);
  EXPECT_EQ(b.entries.back().step, 3);
}

TEST(WalkTest, RecordingLogitsAddsOneKernelBetweenEachLmHeadAndItsArgmax) {
  WalkConfig config = Config(SlotMode::kDevicePolicy, 2, 1);
  config.steps = 3;
  const StepWalk plain = BuildWalk(config);
  config.record_logits = true;
  const StepWalk recorded = BuildWalk(config);
  ASSERT_EQ(recorded.entries.size(), plain.entries.size() + 3);
  int records = 0;
  for (size_t i = 0; i < recorded.entries.size(); ++i) {
    const WalkEntry& e = recorded.entries[i];
    if (e.op != StepOp::kRecordLogits) continue;
    ASSERT_GT(i, 0u);
    ASSERT_LT(i + 1, recorded.entries.size());
    EXPECT_EQ(recorded.entries[i - 1].op, StepOp::kLmHead);
    EXPECT_EQ(recorded.entries[i + 1].op, StepOp::kSample);
    EXPECT_EQ(e.step, records);
    EXPECT_EQ(e.kind, EntryKind::kKernel);
    EXPECT_EQ(e.stream, WalkStream::kMain);
    ++records;
  }
  EXPECT_EQ(records, 3);
}

TEST(WalkTest, TheBinderMakesEachCallableAndRunWalkStopsAtTheFirstError) {
  WalkConfig c = Config(SlotMode::kDevicePolicy, 2, 2);
  c.split_passes = true;
  std::vector<std::string> ran;
  int bound = 0;
  const StepWalk walk = BuildWalk(c, [&](const WalkEntry& e) -> std::function<cudaError_t()> {
    ++bound;
    const std::string label = EntryLabel(e);
    const bool fail = e.step == 1 && e.layer == 1 && e.op == StepOp::kStageCopy;
    return [&ran, label, fail] {
      ran.push_back(label);
      return fail ? cudaErrorInvalidValue : cudaSuccess;
    };
  });
  EXPECT_EQ(bound, static_cast<int>(walk.entries.size()));
  size_t failed = 0;
  EXPECT_EQ(RunWalk(walk, &failed), cudaErrorInvalidValue);
  ASSERT_LT(failed, walk.entries.size());
  EXPECT_EQ(EntryLabel(walk.entries[failed]), "step 1 layer 1 stage_copy");
  ASSERT_EQ(ran.size(), failed + 1);
  for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i], EntryLabel(walk.entries[i]));
  EXPECT_EQ(ran.front(), "step 0 embed");
}

TEST(WalkTest, OpNamesAreUniqueAndOnlyCopiesUseTheCopyStream) {
  std::map<std::string_view, int> names;
  for (int i = 0; i <= static_cast<int>(StepOp::kTokenCopy); ++i) {
    const StepOp op = static_cast<StepOp>(i);
    EXPECT_EQ(names[StepOpName(op)]++, 0) << StepOpName(op);
    if (StepOpStream(op) == WalkStream::kCopy) {
      EXPECT_TRUE(op == StepOp::kForkWait || op == StepOp::kStageCopy ||
                  op == StepOp::kHostStageCopy || op == StepOp::kJoinRecord)
          << StepOpName(op);
    }
  }
}

}  // namespace
}  // namespace moegraph
