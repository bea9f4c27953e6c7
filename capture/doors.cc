#include "capture/doors.h"

#include <cstdlib>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

constexpr std::string_view kGraphVar = "MOEGRAPH_GRAPH";
constexpr std::string_view kMoeCacheVar = "MOEGRAPH_MOE_CACHE";
constexpr std::string_view kResidencyVar = "MOEGRAPH_RESIDENCY";
constexpr std::string_view kPolicyVar = "MOEGRAPH_POLICY";
constexpr std::string_view kProtectedFracVar = "MOEGRAPH_PROTECTED_FRAC";
constexpr std::string_view kSplitPassesVar = "MOEGRAPH_SPLIT_PASSES";
constexpr std::string_view kChainVar = "MOEGRAPH_CHAIN";
constexpr std::string_view kPdlVar = "MOEGRAPH_PDL";
constexpr std::string_view kPrefillVar = "MOEGRAPH_PREFILL";
constexpr std::string_view kBatchMatMulVar = "MOEGRAPH_BATCH_MATMUL";
constexpr std::string_view kReadOverlapVar = "MOEGRAPH_READ_OVERLAP";
constexpr std::string_view kAmxVar = "MOEGRAPH_AMX";

// kImplied: changed to agree with a door the environment set.
enum class Source { kDefault, kArm, kEnv, kImplied };

// One door's value and where it came from.
template <typename T>
struct Door {
  T value;
  Source source = Source::kDefault;
};

absl::StatusOr<std::optional<bool>> ReadBool(const EnvLookup& env, std::string_view name) {
  const std::optional<std::string> text = env(name);
  if (!text.has_value()) return std::optional<bool>();
  if (*text == "0") return std::optional<bool>(false);
  if (*text == "1") return std::optional<bool>(true);
  return absl::InvalidArgumentError(
      absl::StrFormat("%s='%s' must be 0 or 1", Av(name), *text));
}

// The door settings an arm stands for (doors it leaves alone stay at the default).
void ApplyArm(Arm arm, Door<bool>& graph, Door<bool>& moe_cache, Door<ResidencyMode>& residency,
              Door<bool>& resident) {
  auto set = [](auto& door, auto value) {
    door.value = value;
    door.source = Source::kArm;
  };
  switch (arm) {
    case Arm::kResident:
      set(resident, true);
      break;
    case Arm::kGraph:
      set(graph, true);
      break;
    case Arm::kEager:
      set(graph, false);
      break;
    case Arm::kHost:
      set(residency, ResidencyMode::kHost);
      set(graph, false);
      break;
    case Arm::kStage:
      set(moe_cache, false);
      break;
  }
}

std::string_view SourceName(Source source) {
  switch (source) {
    case Source::kDefault:
      return "default";
    case Source::kArm:
      return "--arm";
    case Source::kEnv:
      return "env";
    case Source::kImplied:
      return "implied";
  }
  return "";
}

}  // namespace

std::string_view ArmName(Arm arm) {
  switch (arm) {
    case Arm::kResident:
      return "resident";
    case Arm::kGraph:
      return "graph";
    case Arm::kEager:
      return "eager";
    case Arm::kHost:
      return "host";
    case Arm::kStage:
      return "stage";
  }
  return "";
}

absl::StatusOr<Arm> ParseArm(std::string_view text) {
  for (Arm arm : {Arm::kResident, Arm::kGraph, Arm::kEager, Arm::kHost, Arm::kStage}) {
    if (text == ArmName(arm)) return arm;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "--arm '%s' is not one of resident, graph, eager, host, stage", Av(text)));
}

EnvLookup ProcessEnv() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  };
}

absl::StatusOr<ResolvedDoors> ResolveDoors(std::optional<Arm> arm_flag, const EnvLookup& env) {
  Door<bool> graph{true};
  Door<bool> moe_cache{true};
  Door<ResidencyMode> residency{ResidencyMode::kDevice};
  Door<ResidencyPolicy> policy{kDefaultResidencyPolicy};
  Door<double> protected_frac{kDefaultProtectedFrac};
  Door<bool> split_passes{false};
  Door<bool> chained_matvecs{true};
  Door<bool> programmatic_launch{true};
  Door<bool> batched_prefill{true};
  Door<bool> batch_matmul{true};
  Door<bool> amx{true};
  Door<bool> read_overlap{true};
  Door<bool> resident{false};
  if (arm_flag.has_value()) ApplyArm(*arm_flag, graph, moe_cache, residency, resident);
  const std::string arm_text =
      arm_flag.has_value() ? absl::StrCat("--arm ", Av(ArmName(*arm_flag))) : "";
  std::vector<std::string> notes;

  // A set variable wins; where it changes what --arm set, a note says so.
  auto take = [&](auto& door, auto value, std::string_view name, std::string_view text) {
    if (door.source == Source::kArm && door.value != value) {
      notes.push_back(absl::StrFormat("%s=%s from the environment overrides %s", Av(name),
                                      Av(text), arm_text));
    }
    door.value = value;
    door.source = Source::kEnv;
  };
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_graph, ReadBool(env, kGraphVar));
  if (env_graph.has_value()) take(graph, *env_graph, kGraphVar, *env_graph ? "1" : "0");
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_cache, ReadBool(env, kMoeCacheVar));
  if (env_cache.has_value()) take(moe_cache, *env_cache, kMoeCacheVar, *env_cache ? "1" : "0");
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_split, ReadBool(env, kSplitPassesVar));
  if (env_split.has_value()) {
    take(split_passes, *env_split, kSplitPassesVar, *env_split ? "1" : "0");
  }
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_chain, ReadBool(env, kChainVar));
  if (env_chain.has_value()) take(chained_matvecs, *env_chain, kChainVar, *env_chain ? "1" : "0");
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_pdl, ReadBool(env, kPdlVar));
  if (env_pdl.has_value()) take(programmatic_launch, *env_pdl, kPdlVar, *env_pdl ? "1" : "0");
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_batch, ReadBool(env, kBatchMatMulVar));
  if (env_batch.has_value()) {
    take(batch_matmul, *env_batch, kBatchMatMulVar, *env_batch ? "1" : "0");
  }
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_amx, ReadBool(env, kAmxVar));
  if (env_amx.has_value()) take(amx, *env_amx, kAmxVar, *env_amx ? "1" : "0");
  MG_ASSIGN_OR_RETURN(const std::optional<bool> env_overlap, ReadBool(env, kReadOverlapVar));
  if (env_overlap.has_value()) {
    take(read_overlap, *env_overlap, kReadOverlapVar, *env_overlap ? "1" : "0");
  }
  if (const std::optional<std::string> text = env(kPrefillVar); text.has_value()) {
    if (*text != "batched" && *text != "steps") {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s='%s' must be batched or steps", Av(kPrefillVar), *text));
    }
    take(batched_prefill, *text == "batched", kPrefillVar, *text);
  }
  if (const std::optional<std::string> text = env(kResidencyVar); text.has_value()) {
    if (*text != "device" && *text != "host") {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s='%s' must be device or host", Av(kResidencyVar), *text));
    }
    take(residency, *text == "host" ? ResidencyMode::kHost : ResidencyMode::kDevice,
         kResidencyVar, *text);
  }
  if (const std::optional<std::string> text = env(kPolicyVar); text.has_value()) {
    MG_ASSIGN_OR_RETURN(const ResidencyPolicy parsed, ParseResidencyPolicy(*text, kPolicyVar));
    take(policy, parsed, kPolicyVar, *text);
  }
  if (const std::optional<std::string> text = env(kProtectedFracVar); text.has_value()) {
    double frac = 0;
    if (!absl::SimpleAtod(*text, &frac) || !(frac >= 0.0 && frac < 1.0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s='%s' must be a number in [0, 1)", Av(kProtectedFracVar), *text));
    }
    take(protected_frac, frac, kProtectedFracVar, *text);
  }

  // The host arm reads the selection back after the router: it cannot run inside a graph.
  if (residency.value == ResidencyMode::kHost) {
    if (!moe_cache.value) {
      if (residency.source == Source::kEnv && moe_cache.source == Source::kEnv) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s=host and %s=0 contradict each other (host residency needs the cache)",
            Av(kResidencyVar), Av(kMoeCacheVar)));
      }
      // One of them came from --arm: the environment's wins.
      if (moe_cache.source == Source::kEnv) {
        residency = {ResidencyMode::kDevice, Source::kImplied};
        notes.push_back(absl::StrFormat("%s=0 from the environment overrides %s",
                                        Av(kMoeCacheVar), arm_text));
      } else {
        moe_cache = {true, Source::kImplied};
        notes.push_back(absl::StrFormat("%s=host from the environment overrides %s",
                                        Av(kResidencyVar), arm_text));
      }
    }
  }
  if (residency.value == ResidencyMode::kHost && graph.value) {
    if (graph.source == Source::kEnv && residency.source == Source::kEnv) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s=host runs eager only: it contradicts %s=1", Av(kResidencyVar), Av(kGraphVar)));
    }
    if (graph.source == Source::kEnv) {
      // --arm host, overruled by MOEGRAPH_GRAPH=1: the device arm in a graph.
      residency = {ResidencyMode::kDevice, Source::kImplied};
    } else {
      graph = {false, Source::kImplied};
      notes.push_back(absl::StrFormat("%s=host implies %s=0 (host readback runs eager)",
                                      Av(kResidencyVar), Av(kGraphVar)));
    }
  }
  if (resident.value && (!moe_cache.value || residency.value == ResidencyMode::kHost)) {
    resident.value = false;
    notes.push_back(absl::StrFormat("the environment's doors override %s", arm_text));
  }

  ResolvedDoors out;
  Doors& d = out.doors;
  d.graph = graph.value;
  d.moe_cache = moe_cache.value;
  d.residency = residency.value;
  d.policy = policy.value;
  d.protected_frac = protected_frac.value;
  d.split_passes = split_passes.value;
  d.chained_matvecs = chained_matvecs.value;
  d.programmatic_launch = programmatic_launch.value;
  d.batched_prefill = batched_prefill.value;
  d.batch_matmul = batch_matmul.value;
  d.amx = amx.value;
  d.read_overlap = read_overlap.value;
  d.resident = resident.value;
  if (!d.moe_cache) {
    out.arm = Arm::kStage;
  } else if (d.residency == ResidencyMode::kHost) {
    out.arm = Arm::kHost;
  } else if (d.resident) {
    out.arm = Arm::kResident;
  } else {
    out.arm = d.graph ? Arm::kGraph : Arm::kEager;
  }

  const std::vector<std::string> doors = {
      absl::StrFormat("%s=%d (%s)", Av(kGraphVar), d.graph ? 1 : 0, Av(SourceName(graph.source))),
      absl::StrFormat("%s=%d (%s)", Av(kMoeCacheVar), d.moe_cache ? 1 : 0,
                      Av(SourceName(moe_cache.source))),
      absl::StrFormat("%s=%s (%s)", Av(kResidencyVar),
                      d.residency == ResidencyMode::kHost ? "host" : "device",
                      Av(SourceName(residency.source))),
      absl::StrFormat("%s=%s (%s)", Av(kPolicyVar), Av(PolicyName(d.policy)),
                      Av(SourceName(policy.source))),
      absl::StrFormat("%s=%.2f (%s)", Av(kProtectedFracVar), d.protected_frac,
                      Av(SourceName(protected_frac.source))),
      absl::StrFormat("%s=%d (%s)", Av(kSplitPassesVar), d.split_passes ? 1 : 0,
                      Av(SourceName(split_passes.source))),
      absl::StrFormat("%s=%d (%s)", Av(kChainVar), d.chained_matvecs ? 1 : 0,
                      Av(SourceName(chained_matvecs.source))),
      absl::StrFormat("%s=%d (%s)", Av(kPdlVar), d.programmatic_launch ? 1 : 0,
                      Av(SourceName(programmatic_launch.source))),
      absl::StrFormat("%s=%s (%s)", Av(kPrefillVar), d.batched_prefill ? "batched" : "steps",
                      Av(SourceName(batched_prefill.source))),
      absl::StrFormat("%s=%d (%s)", Av(kBatchMatMulVar), d.batch_matmul ? 1 : 0,
                      Av(SourceName(batch_matmul.source))),
      absl::StrFormat("%s=%d (%s)", Av(kAmxVar), d.amx ? 1 : 0, Av(SourceName(amx.source))),
      absl::StrFormat("%s=%d (%s)", Av(kReadOverlapVar), d.read_overlap ? 1 : 0,
                      Av(SourceName(read_overlap.source))),
  };
  out.banner = absl::StrCat("doors: arm ", Av(ArmName(out.arm)), "; ", absl::StrJoin(doors, ", "));
  for (const std::string& note : notes) absl::StrAppend(&out.banner, "\ndoors: ", note);
  out.all_default = notes.empty();
  for (const Source source :
       {graph.source, moe_cache.source, residency.source, policy.source, protected_frac.source,
        split_passes.source, chained_matvecs.source, programmatic_launch.source, batched_prefill.source,
        batch_matmul.source, amx.source, read_overlap.source, resident.source}) {
    out.all_default = out.all_default && source == Source::kDefault;
  }
  return out;
}

}  // namespace moegraph
