// Small kernels the CUDA test files share (.cu files, or the emulated tree's
// tests compiled with the device side force-included).
#pragma once

namespace moegraph::testing_util {

__global__ void fill_kernel(int* out, int n, int value) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = value;
}

__global__ void copy_kernel(const int* in, int* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i];
}

}  // namespace moegraph::testing_util
