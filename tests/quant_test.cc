// Block formats against ggml: layouts, f16/bf16 conversion, and golden vectors
// made by ggml itself ($MOEGRAPH_SHARED/golden/quant, see its README.md; the types
// beyond it in tests/data/golden/quant, made by llama.cpp v0.5.0's ggml from the
// same input by tools/llama-crosscheck/golden-quant.sh).
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::ReadFileToString;
using testing_util::SharedPath;

constexpr int kGoldenRows = 6;
constexpr int kGoldenCols = 1024;

struct TypeCase {
  GgmlType type;
  const char* name;             // ggml's name, also the golden file stem
  size_t golden_row_bytes;      // README's table, for 1024 elements
  double readme_rmse_row0;      // README's ggml rel. RMSE on rows 0 and 1
  double readme_rmse_row1;
  double random_rmse_bound;     // round trip on gaussian data
  bool in_tests_data = false;   // tests/data/golden/quant, else the shared folder
};

const TypeCase kGoldenCases[] = {
    {GgmlType::kF16, "f16", 2048, 1.97e-4, 2.22e-4, 4e-4},
    {GgmlType::kBF16, "bf16", 2048, 1.67e-3, 1.76e-3, 3e-3},
    {GgmlType::kQ8_0, "q8_0", 1088, 5.30e-3, 3.86e-3, 8e-3},
    {GgmlType::kQ4_0, "q4_0", 576, 8.27e-2, 6.72e-2, 0.12},
    {GgmlType::kQ4_K, "q4_K", 576, 6.95e-2, 5.67e-2, 0.10},
    {GgmlType::kQ5_K, "q5_K", 704, 3.56e-2, 2.83e-2, 0.05},
    {GgmlType::kQ6_K, "q6_K", 840, 1.73e-2, 1.38e-2, 0.025},
    {GgmlType::kQ4_1, "q4_1", 640, 7.57e-2, 6.32e-2, 0.11, true},
    {GgmlType::kQ5_0, "q5_0", 704, 4.07e-2, 3.26e-2, 0.06, true},
    {GgmlType::kQ5_1, "q5_1", 768, 3.69e-2, 3.03e-2, 0.055, true},
    {GgmlType::kQ2_K, "q2_K", 336, 2.88e-1, 2.34e-1, 0.40, true},
    {GgmlType::kQ3_K, "q3_K", 440, 1.46e-1, 1.26e-1, 0.21, true},
    {GgmlType::kIQ4_NL, "iq4_nl", 576, 7.42e-2, 6.61e-2, 0.11, true},
    {GgmlType::kIQ4_XS, "iq4_xs", 544, 7.48e-2, 6.67e-2, 0.11, true},
    {GgmlType::kMXFP4, "mxfp4", 544, 1.16e-1, 1.23e-1, 0.17, true},
};

// A missing golden file fails the test (it is part of the spec, not optional).
std::vector<uint8_t> ReadGolden(const std::string& file, bool in_tests_data = false) {
  const std::string path =
      in_tests_data ? std::string(MOEGRAPH_SOURCE_DIR) + "/tests/data/golden/quant/" + file
                    : SharedPath("golden/quant/" + file);
  const std::string bytes = ReadFileToString(path);
  if (bytes.empty()) ADD_FAILURE() << "cannot read golden file " << path;
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

std::vector<float> AsFloats(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

double RelRmse(const float* out, const float* in, int64_t n) {
  double err = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += (static_cast<double>(out[i]) - in[i]) * (static_cast<double>(out[i]) - in[i]);
    ref += static_cast<double>(in[i]) * in[i];
  }
  return std::sqrt(err / ref);
}

// ggml's float-arithmetic conversions (ggml-impl.h, after Maratyszcza/FP16), the
// independent oracle for our integer versions.
float GgmlFp16ToFp32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xe0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized_value = f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = f32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result = sign | (two_w < denormalized_cutoff ? f32_to_bits(denormalized_value)
                                                              : f32_to_bits(normalized_value));
  return f32_from_bits(result);
}

uint16_t GgmlFp32ToFp16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

TEST(QuantLayout, BlockStructsMatchGgml) {
  static_assert(sizeof(block_q8_0) == 34);
  static_assert(sizeof(block_q4_0) == 18);
  static_assert(sizeof(block_q4_K) == 144);
  static_assert(sizeof(block_q5_K) == 176);
  static_assert(sizeof(block_q6_K) == 210);
  static_assert(QK8_0 == 32 && QK4_0 == 32 && QK_K == 256 && K_SCALE_SIZE == 12);
  // Field order, not just size: ggml-common.h's offsets.
  EXPECT_EQ(offsetof(block_q8_0, qs), 2u);
  EXPECT_EQ(offsetof(block_q4_0, qs), 2u);
  EXPECT_EQ(offsetof(block_q4_K, dmin), 2u);
  EXPECT_EQ(offsetof(block_q4_K, scales), 4u);
  EXPECT_EQ(offsetof(block_q4_K, qs), 16u);
  EXPECT_EQ(offsetof(block_q5_K, qh), 16u);
  EXPECT_EQ(offsetof(block_q5_K, qs), 48u);
  EXPECT_EQ(offsetof(block_q6_K, qh), 128u);
  EXPECT_EQ(offsetof(block_q6_K, scales), 192u);
  EXPECT_EQ(offsetof(block_q6_K, d), 208u);
  EXPECT_EQ(offsetof(block_q4_1, m), 2u);
  EXPECT_EQ(offsetof(block_q4_1, qs), 4u);
  EXPECT_EQ(offsetof(block_q5_0, qh), 2u);
  EXPECT_EQ(offsetof(block_q5_0, qs), 6u);
  EXPECT_EQ(offsetof(block_q5_1, qh), 4u);
  EXPECT_EQ(offsetof(block_q5_1, qs), 8u);
  EXPECT_EQ(offsetof(block_q2_K, qs), 16u);
  EXPECT_EQ(offsetof(block_q2_K, d), 80u);
  EXPECT_EQ(offsetof(block_q2_K, dmin), 82u);
  EXPECT_EQ(offsetof(block_q3_K, qs), 32u);
  EXPECT_EQ(offsetof(block_q3_K, scales), 96u);
  EXPECT_EQ(offsetof(block_q3_K, d), 108u);
  EXPECT_EQ(offsetof(block_iq4_nl, qs), 2u);
  EXPECT_EQ(offsetof(block_iq4_xs, scales_h), 2u);
  EXPECT_EQ(offsetof(block_iq4_xs, scales_l), 4u);
  EXPECT_EQ(offsetof(block_iq4_xs, qs), 8u);
  EXPECT_EQ(offsetof(block_mxfp4, qs), 1u);
}

// The non-linear tables against ggml-common.h's kvalues_iq4nl and kvalues_fp4.
TEST(QuantLayout, ValueTablesMatchGgml) {
  const int iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  const int fp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(kvalue_iq4nl(i), iq4nl[i]) << i;
    EXPECT_EQ(kvalue_mxfp4(i), fp4[i]) << i;
  }
  // ggml_e8m0_to_fp32_half: 2^(e - 128), with e = 0 and 1 subnormal.
  for (int e = 0; e < 255; ++e) EXPECT_EQ(e8m0_to_f32_half(e), std::ldexp(1.0f, e - 128)) << e;
}

TEST(QuantLayout, RowSizesAgreeWithGgmlTypeTable) {
  for (const TypeCase& c : kGoldenCases) {
    SCOPED_TRACE(c.name);
    EXPECT_TRUE(quant_supported(c.type));
    EXPECT_EQ(quant_block_bytes(c.type) * (kGoldenCols / quant_block_elems(c.type)),
              static_cast<int64_t>(c.golden_row_bytes));
    EXPECT_EQ(ggml_row_size(c.type, kGoldenCols), c.golden_row_bytes);
    const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(c.type));
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->name, c.name);
    EXPECT_EQ(info->block_size, quant_block_elems(c.type));
    EXPECT_EQ(static_cast<int64_t>(info->type_size), quant_block_bytes(c.type));
  }
  EXPECT_TRUE(quant_supported(GgmlType::kF32));
  EXPECT_EQ(ggml_row_size(GgmlType::kF32, 3), 12u);
  EXPECT_EQ(ggml_row_size(GgmlType::kQ4_K, 512), 288u);
  for (GgmlType other : {GgmlType::kQ8_1, GgmlType::kQ8_K, GgmlType::kIQ2_XXS, GgmlType::kIQ3_S,
                         GgmlType::kTQ1_0, GgmlType::kNVFP4, GgmlType::kI32}) {
    EXPECT_FALSE(quant_supported(other)) << static_cast<uint32_t>(other);
    EXPECT_EQ(quant_block_elems(other), 0);
  }
}

TEST(HalfConversion, WideningMatchesGgmlForEveryHalf) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint32_t ours = f32_to_bits(f16_to_f32(static_cast<uint16_t>(h)));
    const uint32_t ggml = f32_to_bits(GgmlFp16ToFp32(static_cast<uint16_t>(h)));
    ASSERT_EQ(ours, ggml) << "half 0x" << std::hex << h;
  }
}

TEST(HalfConversion, NarrowingMatchesGgml) {
  auto check = [](uint32_t bits) {
    const float f = f32_from_bits(bits);
    ASSERT_EQ(f32_to_f16(f), GgmlFp32ToFp16(f)) << "float bits 0x" << std::hex << bits;
  };
  // Every half, the floats one ulp around it and the ties halfway to the next half:
  // the rounding boundaries, subnormals, overflow and NaNs included.
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint32_t bits = f32_to_bits(f16_to_f32(static_cast<uint16_t>(h)));
    const uint32_t next = f32_to_bits(f16_to_f32(static_cast<uint16_t>(h + 1)));
    for (uint32_t probe : {bits, bits - 1, bits + 1}) check(probe);
    if ((h & 0x7fff) < 0x7bff) {
      const uint32_t mid = bits + (next - bits) / 2;
      for (uint32_t probe : {mid - 1, mid, mid + 1}) check(probe);
    }
  }
  // A spread over all float bit patterns (the step is odd, so every low bit varies).
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4093) check(static_cast<uint32_t>(bits));
  for (uint32_t bits : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                        0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u, 0x00000001u}) {
    check(bits);
  }
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(0x1.0p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1.0p-25f), 0x0000);  // the tie goes to even
  EXPECT_EQ(f32_to_f16(-std::nanf("")), 0xfe00);
}

TEST(HalfConversion, EveryFiniteHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaN: ggml canonicalizes
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

// Nearest bf16 by exhaustive choice between the two neighbours, in double.
uint16_t NearestBf16(float f) {
  const uint32_t bits = f32_to_bits(f);
  const uint32_t below = bits & 0xffff0000u;
  const uint32_t above = below + 0x10000u;
  const double d_below = std::fabs(static_cast<double>(f32_from_bits(below)) - f);
  // Past the largest finite bf16 the upper neighbour is inf; treat it as 2^128.
  const double upper = (above & 0x7f800000u) == 0x7f800000u
                           ? std::copysign(std::ldexp(1.0, 128), f)
                           : static_cast<double>(f32_from_bits(above));
  const double d_above = std::fabs(upper - f);
  if (d_below < d_above) return static_cast<uint16_t>(below >> 16);
  if (d_above < d_below) return static_cast<uint16_t>(above >> 16);
  return static_cast<uint16_t>(((below >> 16) & 1u) == 0 ? below >> 16 : above >> 16);
}

TEST(Bf16Conversion, RoundsToNearestEven) {
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4093) {
    const float f = f32_from_bits(static_cast<uint32_t>(bits));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), NearestBf16(f)) << "float bits 0x" << std::hex << bits;
  }
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f7fffffu)), 0x7f80);  // rounds to inf
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f800001u)), 0x7fc0);  // NaN made quiet
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0xffc12345u)), 0xffc1);
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0) continue;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(GoldenQuant, DequantizeMatchesGgmlBitForBit) {
  for (const TypeCase& c : kGoldenCases) {
    SCOPED_TRACE(c.name);
    const std::vector<uint8_t> quant = ReadGolden(std::string(c.name) + ".quant", c.in_tests_data);
    const std::vector<float> want =
        AsFloats(ReadGolden(std::string(c.name) + ".dequant.f32", c.in_tests_data));
    ASSERT_EQ(quant.size(), kGoldenRows * c.golden_row_bytes);
    ASSERT_EQ(want.size(), static_cast<size_t>(kGoldenRows * kGoldenCols));
    for (int row = 0; row < kGoldenRows; ++row) {
      std::vector<float> got(kGoldenCols);
      ASSERT_TRUE(dequantize_row(c.type, quant.data() + row * c.golden_row_bytes, got.data(),
                                 kGoldenCols));
      const float* ref = want.data() + row * kGoldenCols;
      if (std::memcmp(got.data(), ref, kGoldenCols * sizeof(float)) != 0) {
        int i = 0;
        while (f32_to_bits(got[i]) == f32_to_bits(ref[i])) ++i;
        ADD_FAILURE() << "row " << row << " element " << i << ": got " << got[i] << " (0x"
                      << std::hex << f32_to_bits(got[i]) << "), ggml " << ref[i] << " (0x"
                      << f32_to_bits(ref[i]) << ")";
      }
    }
  }
}

TEST(GoldenQuant, QuantizeMatchesGgmlBytesAndError) {
  const std::vector<float> input = AsFloats(ReadGolden("input.f32"));
  ASSERT_EQ(input.size(), static_cast<size_t>(kGoldenRows * kGoldenCols));
  for (const TypeCase& c : kGoldenCases) {
    SCOPED_TRACE(c.name);
    const std::vector<uint8_t> golden = ReadGolden(std::string(c.name) + ".quant", c.in_tests_data);
    const std::vector<float> golden_dequant =
        AsFloats(ReadGolden(std::string(c.name) + ".dequant.f32", c.in_tests_data));
    ASSERT_EQ(golden.size(), kGoldenRows * c.golden_row_bytes);
    ASSERT_EQ(golden_dequant.size(), input.size());
    int rows_matching = 0;
    std::string rmse_report;
    for (int row = 0; row < kGoldenRows; ++row) {
      const float* x = input.data() + row * kGoldenCols;
      std::vector<uint8_t> ours(c.golden_row_bytes);
      quantize_row(c.type, x, ours.data(), kGoldenCols);
      const bool same = std::memcmp(ours.data(), golden.data() + row * c.golden_row_bytes,
                                    c.golden_row_bytes) == 0;
      rows_matching += same;
      // Byte equality with ggml's reference quantizer is the goal for every type.
      EXPECT_TRUE(same) << "row " << row << " differs from " << c.name << ".quant";

      std::vector<float> back(kGoldenCols);
      ASSERT_TRUE(dequantize_row(c.type, ours.data(), back.data(), kGoldenCols));
      const double ours_rmse = RelRmse(back.data(), x, kGoldenCols);
      const double ggml_rmse = RelRmse(golden_dequant.data() + row * kGoldenCols, x, kGoldenCols);
      if (row < 2) {
        EXPECT_LE(ours_rmse, 1.25 * ggml_rmse) << "row " << row;
        // Our error formula reproduces the README's numbers (3 significant digits).
        const double readme = row == 0 ? c.readme_rmse_row0 : c.readme_rmse_row1;
        EXPECT_NEAR(ggml_rmse, readme, 0.006 * readme) << "row " << row;
        rmse_report += " row" + std::to_string(row) + " " + std::to_string(ours_rmse);
      }
    }
    std::cout << "[ quant    ] " << c.name << ": " << rows_matching << "/" << kGoldenRows
              << " rows byte-identical to ggml; rel. RMSE" << rmse_report << "\n";
  }
}

TEST(QuantRoundTrip, RandomRowsOfSeveralLengths) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<TypeCase> cases(std::begin(kGoldenCases), std::end(kGoldenCases));
  cases.push_back({GgmlType::kF32, "f32", 0, 0, 0, 0.0});
  constexpr uint8_t kGuard = 0xa5;
  constexpr size_t kGuardBytes = 64;
  for (const TypeCase& c : cases) {
    for (int64_t blocks : {1, 3, 16, 37}) {
      const int64_t n = blocks * (quant_block_elems(c.type) == 1 ? 256 : quant_block_elems(c.type));
      SCOPED_TRACE(std::string(c.name) + " n=" + std::to_string(n));
      std::vector<float> x(n);
      for (float& v : x) v = gaussian(rng);
      const size_t row_bytes = ggml_row_size(c.type, n);
      std::vector<uint8_t> dst(row_bytes + kGuardBytes, kGuard);
      quantize_row(c.type, x.data(), dst.data(), n);
      for (size_t i = row_bytes; i < dst.size(); ++i) {
        ASSERT_EQ(dst[i], kGuard) << "quantize_row wrote past the row, byte " << i;
      }
      std::vector<float> back(n);
      ASSERT_TRUE(dequantize_row(c.type, dst.data(), back.data(), n));
      const double rmse = RelRmse(back.data(), x.data(), n);
      if (c.type == GgmlType::kF32) {
        EXPECT_EQ(std::memcmp(back.data(), x.data(), n * sizeof(float)), 0);
      } else {
        EXPECT_LE(rmse, c.random_rmse_bound);
        EXPECT_GT(rmse, 0.0);
      }
    }
  }
}

TEST(QuantRoundTrip, ZeroRowStaysZero) {
  for (const TypeCase& c : kGoldenCases) {
    SCOPED_TRACE(c.name);
    std::vector<float> zeros(512, 0.0f);
    std::vector<uint8_t> dst(ggml_row_size(c.type, 512), 0xff);
    quantize_row(c.type, zeros.data(), dst.data(), 512);
    std::vector<float> back(512, 1.0f);
    ASSERT_TRUE(dequantize_row(c.type, dst.data(), back.data(), 512));
    for (float v : back) ASSERT_EQ(v, 0.0f);
  }
}

TEST(QuantContract, DequantizeRejectsUnsupportedTypeAndPartialBlocks) {
  const std::vector<uint8_t> src(4 * sizeof(block_q6_K), 0);
  std::vector<float> dst(1024, 7.0f);
  EXPECT_FALSE(dequantize_row(GgmlType::kIQ2_XXS, src.data(), dst.data(), 256));
  EXPECT_FALSE(dequantize_row(GgmlType::kQ8_0, src.data(), dst.data(), 33));
  EXPECT_FALSE(dequantize_row(GgmlType::kQ6_K, src.data(), dst.data(), 128));
  EXPECT_FALSE(dequantize_row(GgmlType::kQ4_0, src.data(), dst.data(), -32));
  for (float v : dst) ASSERT_EQ(v, 7.0f) << "a rejected call wrote output";
  EXPECT_TRUE(dequantize_row(GgmlType::kQ6_K, src.data(), dst.data(), 1024));
}

TEST(QuantContractDeathTest, QuantizeChecksTypeAndLength) {
  std::vector<float> x(256, 1.0f);
  std::vector<uint8_t> dst(4096);
  EXPECT_DEATH(quantize_row(GgmlType::kIQ2_XXS, x.data(), dst.data(), 256), "quant_supported");
  EXPECT_DEATH(quantize_row(GgmlType::kQ4_K, x.data(), dst.data(), 100), "multiple");
}

}  // namespace
}  // namespace moegraph
