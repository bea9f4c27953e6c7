#include "gates/gates.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "capture/doors.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "reference/oracle.h"
#include "reference/teacher_forcing.h"

namespace moegraph {
namespace {

constexpr int kPromptLength = 8;

// A gate body: an error is a FAIL with its message.
using GateBody = std::function<absl::StatusOr<GateResult>(GateContext&)>;

std::function<GateResult(GateContext&)> Guarded(GateBody body) {
  return [body = std::move(body)](GateContext& context) {
    absl::StatusOr<GateResult> result = body(context);
    return result.ok() ? *std::move(result) : FailOn(result.status());
  };
}

// Token ids in [0, n_vocab) from a small LCG: different seeds, different prompts.
std::vector<int32_t> PromptOf(const Model& model, uint64_t seed, int length = kPromptLength) {
  std::vector<int32_t> prompt;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int i = 0; i < length; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    prompt.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(model.config.n_vocab)));
  }
  return prompt;
}

// The doors an environment of these variables resolves to (no --arm), through
// the same ResolveDoors the engine's start-up uses; nothing touches the process
// environment.
absl::StatusOr<Doors> DoorsFromEnv(std::map<std::string, std::string> vars) {
  const EnvLookup lookup = [vars = std::move(vars)](std::string_view name) {
    const auto it = vars.find(std::string(name));
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  MG_ASSIGN_OR_RETURN(const ResolvedDoors resolved, ResolveDoors(std::nullopt, lookup));
  return resolved.doors;
}

// Experts selected per step: k in each MoE layer.
uint64_t SelectedPerStep(const Model& model) {
  return static_cast<uint64_t>(model.config.n_moe_layer()) *
         static_cast<uint64_t>(model.config.n_expert_used);
}

// Ids the routing record holds per step: k for every layer, a dense layer's
// as kMissingExpert.
uint64_t RecordedPerStep(const Model& model) {
  return static_cast<uint64_t>(model.config.n_layer) *
         static_cast<uint64_t>(model.config.n_expert_used);
}

// One engine, a workload, and the counters' delta over it.
struct ArmRun {
  std::unique_ptr<GateEngine> engine;
  Transcript transcript;
  CounterValues delta;
};

struct Workload {
  std::vector<int32_t> prompt;
  int n_predict = 0;
  LogitRows rows = LogitRows::kNone;
};

ArmSpec SpecOf(const GateContext& context, const Doors& doors, int max_ctx) {
  ArmSpec spec;
  spec.doors = doors;
  spec.n_slots = context.n_slots;
  spec.max_ctx = max_ctx;
  return spec;
}

absl::StatusOr<CounterValues> Measure(GateEngine& engine, const Workload& work,
                                      Transcript* transcript) {
  MG_ASSIGN_OR_RETURN(const CounterSnapshot before, engine.Snapshot());
  MG_ASSIGN_OR_RETURN(*transcript, engine.Decode(work.prompt, work.n_predict, work.rows));
  MG_ASSIGN_OR_RETURN(const CounterSnapshot after, engine.Snapshot());
  return Delta(before, after);
}

absl::StatusOr<ArmRun> RunArm(GateContext& context, const Model& model, ArmSpec spec,
                              const Workload& work) {
  spec.record_logits = work.rows == LogitRows::kEvery;
  ArmRun run;
  MG_ASSIGN_OR_RETURN(run.engine, context.make_engine(model, spec));
  MG_ASSIGN_OR_RETURN(run.delta, Measure(*run.engine, work, &run.transcript));
  return run;
}

// Counter assertions: an error names the arm, the counter and what it did.
absl::Status ExpectMoved(const CounterValues& d, Counter c, std::string_view arm) {
  if (d[c] > 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrFormat("arm %s: %s did not move", Av(arm), Av(CounterName(c))));
}

absl::Status ExpectFlat(const CounterValues& d, Counter c, std::string_view arm) {
  if (d[c] == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrFormat("arm %s: %s moved by %d, expected flat", Av(arm), Av(CounterName(c)), d[c]));
}

absl::Status ExpectEq(const CounterValues& d, Counter c, uint64_t want, std::string_view arm) {
  if (d[c] == want) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat("arm %s: %s moved by %d, expected %d",
                                                       Av(arm), Av(CounterName(c)), d[c], want));
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The first row whose bits differ, or -1.
int64_t FirstDifferentRow(const std::vector<float>& a, const std::vector<float>& b,
                          size_t n_vocab) {
  for (size_t row = 0; row * n_vocab < a.size(); ++row) {
    if (std::memcmp(a.data() + row * n_vocab, b.data() + row * n_vocab, n_vocab * sizeof(float)) !=
        0) {
      return static_cast<int64_t>(row);
    }
  }
  return -1;
}

std::string Tokens(const std::vector<int32_t>& tokens) { return absl::StrJoin(tokens, " "); }

// ---- cache-bit-identity ----

constexpr int kIdentitySteps = 64;

absl::StatusOr<GateResult> CacheBitIdentity(GateContext& context) {
  const Model& model = *context.model.model;
  MG_ASSIGN_OR_RETURN(const Doors cache_doors, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(const Doors stage_doors, DoorsFromEnv({{"MOEGRAPH_MOE_CACHE", "0"}}));
  const Workload work{PromptOf(model, 1), kIdentitySteps, LogitRows::kEvery};
  const int max_ctx = kPromptLength + kIdentitySteps;
  MG_ASSIGN_OR_RETURN(const ArmRun cached,
                      RunArm(context, model, SpecOf(context, cache_doors, max_ctx), work));
  MG_ASSIGN_OR_RETURN(const ArmRun staged,
                      RunArm(context, model, SpecOf(context, stage_doors, max_ctx), work));
  return CheckCacheBitIdentity(cached.transcript, staged.transcript, cached.delta, staged.delta,
                               SelectedPerStep(model));
}

// ---- graph-eager-identity ----

absl::StatusOr<GateResult> GraphEagerIdentity(GateContext& context) {
  const Model& model = *context.model.model;
  MG_ASSIGN_OR_RETURN(const Doors graph_doors, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(const Doors eager_doors, DoorsFromEnv({{"MOEGRAPH_GRAPH", "0"}}));
  const Workload work{PromptOf(model, 2), kIdentitySteps, LogitRows::kEvery};
  const int max_ctx = kPromptLength + kIdentitySteps;
  MG_ASSIGN_OR_RETURN(const ArmRun graph,
                      RunArm(context, model, SpecOf(context, graph_doors, max_ctx), work));
  MG_ASSIGN_OR_RETURN(const ArmRun eager,
                      RunArm(context, model, SpecOf(context, eager_doors, max_ctx), work));
  if (graph.transcript.tokens != eager.transcript.tokens) {
    return Fail(absl::StrFormat("tokens differ: graph [%s], eager [%s]",
                                Tokens(graph.transcript.tokens), Tokens(eager.transcript.tokens)));
  }
  if (!BitEqual(graph.transcript.logits, eager.transcript.logits)) {
    return Fail(absl::StrFormat("logits differ first at step %d of %d",
                                FirstDifferentRow(graph.transcript.logits, eager.transcript.logits,
                                                  static_cast<size_t>(model.config.n_vocab)),
                                kIdentitySteps));
  }
  MG_RETURN_IF_ERROR(ExpectMoved(graph.delta, Counter::kGraphLaunches, "graph"));
  MG_RETURN_IF_ERROR(ExpectFlat(graph.delta, Counter::kEagerSteps, "graph"));
  MG_RETURN_IF_ERROR(
      ExpectEq(eager.delta, Counter::kEagerSteps, eager.delta[Counter::kDeviceSteps], "eager"));
  MG_RETURN_IF_ERROR(ExpectMoved(eager.delta, Counter::kEagerSteps, "eager"));
  MG_RETURN_IF_ERROR(ExpectFlat(eager.delta, Counter::kGraphLaunches, "eager"));
  MG_RETURN_IF_ERROR(ExpectFlat(eager.delta, Counter::kCaptures, "eager"));
  return Pass(absl::StrFormat(
      "%d steps of tokens and logits bit-identical; graph arm %d launches, 0 eager steps; "
      "eager arm %d eager steps, 0 launches",
      kIdentitySteps, graph.delta[Counter::kGraphLaunches], eager.delta[Counter::kEagerSteps]));
}

// ---- policy-simulation ----

// One policy's run: the engine's residency state against a fresh replay of the
// routing it recorded. Returns the detail for the PASS line.
absl::StatusOr<std::string> SimulatePolicy(GateContext& context, const Doors& doors) {
  const Model& model = *context.model.model;
  const std::string arm = absl::StrCat("MOEGRAPH_POLICY=", Av(PolicyName(doors.policy)));
  const Workload first{PromptOf(model, 3), 24, LogitRows::kNone};
  const Workload second{PromptOf(model, 4), 16, LogitRows::kNone};
  ArmSpec spec = SpecOf(context, doors, kPromptLength + 24);
  spec.record_routing = true;
  MG_ASSIGN_OR_RETURN(std::unique_ptr<GateEngine> engine, context.make_engine(model, spec));
  MG_ASSIGN_OR_RETURN(const CounterSnapshot before, engine->Snapshot());
  MG_RETURN_IF_ERROR(engine->Decode(first.prompt, first.n_predict, first.rows).status());
  // The second decode starts from the first's residency state.
  MG_RETURN_IF_ERROR(engine->Decode(second.prompt, second.n_predict, second.rows).status());
  MG_ASSIGN_OR_RETURN(const CounterSnapshot after, engine->Snapshot());
  MG_ASSIGN_OR_RETURN(const CounterValues delta, Delta(before, after));
  MG_RETURN_IF_ERROR(ExpectMoved(delta, Counter::kEvictions, arm));

  const std::vector<int32_t>& routing = engine->routing();
  if (routing.size() != delta[Counter::kSteps] * RecordedPerStep(model)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: the engine recorded %d routed ids for %d steps of %d", arm,
                        routing.size(), delta[Counter::kSteps], RecordedPerStep(model)));
  }
  uint64_t hits = 0;
  uint64_t misses = 0;
  const std::vector<SlotPoolInfo>& pools = engine->pools();
  for (size_t c = 0; c < pools.size(); ++c) {
    CacheConfig config;
    config.n_layer = static_cast<int32_t>(pools[c].layers.size());
    config.n_expert = model.config.n_expert;
    config.k = model.config.n_expert_used;
    config.n_slots = pools[c].n_slots;
    config.protected_frac = doors.protected_frac;
    config.pool_mode = PoolMode::kGlobal;
    MG_ASSIGN_OR_RETURN(const ResidencySnapshot replay,
                        ReplayRouting(doors.policy, config, pools[c].layers,
                                      model.config.n_layer, routing, &hits, &misses));
    MG_ASSIGN_OR_RETURN(const ResidencySnapshot state, engine->Residency(static_cast<int>(c)));
    if (absl::Status same = CompareResidency(state, replay); !same.ok()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s, size class %d: %s", arm, c, same.message()));
    }
  }
  MG_RETURN_IF_ERROR(ExpectEq(delta, Counter::kHits, hits, arm + " (the replay's hits)"));
  MG_RETURN_IF_ERROR(ExpectEq(delta, Counter::kMisses, misses, arm + " (the replay's misses)"));
  return absl::StrFormat("%s: %d steps, %d hits, %d misses, %d evictions",
                         Av(PolicyName(doors.policy)), delta[Counter::kSteps], hits, misses,
                         delta[Counter::kEvictions]);
}

absl::StatusOr<GateResult> PolicySimulation(GateContext& context) {
  std::vector<std::string> details;
  for (const std::string_view policy : {"hazard", "slru"}) {
    MG_ASSIGN_OR_RETURN(const Doors doors,
                        DoorsFromEnv({{"MOEGRAPH_POLICY", std::string(policy)}}));
    MG_ASSIGN_OR_RETURN(std::string detail, SimulatePolicy(context, doors));
    details.push_back(std::move(detail));
  }
  return Pass(absl::StrCat("every size class's state arrays equal a fresh replay of the "
                           "recorded routing; ",
                           absl::StrJoin(details, "; ")));
}

// ---- readback-count ----

absl::StatusOr<GateResult> ReadbackCount(GateContext& context) {
  const Model& model = *context.model.model;
  constexpr int kDecode = 8;  // a multiple of every S below
  const Workload work{PromptOf(model, 5), kDecode + 1, LogitRows::kNone};
  const int max_ctx = kPromptLength + kDecode;
  MG_ASSIGN_OR_RETURN(const Doors graph_doors, DoorsFromEnv({}));
  std::string detail;
  for (int s : {1, 4}) {
    ArmSpec spec = SpecOf(context, graph_doors, max_ctx);
    spec.steps_per_launch = s;
    MG_ASSIGN_OR_RETURN(const ArmRun run, RunArm(context, model, spec, work));
    const std::string arm = absl::StrFormat("graph S=%d", s);
    const uint64_t launches = kDecode / s;
    const uint64_t n_moe = static_cast<uint64_t>(model.config.n_moe_layer());
    MG_RETURN_IF_ERROR(ExpectEq(run.delta, Counter::kGraphLaunches, launches, arm));
    // The batched prompt (one ubatch): a routing readback per MoE layer and its
    // token; then one wait per launch and one readback of the generated tokens.
    MG_RETURN_IF_ERROR(ExpectEq(run.delta, Counter::kHostSyncs, n_moe + 1 + launches + 1, arm));
    MG_RETURN_IF_ERROR(ExpectEq(run.delta, Counter::kPrefillTokens, kPromptLength, arm));
    MG_RETURN_IF_ERROR(ExpectFlat(run.delta, Counter::kPromptSteps, arm));
    MG_RETURN_IF_ERROR(ExpectFlat(run.delta, Counter::kEagerSteps, arm));
    absl::StrAppendFormat(&detail, "graph S=%d: %d syncs for %d decode tokens (1/%d per token); ",
                          s, kDecode / s, kDecode, s);
  }
  MG_ASSIGN_OR_RETURN(const Doors host_doors, DoorsFromEnv({{"MOEGRAPH_RESIDENCY", "host"}}));
  MG_ASSIGN_OR_RETURN(const ArmRun host,
                      RunArm(context, model, SpecOf(context, host_doors, max_ctx), work));
  const uint64_t n_moe = static_cast<uint64_t>(model.config.n_moe_layer());
  // The prompt's syncs (as the graph arm's), then the decode's.
  MG_RETURN_IF_ERROR(
      ExpectEq(host.delta, Counter::kHostSyncs, (kDecode + 1) * (n_moe + 1) + 1, "host"));
  MG_RETURN_IF_ERROR(ExpectFlat(host.delta, Counter::kGraphLaunches, "host"));
  absl::StrAppendFormat(&detail, "host: %d per token (%d MoE layers + 1)", n_moe + 1, n_moe);
  return Pass(detail);
}

// ---- door-engagement ----

// What a policy left in every size class's residency state: slru's protected
// slots against the cap floor(slots * frac) of a protected share, and the
// hazard table's observations.
struct PolicyTally {
  int64_t protected_slots = 0;
  bool any_protected_seg = false;
  bool any_slru_state = false;  // stamps or segments kept
  bool within_cap = true;       // every pool at most floor(its slots * frac)
  bool above_cap = false;       // some pool above it
  uint64_t hazard_trials = 0;
};

absl::StatusOr<PolicyTally> TallyPolicy(GateEngine& engine, double frac) {
  PolicyTally out;
  for (size_t c = 0; c < engine.pools().size(); ++c) {
    MG_ASSIGN_OR_RETURN(const ResidencySnapshot state, engine.Residency(static_cast<int>(c)));
    const int64_t cap =
        static_cast<int64_t>(std::floor(engine.pools()[c].n_slots * frac));  // one global pool
    for (const int32_t n : state.n_protected) {
      out.protected_slots += n;
      out.within_cap = out.within_cap && n <= cap;
      out.above_cap = out.above_cap || n > cap;
    }
    out.any_protected_seg =
        out.any_protected_seg ||
        std::any_of(state.seg.begin(), state.seg.end(), [](uint8_t seg) { return seg != 0; });
    out.any_slru_state = out.any_slru_state || !state.stamp.empty() || !state.seg.empty();
    for (const uint32_t trials : state.cell_trials) out.hazard_trials += trials;
  }
  return out;
}

constexpr double kDoorFrac = 0.25;

absl::StatusOr<GateResult> DoorEngagement(GateContext& context) {
  const Model& model = *context.model.model;
  const Workload work{PromptOf(model, 6), 40, LogitRows::kNone};
  const int max_ctx = kPromptLength + 40;
  const std::string frac_text = absl::StrFormat("%.2f", kDoorFrac);
  MG_ASSIGN_OR_RETURN(const Doors defaults, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(const Doors stage, DoorsFromEnv({{"MOEGRAPH_MOE_CACHE", "0"}}));
  MG_ASSIGN_OR_RETURN(const Doors slru, DoorsFromEnv({{"MOEGRAPH_POLICY", "slru"}}));
  MG_ASSIGN_OR_RETURN(const Doors lru, DoorsFromEnv({{"MOEGRAPH_POLICY", "lru"}}));
  MG_ASSIGN_OR_RETURN(const Doors frac, DoorsFromEnv({{"MOEGRAPH_POLICY", "slru"},
                                                      {"MOEGRAPH_PROTECTED_FRAC", frac_text}}));
  const bool cuda = context.backend == Backend::kCuda;

  MG_ASSIGN_OR_RETURN(ArmRun base,
                      RunArm(context, model, SpecOf(context, defaults, max_ctx), work));
  MG_ASSIGN_OR_RETURN(ArmRun off, RunArm(context, model, SpecOf(context, stage, max_ctx), work));
  // MOEGRAPH_MOE_CACHE: only the residency policy produces hits and evictions.
  MG_RETURN_IF_ERROR(ExpectMoved(base.delta, Counter::kHits, "default"));
  MG_RETURN_IF_ERROR(ExpectMoved(base.delta, Counter::kEvictions, "default"));
  MG_RETURN_IF_ERROR(ExpectFlat(off.delta, Counter::kHits, "MOEGRAPH_MOE_CACHE=0"));
  MG_RETURN_IF_ERROR(ExpectFlat(off.delta, Counter::kEvictions, "MOEGRAPH_MOE_CACHE=0"));
  MG_RETURN_IF_ERROR(ExpectEq(off.delta, Counter::kMisses,
                              off.delta[Counter::kSteps] * SelectedPerStep(model),
                              "MOEGRAPH_MOE_CACHE=0 (every selected expert staged)"));
  if (cuda) {
    // The residency kernel's own counters: it runs only with the cache on.
    MG_RETURN_IF_ERROR(ExpectMoved(base.delta, Counter::kDeviceHits, "default"));
    MG_RETURN_IF_ERROR(ExpectFlat(off.delta, Counter::kDeviceHits, "MOEGRAPH_MOE_CACHE=0"));
    MG_RETURN_IF_ERROR(ExpectFlat(off.delta, Counter::kDeviceMisses, "MOEGRAPH_MOE_CACHE=0"));
  }
  if (off.engine->Residency(0).ok()) {
    return Fail("arm MOEGRAPH_MOE_CACHE=0: the engine reports a residency state");
  }

  // MOEGRAPH_POLICY: hazard (the default) learns from every expert of every layer
  // visit and keeps no stamps; slru protects slots, lru never does.
  MG_ASSIGN_OR_RETURN(const ArmRun slru_run,
                      RunArm(context, model, SpecOf(context, slru, max_ctx), work));
  MG_ASSIGN_OR_RETURN(const ArmRun lru_run,
                      RunArm(context, model, SpecOf(context, lru, max_ctx), work));
  MG_ASSIGN_OR_RETURN(const PolicyTally base_tally,
                      TallyPolicy(*base.engine, defaults.protected_frac));
  MG_ASSIGN_OR_RETURN(const PolicyTally slru_tally,
                      TallyPolicy(*slru_run.engine, slru.protected_frac));
  MG_ASSIGN_OR_RETURN(const PolicyTally lru_tally, TallyPolicy(*lru_run.engine, 0.0));
  const uint64_t observations = base.delta[Counter::kSteps] *
                                static_cast<uint64_t>(model.config.n_moe_layer()) *
                                static_cast<uint64_t>(model.config.n_expert);
  if (base_tally.hazard_trials != observations || base_tally.any_slru_state) {
    return Fail(absl::StrFormat(
        "arm default (hazard): %d cell observations and %s slru state; expected %d (steps x "
        "layers x experts) and none",
        base_tally.hazard_trials, base_tally.any_slru_state ? "some" : "no", observations));
  }
  if (slru_tally.protected_slots == 0 || slru_tally.hazard_trials != 0) {
    return Fail(absl::StrFormat(
        "arm MOEGRAPH_POLICY=slru: %d slots protected and %d cell observations; expected "
        "some and none",
        slru_tally.protected_slots, slru_tally.hazard_trials));
  }
  if (lru_tally.protected_slots != 0 || lru_tally.any_protected_seg) {
    return Fail(absl::StrFormat("arm MOEGRAPH_POLICY=lru: %d slots protected, expected none",
                                lru_tally.protected_slots));
  }

  // MOEGRAPH_PROTECTED_FRAC: a smaller share caps slru's protected slots below
  // what the default share reaches on the same routing.
  MG_ASSIGN_OR_RETURN(const ArmRun frac_run,
                      RunArm(context, model, SpecOf(context, frac, max_ctx), work));
  MG_ASSIGN_OR_RETURN(const PolicyTally frac_tally, TallyPolicy(*frac_run.engine, kDoorFrac));
  MG_ASSIGN_OR_RETURN(const PolicyTally slru_at_frac, TallyPolicy(*slru_run.engine, kDoorFrac));
  if (!frac_tally.within_cap || frac_tally.protected_slots == 0) {
    return Fail(absl::StrFormat(
        "arm MOEGRAPH_PROTECTED_FRAC=%s: %d slots protected, expected 1 .. floor(slots * %s)",
        frac_text, frac_tally.protected_slots, frac_text));
  }
  if (!slru_at_frac.above_cap) {
    return Fail(absl::StrFormat(
        "arm MOEGRAPH_POLICY=slru: %d slots protected, not above the %s cap, so the door "
        "shows nothing on this workload",
        slru_tally.protected_slots, frac_text));
  }
  return Pass(absl::StrFormat(
      "MOEGRAPH_MOE_CACHE=0: 0 hits, 0 evictions, %d of %d staged (default: %d hits, %d "
      "evictions); MOEGRAPH_POLICY: hazard %d cell observations, slru %d protected, lru 0; "
      "MOEGRAPH_PROTECTED_FRAC=%s: %d protected (%.2f: %d)",
      off.delta[Counter::kMisses], off.delta[Counter::kSteps] * SelectedPerStep(model),
      base.delta[Counter::kHits], base.delta[Counter::kEvictions], base_tally.hazard_trials,
      slru_tally.protected_slots, frac_text, frac_tally.protected_slots, slru.protected_frac,
      slru_tally.protected_slots));
}

// ---- door-engagement-cuda ----

absl::StatusOr<GateResult> DoorEngagementCuda(GateContext& context) {
  const Model& model = *context.model.model;
  const Workload work{PromptOf(model, 7), 24, LogitRows::kNone};
  const int max_ctx = kPromptLength + 24;
  const uint64_t steps = 23;  // decode steps: the prompt is batched
  const uint64_t n_moe = static_cast<uint64_t>(model.config.n_moe_layer());
  MG_ASSIGN_OR_RETURN(const Doors defaults, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(const Doors eager, DoorsFromEnv({{"MOEGRAPH_GRAPH", "0"}}));
  MG_ASSIGN_OR_RETURN(const Doors host, DoorsFromEnv({{"MOEGRAPH_RESIDENCY", "host"}}));
  MG_ASSIGN_OR_RETURN(const Doors split, DoorsFromEnv({{"MOEGRAPH_SPLIT_PASSES", "1"}}));
  MG_ASSIGN_OR_RETURN(const Doors no_pdl, DoorsFromEnv({{"MOEGRAPH_PDL", "0"}}));
  MG_ASSIGN_OR_RETURN(const Doors prefill_steps, DoorsFromEnv({{"MOEGRAPH_PREFILL", "steps"}}));
  MG_ASSIGN_OR_RETURN(const Doors unchained, DoorsFromEnv({{"MOEGRAPH_CHAIN", "0"}}));

  // The default: the prompt batched (a routing readback per MoE layer, its
  // token, the step counter and plan uploads, a copy per streamed expert),
  // then one graph launch and one wait per decode step.
  MG_ASSIGN_OR_RETURN(const ArmRun base,
                      RunArm(context, model, SpecOf(context, defaults, max_ctx), work));
  const CounterValues& d = base.delta;
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kGraphLaunches, steps, "default"));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kEagerSteps, "default"));
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kHostSyncs, n_moe + 1 + steps + 1, "default"));
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kPrefillTokens, kPromptLength, "default"));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kPromptSteps, "default"));
  MG_RETURN_IF_ERROR(ExpectMoved(d, Counter::kPrefillExpertsStreamed, "default (a cold cache)"));
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kH2dMemcpys,
                              3 + n_moe + d[Counter::kPrefillExpertsStreamed],
                              "default (the prompt, the step counter twice, a plan per layer, "
                              "the streamed experts)"));
  MG_RETURN_IF_ERROR(ExpectMoved(d, Counter::kPassBExperts, "default"));
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kPassBExperts, d[Counter::kDeviceMisses], "default"));
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kPassAExperts, d[Counter::kDeviceHits], "default"));
  // The one pass: every miss waited for its copy's flag.
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kCopyWaits, d[Counter::kDeviceMisses], "default"));
  MG_RETURN_IF_ERROR(ExpectMoved(d, Counter::kProgrammaticLaunches, "default"));
  // Two chained launches a MoE layer a decode step: attn_out with the router,
  // the expert pass's gate/up with down.
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kChainedLaunches, 2 * n_moe * steps, "default"));

  // MOEGRAPH_PREFILL=steps: the prompt as T=1 steps in the decode graph.
  MG_ASSIGN_OR_RETURN(const ArmRun steps_run,
                      RunArm(context, model, SpecOf(context, prefill_steps, max_ctx), work));
  const std::string steps_arm = "MOEGRAPH_PREFILL=steps";
  MG_RETURN_IF_ERROR(ExpectEq(steps_run.delta, Counter::kPromptSteps, kPromptLength, steps_arm));
  MG_RETURN_IF_ERROR(ExpectFlat(steps_run.delta, Counter::kPrefillTokens, steps_arm));
  MG_RETURN_IF_ERROR(ExpectFlat(steps_run.delta, Counter::kPrefillExpertsStreamed, steps_arm));
  MG_RETURN_IF_ERROR(
      ExpectEq(steps_run.delta, Counter::kGraphLaunches, kPromptLength + steps, steps_arm));

  // MOEGRAPH_GRAPH=0: eager steps instead of graph launches.
  MG_ASSIGN_OR_RETURN(const ArmRun eager_run,
                      RunArm(context, model, SpecOf(context, eager, max_ctx), work));
  MG_RETURN_IF_ERROR(ExpectEq(eager_run.delta, Counter::kEagerSteps, steps, "MOEGRAPH_GRAPH=0"));
  MG_RETURN_IF_ERROR(ExpectFlat(eager_run.delta, Counter::kGraphLaunches, "MOEGRAPH_GRAPH=0"));
  MG_RETURN_IF_ERROR(ExpectFlat(eager_run.delta, Counter::kCaptures, "MOEGRAPH_GRAPH=0"));

  // MOEGRAPH_RESIDENCY=host: a sync after every router, the policy on the host
  // (the residency kernel's counters stay flat), a copy call per miss.
  MG_ASSIGN_OR_RETURN(const ArmRun host_run,
                      RunArm(context, model, SpecOf(context, host, max_ctx), work));
  const CounterValues& h = host_run.delta;
  const std::string host_arm = "MOEGRAPH_RESIDENCY=host";
  // The prompt's syncs (as the default's), then one per MoE layer and token.
  MG_RETURN_IF_ERROR(ExpectEq(h, Counter::kHostSyncs, (steps + 1) * (n_moe + 1) + 1, host_arm));
  MG_RETURN_IF_ERROR(ExpectFlat(h, Counter::kDeviceHits, host_arm));
  MG_RETURN_IF_ERROR(ExpectFlat(h, Counter::kDeviceMisses, host_arm));
  MG_RETURN_IF_ERROR(ExpectFlat(h, Counter::kGraphLaunches, host_arm));
  MG_RETURN_IF_ERROR(ExpectEq(h, Counter::kHits,
                              steps * SelectedPerStep(model) - h[Counter::kMisses],
                              host_arm + " (host policy decisions)"));
  if (h[Counter::kH2dMemcpys] <= 2 * steps * n_moe) {
    return Fail(absl::StrFormat("arm %s: %d host-to-device copies, expected over %d", host_arm,
                                h[Counter::kH2dMemcpys], 2 * steps * n_moe));
  }

  // MOEGRAPH_SPLIT_PASSES=1: the misses in a pass of their own after the
  // join, so no pass waits for a flag.
  MG_ASSIGN_OR_RETURN(const ArmRun split_run,
                      RunArm(context, model, SpecOf(context, split, max_ctx), work));
  const CounterValues& s = split_run.delta;
  const std::string split_arm = "MOEGRAPH_SPLIT_PASSES=1";
  MG_RETURN_IF_ERROR(ExpectFlat(s, Counter::kCopyWaits, split_arm));
  MG_RETURN_IF_ERROR(ExpectMoved(s, Counter::kPassBExperts, split_arm));
  MG_RETURN_IF_ERROR(ExpectEq(s, Counter::kPassBExperts, s[Counter::kDeviceMisses], split_arm));
  MG_RETURN_IF_ERROR(ExpectEq(s, Counter::kPassAExperts, s[Counter::kDeviceHits], split_arm));

  // MOEGRAPH_PDL=0: the same walk launched without the attribute.
  MG_ASSIGN_OR_RETURN(const ArmRun no_pdl_run,
                      RunArm(context, model, SpecOf(context, no_pdl, max_ctx), work));
  MG_RETURN_IF_ERROR(
      ExpectFlat(no_pdl_run.delta, Counter::kProgrammaticLaunches, "MOEGRAPH_PDL=0"));
  MG_RETURN_IF_ERROR(ExpectEq(no_pdl_run.delta, Counter::kGraphLaunches, steps, "MOEGRAPH_PDL=0"));
  if (no_pdl_run.transcript.tokens != base.transcript.tokens) {
    return Fail("MOEGRAPH_PDL=0 changed the tokens of the default arm");
  }

  // MOEGRAPH_CHAIN=0: two launches where a chain was, the same tokens.
  MG_ASSIGN_OR_RETURN(const ArmRun unchained_run,
                      RunArm(context, model, SpecOf(context, unchained, max_ctx), work));
  MG_RETURN_IF_ERROR(
      ExpectFlat(unchained_run.delta, Counter::kChainedLaunches, "MOEGRAPH_CHAIN=0"));
  MG_RETURN_IF_ERROR(
      ExpectEq(unchained_run.delta, Counter::kGraphLaunches, steps, "MOEGRAPH_CHAIN=0"));
  if (unchained_run.transcript.tokens != base.transcript.tokens) {
    return Fail("MOEGRAPH_CHAIN=0 changed the tokens of the default arm");
  }
  return Pass(absl::StrFormat(
      "MOEGRAPH_GRAPH=0: %d eager steps, 0 launches (default: %d launches, 0 eager); "
      "MOEGRAPH_RESIDENCY=host: %d syncs, %d copy calls, residency kernel flat (default: %d "
      "syncs); MOEGRAPH_SPLIT_PASSES=1: 0 copy waits, pass B %d (default: %d waits); "
      "MOEGRAPH_PDL=0: 0 programmatic launches (default: %d); MOEGRAPH_PREFILL=steps: %d prompt "
      "steps, 0 prefill tokens (default: 0, %d); MOEGRAPH_CHAIN=0: 0 chained launches "
      "(default: %d)",
      eager_run.delta[Counter::kEagerSteps], d[Counter::kGraphLaunches], h[Counter::kHostSyncs],
      h[Counter::kH2dMemcpys], d[Counter::kHostSyncs], s[Counter::kPassBExperts],
      d[Counter::kCopyWaits],
      d[Counter::kProgrammaticLaunches], steps_run.delta[Counter::kPromptSteps],
      d[Counter::kPrefillTokens], d[Counter::kChainedLaunches]));
}

// ---- prefill-keeps-decode-set ----

absl::StatusOr<GateResult> PrefillKeepsDecodeSet(GateContext& context) {
  const Model& model = *context.model.model;
  constexpr int kLongPrompt = 700;
  MG_ASSIGN_OR_RETURN(const Doors doors, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(std::unique_ptr<GateEngine> engine,
                      context.make_engine(model, SpecOf(context, doors, kLongPrompt + 8)));
  // A warm cache: a short prompt and 32 decode steps.
  MG_RETURN_IF_ERROR(engine->Decode(PromptOf(model, 21), 32, LogitRows::kNone).status());
  std::vector<ResidencySnapshot> warm;
  for (size_t c = 0; c < engine->pools().size(); ++c) {
    MG_ASSIGN_OR_RETURN(warm.emplace_back(), engine->Residency(static_cast<int>(c)));
  }
  const Workload work{PromptOf(model, 22, kLongPrompt), 0, LogitRows::kNone};
  Transcript transcript;
  MG_ASSIGN_OR_RETURN(const CounterValues d, Measure(*engine, work, &transcript));
  for (size_t c = 0; c < warm.size(); ++c) {
    MG_ASSIGN_OR_RETURN(const ResidencySnapshot after, engine->Residency(static_cast<int>(c)));
    if (absl::Status same = CompareResidency(after, warm[c]); !same.ok()) {
      return Fail(absl::StrFormat("size class %d after a %d-token prompt: %s (before it)", c,
                                  kLongPrompt, same.message()));
    }
  }
  const std::string arm = "a 700-token prompt";
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kPrefillTokens, kLongPrompt, arm));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kPromptSteps, arm));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kSteps, arm));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kDeviceHits, arm));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kDeviceMisses, arm));
  MG_RETURN_IF_ERROR(ExpectFlat(d, Counter::kDeviceEvictions, arm));
  MG_RETURN_IF_ERROR(ExpectMoved(d, Counter::kPrefillExpertsInPlace, arm));
  MG_RETURN_IF_ERROR(ExpectMoved(d, Counter::kPrefillExpertsStreamed, arm));
  const size_t block_bytes = engine->pools()[0].block_bytes;
  for (const SlotPoolInfo& pool : engine->pools()) {
    if (pool.block_bytes != block_bytes) {
      return Fail("the fixture has size classes of different block sizes");
    }
  }
  MG_RETURN_IF_ERROR(ExpectEq(d, Counter::kPrefillBytesStreamed,
                              d[Counter::kPrefillExpertsStreamed] * block_bytes, arm));
  return Pass(absl::StrFormat(
      "every residency array of %d size classes equal before and after a %d-token prompt; it "
      "read %d experts in place and streamed %d (%d bytes), with no step, hit, miss or eviction",
      warm.size(), kLongPrompt, d[Counter::kPrefillExpertsInPlace],
      d[Counter::kPrefillExpertsStreamed], d[Counter::kPrefillBytesStreamed]));
}

// ---- oracle-nmse ----

bool HasQuantizedExperts(const Model& model) {
  for (int layer = model.config.n_layer_dense_lead; layer < model.config.n_layer; ++layer) {
    for (const ProjectionLayout& p : ExpertLayoutOf(model, layer).projections) {
      if (p.type != GgmlType::kF32) return true;
    }
  }
  return false;
}

absl::StatusOr<GateResult> OracleNmse(GateContext& context) {
  constexpr int kSteps = 16;
  std::vector<std::string> parts;
  for (const NamedModel& named : context.oracle_models) {
    const Model& model = *named.model;
    MG_ASSIGN_OR_RETURN(const Doors doors, DoorsFromEnv({}));
    const Workload work{PromptOf(model, 8), kSteps, LogitRows::kEvery};
    const int max_ctx = kPromptLength + kSteps;
    ArmSpec spec = SpecOf(context, doors, max_ctx);
    spec.record_routing = true;
    MG_ASSIGN_OR_RETURN(const ArmRun run, RunArm(context, model, spec, work));
    MG_RETURN_IF_ERROR(ExpectMoved(run.delta, Counter::kMisses, named.name));
    // The oracle fed the engine's tokens and routed as it: row i of both
    // picked token i.
    TeacherForcedExperts forced(model, run.engine->routing());
    MG_ASSIGN_OR_RETURN(std::unique_ptr<Oracle> oracle, Oracle::Create(model, max_ctx, &forced));
    MG_ASSIGN_OR_RETURN(std::vector<float> want, oracle->Forward(work.prompt));
    MG_RETURN_IF_ERROR(Prefixed(forced.status(), named.name));
    const size_t n_vocab = static_cast<size_t>(model.config.n_vocab);
    want.erase(want.begin(), want.end() - static_cast<ptrdiff_t>(n_vocab));
    const double bound = HasQuantizedExperts(model) ? 5e-4 : 1e-6;
    double worst = 0;
    for (int i = 0; i < kSteps; ++i) {
      const std::vector<float> got(run.transcript.logits.begin() + i * n_vocab,
                                   run.transcript.logits.begin() + (i + 1) * n_vocab);
      const double nmse = Nmse(got, want);
      worst = std::max(worst, nmse);
      if (!(nmse < bound)) {
        return Fail(
            absl::StrFormat("%s: step %d NMSE %.3g, bound %.0e", named.name, i, nmse, bound));
      }
      if (i + 1 < kSteps) {
        MG_ASSIGN_OR_RETURN(want, oracle->Forward({run.transcript.tokens[i]}));
        MG_RETURN_IF_ERROR(Prefixed(forced.status(), named.name));
      }
    }
    const std::string routing =
        forced.differing_rows() == 0
            ? absl::StrFormat("the engine chose the oracle's experts on all %d rows x layers",
                              forced.rows())
            : absl::StrFormat(
                  "the engine's experts differed on %d of %d rows x layers, each a near-tie, "
                  "within %.2g of the score range",
                  forced.differing_rows(), forced.rows(), forced.worst_gap());
    parts.push_back(
        absl::StrFormat("%s max NMSE %.2e < %.0e (%s)", named.name, worst, bound, routing));
  }
  return Pass(absl::StrFormat("%d steps each: %s", kSteps, absl::StrJoin(parts, "; ")));
}

// ---- anchor-replay ----

absl::StatusOr<GateResult> AnchorReplay(GateContext& context) {
  const Model& model = *context.model.model;
  constexpr int kRepeats = 4;
  constexpr int kSteps = 16;
  MG_ASSIGN_OR_RETURN(const Doors doors, DoorsFromEnv({}));
  MG_ASSIGN_OR_RETURN(std::unique_ptr<GateEngine> engine,
                      context.make_engine(model, SpecOf(context, doors, kPromptLength + kSteps)));
  const Workload anchor{PromptOf(model, 9), kSteps, LogitRows::kNone};
  std::vector<int32_t> want;
  std::vector<int32_t> previous_table;
  std::vector<uint64_t> anchor_misses;
  std::vector<uint64_t> churn_evictions;
  for (int r = 0; r < kRepeats; ++r) {
    MG_ASSIGN_OR_RETURN(const ResidencySnapshot start, engine->Residency(0));
    if (r > 0 && start.table == previous_table) {
      return Fail(absl::StrFormat("decode %d started from the same residency table as decode %d", r,
                                  r - 1));
    }
    previous_table = start.table;
    Transcript got;
    MG_ASSIGN_OR_RETURN(const CounterValues delta, Measure(*engine, anchor, &got));
    anchor_misses.push_back(delta[Counter::kMisses]);
    if (r == 0) {
      want = got.tokens;
    } else if (got.tokens != want) {
      return Fail(absl::StrFormat("decode %d gave [%s], decode 0 [%s]", r, Tokens(got.tokens),
                                  Tokens(want)));
    }
    if (r + 1 == kRepeats) break;
    // Other prompts churn the cache before the next decode.
    const Workload churn{PromptOf(model, 100 + static_cast<uint64_t>(r)), kSteps, LogitRows::kNone};
    Transcript ignored;
    MG_ASSIGN_OR_RETURN(const CounterValues churned, Measure(*engine, churn, &ignored));
    MG_RETURN_IF_ERROR(ExpectMoved(churned, Counter::kEvictions, absl::StrCat("churn ", r)));
    churn_evictions.push_back(churned[Counter::kEvictions]);
  }
  return Pass(absl::StrFormat(
      "%d decodes of %d tokens byte-identical from %d different cache states (anchor misses "
      "%s; churn evictions %s)",
      kRepeats, kSteps, kRepeats, absl::StrJoin(anchor_misses, ","),
      absl::StrJoin(churn_evictions, ",")));
}

}  // namespace

GateResult CheckCacheBitIdentity(const Transcript& cached, const Transcript& staged,
                                 const CounterValues& cache_delta, const CounterValues& stage_delta,
                                 uint64_t selected_per_step) {
  if (cached.tokens.empty() || cached.logits.empty()) return Fail("the cache arm decoded nothing");
  if (cached.tokens != staged.tokens) {
    return Fail(absl::StrFormat("tokens differ: cache [%s], stage [%s]", Tokens(cached.tokens),
                                Tokens(staged.tokens)));
  }
  if (!BitEqual(cached.logits, staged.logits)) {
    const size_t n_vocab = cached.logits.size() / cached.tokens.size();
    return Fail(absl::StrFormat("logits differ first at step %d of %d",
                                FirstDifferentRow(cached.logits, staged.logits, n_vocab),
                                cached.tokens.size()));
  }
  for (const Counter c : {Counter::kHits, Counter::kMisses, Counter::kEvictions}) {
    if (absl::Status moved = ExpectMoved(cache_delta, c, "cache"); !moved.ok()) {
      return Fail(absl::StrCat(moved.message(), " (the cache did not hit, miss and evict)"));
    }
  }
  for (const Counter c : {Counter::kHits, Counter::kEvictions}) {
    if (absl::Status flat = ExpectFlat(stage_delta, c, "MOEGRAPH_MOE_CACHE=0"); !flat.ok()) {
      return FailOn(flat);
    }
  }
  const uint64_t selected = stage_delta[Counter::kSteps] * selected_per_step;
  if (absl::Status all = ExpectEq(stage_delta, Counter::kMisses, selected, "MOEGRAPH_MOE_CACHE=0");
      !all.ok() || selected == 0) {
    return all.ok() ? Fail("arm MOEGRAPH_MOE_CACHE=0: no step ran") : FailOn(all);
  }
  return Pass(absl::StrFormat(
      "%d steps of tokens and logits bit-identical; cache arm %d hits, %d misses, %d "
      "evictions; stage arm %d of %d staged",
      cached.tokens.size(), cache_delta[Counter::kHits], cache_delta[Counter::kMisses],
      cache_delta[Counter::kEvictions], stage_delta[Counter::kMisses], selected));
}

absl::Status CompareResidency(const ResidencySnapshot& engine, const ResidencySnapshot& replay) {
  const auto compare = [](std::string_view name, const auto& got,
                          const auto& want) -> absl::Status {
    if (got.size() != want.size()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s has %d entries, the replay %d", Av(name), got.size(), want.size()));
    }
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        return absl::FailedPreconditionError(
            absl::StrFormat("%s[%d] is %d, the replay has %d", Av(name), i,
                            static_cast<int64_t>(got[i]), static_cast<int64_t>(want[i])));
      }
    }
    return absl::OkStatus();
  };
  MG_RETURN_IF_ERROR(compare("table", engine.table, replay.table));
  MG_RETURN_IF_ERROR(compare("owner", engine.owner, replay.owner));
  MG_RETURN_IF_ERROR(compare("stamp", engine.stamp, replay.stamp));
  MG_RETURN_IF_ERROR(compare("seg", engine.seg, replay.seg));
  MG_RETURN_IF_ERROR(compare("n_protected", engine.n_protected, replay.n_protected));
  MG_RETURN_IF_ERROR(compare("clock", engine.clock, replay.clock));
  MG_RETURN_IF_ERROR(compare("last_visit", engine.last_visit, replay.last_visit));
  MG_RETURN_IF_ERROR(compare("frequency", engine.frequency, replay.frequency));
  MG_RETURN_IF_ERROR(compare("long_frequency", engine.long_frequency, replay.long_frequency));
  MG_RETURN_IF_ERROR(compare("visits", engine.visits, replay.visits));
  MG_RETURN_IF_ERROR(compare("cell_hits", engine.cell_hits, replay.cell_hits));
  return compare("cell_trials", engine.cell_trials, replay.cell_trials);
}

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0;
  double ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    err += d * d;
    ref += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return ref > 0 ? err / ref : err;
}

std::vector<Gate> AllGates() {
  std::vector<Gate> gates;
  gates.push_back({"cache-bit-identity",
                   "cache on vs MOEGRAPH_MOE_CACHE=0: the same logit bits over 64 steps, with "
                   "hits, misses and evictions on the cache arm",
                   false, Guarded(CacheBitIdentity)});
  gates.push_back({"graph-eager-identity",
                   "graph vs MOEGRAPH_GRAPH=0: the same tokens and logit bits; launches move "
                   "only on the graph arm, eager steps only on the eager arm",
                   true, Guarded(GraphEagerIdentity)});
  gates.push_back({"policy-simulation",
                   "for hazard and slru: the engine's residency state equals a fresh host "
                   "cache of the policy fed the routing the engine recorded",
                   false, Guarded(PolicySimulation)});
  gates.push_back({"readback-count",
                   "host syncs per token: 1/S in graph mode (S = 1, 4), one per MoE layer plus "
                   "one in the host arm; a batched prompt's: one per MoE layer plus one",
                   true, Guarded(ReadbackCount)});
  gates.push_back({"door-engagement",
                   "MOEGRAPH_MOE_CACHE, MOEGRAPH_POLICY, MOEGRAPH_PROTECTED_FRAC each move "
                   "their counter on their arm and leave it flat otherwise",
                   false, Guarded(DoorEngagement)});
  gates.push_back({"door-engagement-cuda",
                   "MOEGRAPH_GRAPH, MOEGRAPH_RESIDENCY, MOEGRAPH_SPLIT_PASSES, MOEGRAPH_PDL, "
                   "MOEGRAPH_PREFILL each move their counter on their arm and leave it flat "
                   "otherwise",
                   true, Guarded(DoorEngagementCuda)});
  gates.push_back({"prefill-keeps-decode-set",
                   "a 700-token prompt on a warm cache leaves every residency array as it was, "
                   "reads experts in place and streams the others (bytes = streamed x block)",
                   true, Guarded(PrefillKeepsDecodeSet)});
  gates.push_back({"oracle-nmse",
                   "logits against the CPU oracle: NMSE under 5e-4 (quantized experts) or "
                   "1e-6 (f32)",
                   false, Guarded(OracleNmse)});
  gates.push_back({"anchor-replay",
                   "one prompt decoded 4 times, other prompts churning the cache in between: "
                   "byte-identical tokens each time",
                   false, Guarded(AnchorReplay)});
  return gates;
}

}  // namespace moegraph
