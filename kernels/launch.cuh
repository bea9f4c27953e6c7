// The one way a kernel is launched: launch_kernel<kernel>(grid, block, stream,
// args...) is cudaLaunchKernelEx under nvcc and the CPU emulator's launch when
// the .cu files are compiled as C++ against emulator/ (the emulated tree,
// docs/EMULATOR.md). Inside a ProgrammaticLaunchScope (kernels/kernels.h) the
// launch carries programmatic stream serialization. Returns the launch's error,
// as cudaGetLastError() right after <<<...>>> does.
//
// Every kernel starts with wait_for_prior_grids(), before its first global
// load or store: a kernel launched programmatically may start before the one
// it follows has finished (tests/kernel_shape_test.py checks the order in the
// PTX of every kernel).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "kernels/kernels.h"

namespace moegraph {

// Waits until the grids this one depends on have finished and their writes are
// visible (a no-op when it was not launched programmatically), then lets the
// next kernel in the stream start its blocks: they wait here in their turn, so
// the early start costs no ordering. In the emulator every kernel starts after
// the one before it has finished: nothing to wait for.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// wait_for_prior_grids, except that a kernel which overlaps the one before it
// (the expert pass after the stage copy: kernels/copy_ready.cuh) lets the next
// kernel start without waiting itself. What it reads of earlier kernels is
// ready: the kernel before it started its blocks only after its own wait.
__device__ __forceinline__ void wait_for_prior_grids_unless(
    [[maybe_unused]] bool overlaps_prior) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!overlaps_prior) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <auto Kernel, typename... Args>
inline cudaError_t launch_kernel(dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  uint64_t* const programmatic = programmatic_launch_counter();
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic != nullptr ? 1 : 0;
#if defined(__CUDACC__)
  cudaError_t err = cudaLaunchKernelEx(&config, Kernel, std::forward<Args>(args)...);
#else
  cudaError_t err = moegraph_emu::LaunchEx<Kernel>(&config, std::forward<Args>(args)...);
#endif
  const cudaError_t last = cudaGetLastError();  // consumed, as after <<<...>>>
  if (err == cudaSuccess) err = last;
  if (err == cudaSuccess && programmatic != nullptr) ++*programmatic;
  return err;
}

}  // namespace moegraph
