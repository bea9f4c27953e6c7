// MG_HD marks math and decision code shared by the CPU and CUDA builds: the same
// function runs in the oracle, the CPU backend and the kernels.
#pragma once

#if defined(__CUDACC__)
#define MG_HD __host__ __device__
#else
#define MG_HD
#endif

// For the per-thread functions the kernels must inline (a call would spill).
#if defined(__CUDACC__)
#define MG_HD_INLINE __host__ __device__ __forceinline__
#else
#define MG_HD_INLINE inline
#endif
