// The gpusim harnesses' copies to and from the device (errors surface at the
// launch or the output check: a harness is a measurement, not a test).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace moegraph {

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* device = nullptr;
  cudaMalloc(&device, host.size() * sizeof(T));
  cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return device;
}

template <typename T>
std::vector<T> Download(const T* device, size_t n) {
  std::vector<T> host(n);
  cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

}  // namespace moegraph
