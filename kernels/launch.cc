// The thread's programmatic-launch scope (kernels/kernels.h), read by
// launch_kernel (kernels/launch.cuh) at every launch.
#include "kernels/kernels.h"

namespace moegraph {
namespace {

thread_local uint64_t* open_counter = nullptr;

}  // namespace

ProgrammaticLaunchScope::ProgrammaticLaunchScope(uint64_t* counter) : previous_(open_counter) {
  open_counter = counter;
}

ProgrammaticLaunchScope::~ProgrammaticLaunchScope() { open_counter = previous_; }

uint64_t* programmatic_launch_counter() { return open_counter; }

}  // namespace moegraph
