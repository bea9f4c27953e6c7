// The engine's doors: environment switches that turn one piece of the design
// off, read once at engine start and printed in the start-up banner. `--arm` is
// their command-line twin; a door set in the environment wins over it.
//
//   MOEGRAPH_GRAPH=0          eager walk (same launches, no graph)
//   MOEGRAPH_MOE_CACHE=0      stage every selected expert every step (no residency)
//   MOEGRAPH_RESIDENCY=host   host-readback arm: sync after the router, host policy
//   MOEGRAPH_POLICY=hazard|slru|lru  the residency policy
//   MOEGRAPH_PROTECTED_FRAC   slru's protected share of the slots, in [0, 1)
//   MOEGRAPH_SPLIT_PASSES=1   hits before the copies join, misses after (two passes)
//   MOEGRAPH_CHAIN=0          attn_out and the router, and the one expert pass's
//                             gate/up and down, as two launches each
//   MOEGRAPH_PDL=0            kernels launched without programmatic dependent launch
//   MOEGRAPH_BATCH_MATMUL=0   the CPU backend's prompts in ggml's per-row order
//   MOEGRAPH_AMX=0            the CPU backend's prompts without AMX tiles
//   MOEGRAPH_READ_OVERLAP=0   the disk tier's misses all read before a row's experts run
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "residency/policy_cache.h"

namespace moegraph {

// The benchmark arms of the design: one engine, the doors set per arm.
enum class Arm { kResident, kGraph, kEager, kHost, kStage };

std::string_view ArmName(Arm arm);  // "resident" | "graph" | "eager" | "host" | "stage"
// Parses --arm; the error names the flag and lists the arms.
absl::StatusOr<Arm> ParseArm(std::string_view text);

enum class ResidencyMode { kDevice, kHost };

struct Doors {
  bool graph = true;       // MOEGRAPH_GRAPH
  bool moe_cache = true;   // MOEGRAPH_MOE_CACHE
  ResidencyMode residency = ResidencyMode::kDevice;  // MOEGRAPH_RESIDENCY
  ResidencyPolicy policy = kDefaultResidencyPolicy;  // MOEGRAPH_POLICY
  double protected_frac = kDefaultProtectedFrac;     // MOEGRAPH_PROTECTED_FRAC
  bool split_passes = false;                         // MOEGRAPH_SPLIT_PASSES
  bool chained_matvecs = true;                       // MOEGRAPH_CHAIN
  bool programmatic_launch = true;                   // MOEGRAPH_PDL (sm_90 and later)
  // MOEGRAPH_PREFILL: batched (a prompt in ubatches, capture/engine_prefill.cc)
  // or steps (one T=1 decode step per prompt token, the rollback).
  bool batched_prefill = true;
  // MOEGRAPH_BATCH_MATMUL: the CPU backend's q8_0 and q4_K prompt products in
  // the batch kernels' order (CpuForwardOptions::batch_matmul).
  bool batch_matmul = true;
  // MOEGRAPH_AMX: those products on AMX tiles where the CPU has them, else on
  // AVX-512 VNNI, the same bits (CpuForwardOptions::amx).
  bool amx = true;
  // MOEGRAPH_READ_OVERLAP: the CPU backend computes a row's experts as the
  // disk tier's reads bring them, the ones it has first
  // (CpuForwardOptions::overlap_reads).
  bool read_overlap = true;
  bool resident = false;   // every expert on the device (--arm resident only)

};

struct ResolvedDoors {
  Doors doors;
  Arm arm = Arm::kGraph;  // the arm the doors amount to
  // Multi-line: one line per door with its value and where it came from
  // (default, --arm, env), then a line per override or implied change.
  std::string banner;
  // Every door at its default, nothing implied or overridden: the banner says
  // nothing a user did not already know.
  bool all_default = false;
};

// An environment: the value of a variable, or nullopt when it is unset. An empty
// value counts as unset.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The process environment (getenv).
EnvLookup ProcessEnv();

// Doors from the --arm flag (nullopt: not given) and the environment. Pure.
// Errors name the variable and the values it takes ("MOEGRAPH_GRAPH='yes' must
// be 0 or 1"), or the two variables that contradict each other when both are set
// in the environment (MOEGRAPH_RESIDENCY=host with MOEGRAPH_GRAPH=1 or with
// MOEGRAPH_MOE_CACHE=0). Where a set variable contradicts --arm, the variable
// wins and the banner says so.
absl::StatusOr<ResolvedDoors> ResolveDoors(std::optional<Arm> arm_flag, const EnvLookup& env);

}  // namespace moegraph
