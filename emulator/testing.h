// Hooks for the emulator's own tests (tests/emulator_test.cc).
#pragma once

#include <cstdint>

namespace moegraph_emu {

// Restarts the seeded generator as a process started with MOEGRAPH_EMU_SEED=seed.
void ReseedForTesting(uint64_t seed);

}  // namespace moegraph_emu
