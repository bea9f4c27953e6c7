// The dequant kernel against the CPU: ggml's golden blocks and random blocks,
// dequantized on the device, must equal the CPU's floats bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "kernels/dequant.h"
#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

struct TypeCase {
  GgmlType type;
  const char* name;            // ggml's name, the golden file stem
  bool in_tests_data = false;  // tests/data/golden/quant, else the shared folder
};

const TypeCase kCases[] = {
    {GgmlType::kF32, "f32"},
    {GgmlType::kF16, "f16"},
    {GgmlType::kBF16, "bf16"},
    {GgmlType::kQ8_0, "q8_0"},
    {GgmlType::kQ4_0, "q4_0"},
    {GgmlType::kQ4_K, "q4_K"},
    {GgmlType::kQ5_K, "q5_K"},
    {GgmlType::kQ6_K, "q6_K"},
    {GgmlType::kQ4_1, "q4_1", true},
    {GgmlType::kQ5_0, "q5_0", true},
    {GgmlType::kQ5_1, "q5_1", true},
    {GgmlType::kQ2_K, "q2_K", true},
    {GgmlType::kQ3_K, "q3_K", true},
    {GgmlType::kIQ4_NL, "iq4_nl", true},
    {GgmlType::kIQ4_XS, "iq4_xs", true},
    {GgmlType::kMXFP4, "mxfp4", true},
};

class DequantGpuTest : public testing_util::CudaStreamTest {
 protected:
  // Dequantizes bytes (n elements of type) on the device.
  std::vector<float> DequantizeOnDevice(GgmlType type, const std::vector<uint8_t>& bytes,
                                        int64_t n) {
    void* src = nullptr;
    void* dst = nullptr;
    std::vector<float> out(n, -1.0f);
    EXPECT_EQ(cudaMalloc(&src, bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&dst, n * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(src, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    EXPECT_EQ(launch_dequantize(type, src, static_cast<float*>(dst), n, stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(out.data(), dst, n * sizeof(float), cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaFree(src);
    cudaFree(dst);
    return out;
  }

  // The same to f16 bits.
  std::vector<uint16_t> DequantizeOnDeviceF16(GgmlType type, const std::vector<uint8_t>& bytes,
                                              int64_t n) {
    void* src = nullptr;
    void* dst = nullptr;
    std::vector<uint16_t> out(n, 0xffff);
    EXPECT_EQ(cudaMalloc(&src, bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&dst, n * sizeof(uint16_t)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(src, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(launch_dequantize_f16(type, src, static_cast<uint16_t*>(dst), n, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), dst, n * sizeof(uint16_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    cudaFree(src);
    cudaFree(dst);
    return out;
  }

  void ExpectSameAsCpu(GgmlType type, const std::vector<uint8_t>& bytes, int64_t n) {
    std::vector<float> cpu(n);
    ASSERT_TRUE(dequantize_row(type, bytes.data(), cpu.data(), n));
    const std::vector<float> gpu = DequantizeOnDevice(type, bytes, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_to_bits(gpu[i]), f32_to_bits(cpu[i]))
          << "element " << i << ": gpu " << gpu[i] << ", cpu " << cpu[i];
    }
    const std::vector<uint16_t> half = DequantizeOnDeviceF16(type, bytes, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(half[i], f32_to_f16(cpu[i])) << "element " << i << " as f16: cpu " << cpu[i];
    }
  }
};

TEST_F(DequantGpuTest, GoldenBlocksMatchCpu) {
  for (const TypeCase& c : kCases) {
    if (c.type == GgmlType::kF32) continue;  // the golden set has no f32 file
    SCOPED_TRACE(c.name);
    const std::string file = "golden/quant/" + std::string(c.name) + ".quant";
    const std::string path = c.in_tests_data
                                 ? std::string(MOEGRAPH_SOURCE_DIR) + "/tests/data/" + file
                                 : testing_util::SharedPath(file);
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in) << "cannot open golden file " << path;
    const std::vector<uint8_t> bytes(std::istreambuf_iterator<char>(in), {});
    const size_t row_bytes = ggml_row_size(c.type, 1024);
    ASSERT_EQ(bytes.size() % row_bytes, 0u) << path;
    ExpectSameAsCpu(c.type, bytes, static_cast<int64_t>(bytes.size() / row_bytes) * 1024);
  }
}

TEST_F(DequantGpuTest, RandomRowsMatchCpuAcrossGridSizes) {
  std::mt19937 rng(99);
  std::normal_distribution<float> gaussian(0.0f, 0.5f);
  for (const TypeCase& c : kCases) {
    const int64_t block_elems = quant_block_elems(c.type);
    // 1 block, a partial thread block, and more than one full thread block.
    for (int64_t blocks : {1, 37, 257, 1000}) {
      const int64_t n = blocks * block_elems;
      SCOPED_TRACE(std::string(c.name) + " n=" + std::to_string(n));
      std::vector<float> x(n);
      for (float& v : x) v = gaussian(rng);
      std::vector<uint8_t> bytes(ggml_row_size(c.type, n));
      quantize_row(c.type, x.data(), bytes.data(), n);
      ExpectSameAsCpu(c.type, bytes, n);
    }
  }
}

TEST_F(DequantGpuTest, LauncherRejectsBadArguments) {
  EXPECT_EQ(launch_dequantize(GgmlType::kIQ2_XXS, nullptr, nullptr, 256, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_dequantize(GgmlType::kQ4_K, nullptr, nullptr, 100, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_dequantize(GgmlType::kQ8_0, nullptr, nullptr, 0, stream_), cudaSuccess);
  EXPECT_EQ(launch_dequantize_f16(GgmlType::kIQ2_XXS, nullptr, nullptr, 256, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_dequantize_f16(GgmlType::kQ4_K, nullptr, nullptr, 100, stream_),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moegraph
