// The gates moegraph-gates runs (docs/GATES.md says what each proves and which
// counter anchors it), and the assertions they make, exposed so the tests can
// feed them outcomes a working engine never produces.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "capture/engine.h"
#include "gates/counters.h"
#include "gates/engines.h"
#include "gates/gate.h"

namespace moegraph {

// Every gate, in the order the harness runs them.
std::vector<Gate> AllGates();

// cache-bit-identity's assertion: the same tokens and the same logit bits from
// the cache arm and the stage arm (MOEGRAPH_MOE_CACHE=0), with hits, misses and
// evictions all moved on the cache arm, and on the stage arm every selected
// expert staged (selected_per_step experts per step) and nothing hit or evicted.
GateResult CheckCacheBitIdentity(const Transcript& cached, const Transcript& staged,
                                 const CounterValues& cache_delta, const CounterValues& stage_delta,
                                 uint64_t selected_per_step);

// OK when every array of the two states is equal; otherwise the first
// difference, naming the array and the index.
absl::Status CompareResidency(const ResidencySnapshot& engine, const ResidencySnapshot& replay);

// sum (got - want)^2 / sum want^2 (the plain sum when want is all zeros).
double Nmse(const std::vector<float>& got, const std::vector<float>& want);

}  // namespace moegraph
