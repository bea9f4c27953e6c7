// The one way a kernel is launched: launch_kernel<kernel>(grid, block, stream,
// args...) is kernel<<<grid, block, 0, stream>>>(args...) under nvcc, and the CPU
// emulator's launch when the .cu files are compiled as C++ against emulator/
// (the emulated tree, docs/EMULATOR.md). Returns the launch's error, as
// cudaGetLastError() right after <<<...>>> does.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

// A device function kept out of line: an epilogue that runs in one block of a
// launch, whose registers must not count against the kernel's main loop.
#if defined(__CUDACC__)
#define MG_NOINLINE __noinline__
#else
#define MG_NOINLINE
#endif

namespace moegraph {

template <auto Kernel, typename... Args>
inline cudaError_t launch_kernel(dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
#if defined(__CUDACC__)
  Kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
#else
  moegraph_emu::Launch<Kernel>(grid, block, stream, std::forward<Args>(args)...);
#endif
  return cudaGetLastError();
}

}  // namespace moegraph
