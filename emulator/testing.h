// Hooks for tests: the emulator's own (tests/emulator_test.cc) and those that
// hold the engine's launches to a description of them (tests/walk_shape_test.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace moegraph_emu {

// Restarts the seeded generator as a process started with MOEGRAPH_EMU_SEED=seed.
void ReseedForTesting(uint64_t seed);

// A kernel launch as the host made it: the kernel's name (KernelName: the
// function and its template argument as GCC spells them, no qualifiers, as in
// "grouped_matvec_kernel<kQ4_K>"), its grid and its block.
struct RecordedLaunch {
  std::string kernel;
  dim3 grid;
  dim3 block;
};

// While a recorder lives, every kernel launch the device accepts, enqueued on a
// stream or added to a stream capture, is recorded in the order the host made
// it. One recorder at a time.
class LaunchRecorder {
 public:
  LaunchRecorder();
  ~LaunchRecorder();
  LaunchRecorder(const LaunchRecorder&) = delete;
  LaunchRecorder& operator=(const LaunchRecorder&) = delete;

  std::vector<RecordedLaunch> launches() const;

 private:
  std::vector<RecordedLaunch> launches_;
};

}  // namespace moegraph_emu
