// The prefill's GEMM (kernels/gemm.h): a q4_K weight dequantized to f16 on the
// device, times the f16 activations of several tokens, against the host's
// product of the same f16 values in double.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/dequant.h"
#include "kernels/gemm.h"
#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "tests/cuda_test_util.h"

namespace moegraph {
namespace {

class GemmGpuTest : public testing_util::CudaStreamTest {
 protected:
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    CudaStreamTest::TearDown();
  }
  template <typename T>
  T* Upload(const std::vector<T>& values) {
    void* device = nullptr;
    EXPECT_EQ(cudaMalloc(&device, values.size() * sizeof(T)), cudaSuccess);
    allocations_.push_back(device);
    EXPECT_EQ(cudaMemcpy(device, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    return static_cast<T*>(device);
  }
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::vector<void*> allocations_;
};

// W x for 7 tokens, then accumulated once more: within f32 summation's error of
// the double product of the very f16 values the device multiplies.
TEST_F(GemmGpuTest, AQ4KWeightTimesSevenTokensEqualsTheHostProduct) {
  constexpr int32_t rows = 96, cols = 512, tokens = 7;
  std::mt19937 rng(21);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> w(rows * cols), x(tokens * cols);
  for (float& v : w) v = gaussian(rng);
  for (float& v : x) v = gaussian(rng);
  std::vector<uint8_t> packed(ggml_row_size(GgmlType::kQ4_K, cols) * rows);
  quantize_row(GgmlType::kQ4_K, w.data(), packed.data(), rows * cols);

  const uint8_t* d_packed = Upload(packed);
  const float* d_x = Upload(x);
  uint16_t* d_w16 = Upload(std::vector<uint16_t>(rows * cols));
  uint16_t* d_x16 = Upload(std::vector<uint16_t>(tokens * cols));
  float* d_y = Upload(std::vector<float>(tokens * rows, -1.0f));
  ASSERT_EQ(launch_dequantize_f16(GgmlType::kQ4_K, d_packed, d_w16, rows * cols, stream_),
            cudaSuccess);
  ASSERT_EQ(launch_dequantize_f16(GgmlType::kF32, d_x, d_x16, tokens * cols, stream_), cudaSuccess);
  GemmRunner gemm;
  ASSERT_EQ(gemm.Init(), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(gemm.Multiply(GemmType::kF16, d_w16, rows, cols, d_x16, tokens, d_y, false, stream_),
            CUBLAS_STATUS_SUCCESS);
  Sync();
  const std::vector<float> y = Download(d_y, tokens * rows);

  std::vector<float> dequantized(rows * cols);
  ASSERT_TRUE(dequantize_row(GgmlType::kQ4_K, packed.data(), dequantized.data(), rows * cols));
  const std::vector<uint16_t> w16 = Download(d_w16, rows * cols);
  const std::vector<uint16_t> x16 = Download(d_x16, tokens * cols);
  double worst = 0.0;
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t r = 0; r < rows; ++r) {
      double acc = 0.0, magnitude = 0.0;
      for (int32_t c = 0; c < cols; ++c) {
        ASSERT_EQ(w16[r * cols + c], f32_to_f16(dequantized[r * cols + c]));
        const double product =
            double{f16_to_f32(w16[r * cols + c])} * f16_to_f32(x16[t * cols + c]);
        acc += product;
        magnitude += std::abs(product);
      }
      ASSERT_EQ(x16[t * cols], f32_to_f16(x[t * cols]));
      // f32 summation of cols terms: at most about cols ulps of the magnitude.
      const double error = std::abs(y[t * rows + r] - acc) / magnitude;
      worst = std::max(worst, error);
    }
  }
  EXPECT_LT(worst, cols * 6e-8);

  ASSERT_EQ(gemm.Multiply(GemmType::kF16, d_w16, rows, cols, d_x16, tokens, d_y, true, stream_),
            CUBLAS_STATUS_SUCCESS);
  Sync();
  const std::vector<float> twice = Download(d_y, tokens * rows);
  for (size_t i = 0; i < y.size(); ++i)
    EXPECT_NEAR(twice[i], 2 * y[i], 1e-4 * std::abs(y[i]) + 1e-5);
}

// f32 operands (an f32 weight): the double product within f32 summation's
// error, for two token counts of one runner (a plan per shape).
TEST_F(GemmGpuTest, AnF32WeightTimesTokensEqualsTheHostProduct) {
  constexpr int32_t rows = 40, cols = 96;
  std::mt19937 rng(5);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> w(rows * cols), x(9 * cols);
  for (float& v : w) v = gaussian(rng);
  for (float& v : x) v = gaussian(rng);
  const float* d_w = Upload(w);
  const float* d_x = Upload(x);
  GemmRunner gemm;
  ASSERT_EQ(gemm.Init(), CUBLAS_STATUS_SUCCESS);
  for (int32_t tokens : {9, 2}) {
    float* d_y = Upload(std::vector<float>(tokens * rows, -1.0f));
    ASSERT_EQ(gemm.Multiply(GemmType::kF32, d_w, rows, cols, d_x, tokens, d_y, false, stream_),
              CUBLAS_STATUS_SUCCESS);
    Sync();
    const std::vector<float> y = Download(d_y, tokens * rows);
    for (int32_t t = 0; t < tokens; ++t) {
      for (int32_t r = 0; r < rows; ++r) {
        double acc = 0.0, magnitude = 0.0;
        for (int32_t c = 0; c < cols; ++c) {
          const double product = double{w[r * cols + c]} * x[t * cols + c];
          acc += product;
          magnitude += std::abs(product);
        }
        EXPECT_LT(std::abs(y[t * rows + r] - acc), cols * 6e-8 * magnitude) << t << " " << r;
      }
    }
  }
}

TEST_F(GemmGpuTest, AnUninitializedRunnerOrBadArgumentsAreRefused) {
  GemmRunner gemm;
  uint16_t* d = Upload(std::vector<uint16_t>(16));
  float* y = Upload(std::vector<float>(16));
  EXPECT_EQ(gemm.Multiply(GemmType::kF16, d, 4, 4, d, 1, y, false, stream_),
            CUBLAS_STATUS_NOT_INITIALIZED);
  ASSERT_EQ(gemm.Init(), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(gemm.Multiply(GemmType::kF16, nullptr, 4, 4, d, 1, y, false, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm.Multiply(GemmType::kF16, d, 0, 4, d, 1, y, false, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm.Multiply(GemmType::kF16, d, 4, 4, d, 0, y, false, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm.Multiply(GemmType::kF16, d, 4, 4, d, 1, y, false, stream_), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
}  // namespace moegraph
