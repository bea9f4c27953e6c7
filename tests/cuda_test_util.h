// Helpers for the tests that call the CUDA runtime themselves. Apart from
// tests/test_util.h, which stays CUDA-free for the sanitizer tree.
#pragma once

#include <gtest/gtest.h>

#include <iostream>

#include <cuda_runtime_api.h>

namespace moegraph::testing_util {

// After a failed test: the device's name, which under the CPU emulator carries
// the MOEGRAPH_EMU_SEED the failure reproduces with.
inline void PrintDeviceOnFailure() {
  if (!::testing::Test::HasFailure()) return;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) std::cerr << "device: " << prop.name << "\n";
  cudaGetLastError();
}

// A test with its own CUDA stream; skips, with the runtime's answer, where there
// is no device.
class CudaStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned " << cudaGetErrorString(err)
                   << ", " << count << " devices";
    }
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    PrintDeviceOnFailure();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

  cudaStream_t stream_ = nullptr;
};

}  // namespace moegraph::testing_util
