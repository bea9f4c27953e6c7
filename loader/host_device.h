// MG_HD marks math and decision code shared by the CPU and CUDA builds: the same
// function runs in the oracle, the CPU backend and the kernels.
#pragma once

#if defined(__CUDACC__)
#define MG_HD __host__ __device__
#else
#define MG_HD
#endif
