// The kernels' MG_HD math and decisions, run on the CPU against the oracle's ops
// (reference/ops.h), the quant code (loader/quant.h) and the residency policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/mmvq_math.h"
#include "kernels/moe_math.h"
#include "kernels/nn_math.h"
#include "kernels/sample_math.h"
#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "reference/ops.h"
#include "residency/policy.h"

namespace moegraph {
namespace {

const GgmlType kTypes[] = {GgmlType::kF32,  GgmlType::kF16,    GgmlType::kBF16,   GgmlType::kQ8_0,
                           GgmlType::kQ4_0, GgmlType::kQ4_K,   GgmlType::kQ5_K,   GgmlType::kQ6_K,
                           GgmlType::kQ4_1, GgmlType::kQ5_0,   GgmlType::kQ5_1,   GgmlType::kQ2_K,
                           GgmlType::kQ3_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS, GgmlType::kMXFP4};

std::vector<float> Gaussian(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Dequantize-then-dot in f64, and the sum of |w_i x_i| the float error scales with.
void ReferenceDot(GgmlType type, const uint8_t* row, const float* x, int64_t n, double* dot,
                  double* magnitude) {
  std::vector<float> w(n);
  ASSERT_TRUE(dequantize_row(type, row, w.data(), n));
  *dot = 0.0;
  *magnitude = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    *dot += static_cast<double>(w[i]) * x[i];
    *magnitude += std::fabs(static_cast<double>(w[i]) * x[i]);
  }
}

// x quantized to q8_1 blocks, and the values those blocks stand for (d * q).
struct Q8_1Vector {
  std::vector<block_q8_1> blocks;
  std::vector<float> values;
};
Q8_1Vector QuantizeQ8_1(const std::vector<float>& x) {
  Q8_1Vector q;
  q.blocks.resize(x.size() / QK8_1);
  for (size_t b = 0; b < q.blocks.size(); ++b) {
    quantize_q8_1_block(x.data() + b * QK8_1, &q.blocks[b]);
    for (int i = 0; i < QK8_1; ++i) {
      q.values.push_back(f16_to_f32(q.blocks[b].d) * static_cast<float>(q.blocks[b].qs[i]));
    }
  }
  return q;
}

TEST(MmvqMathTest, Dp4aMultipliesSignedBytes) {
  // Bytes of a (low first): -128, 127, -1, 1; of b: 5, 4, 3, 2.
  EXPECT_EQ(dp4a(0x01FF7F80, 0x02030405, 10), 10 - 640 + 508 - 3 + 2);
  EXPECT_EQ(dp4a(0x01010101, static_cast<int>(0x80808080u), 0), -512);
}

// The table lookup of iq4_nl, iq4_xs and mxfp4 (ggml's __byte_perm sequence)
// against a plain lookup of each nibble.
TEST(MmvqMathTest, TableLookupPicksTheEntryOfEveryNibble) {
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x7531u), 0x77553311u);
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x8888u), 0x00000000u);  // bit 3 ignored
  std::mt19937 rng(10);
  for (int trial = 0; trial < 2000; ++trial) {
    const int q4 = static_cast<int>(rng());
    for (bool mxfp4 : {false, true}) {
      const IntPair v = mxfp4 ? int_from_table_16(q4, kMxfp4Low, kMxfp4High)
                              : int_from_table_16(q4, kIq4nlLow, kIq4nlHigh);
      for (int byte = 0; byte < 4; ++byte) {
        const int low = (static_cast<uint32_t>(q4) >> (8 * byte)) & 0xf;
        const int high = (static_cast<uint32_t>(q4) >> (8 * byte + 4)) & 0xf;
        const int want_low = mxfp4 ? kvalue_mxfp4(low) : kvalue_iq4nl(low);
        const int want_high = mxfp4 ? kvalue_mxfp4(high) : kvalue_iq4nl(high);
        ASSERT_EQ(static_cast<int8_t>(v.first >> (8 * byte)), want_low) << std::hex << q4;
        ASSERT_EQ(static_cast<int8_t>(v.second >> (8 * byte)), want_high) << std::hex << q4;
      }
    }
  }
}

TEST(MmvqMathTest, Q8_1BlocksHoldRoundedQuantsTheScaleAndTheSum) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const std::vector<float> x = Gaussian(rng, QK8_1, trial % 2 == 0 ? 1.0f : 1e-3f);
    block_q8_1 b;
    quantize_q8_1_block(x.data(), &b);
    float amax = 0.0f;
    double sum = 0.0;
    for (float v : x) {
      amax = std::max(amax, std::fabs(v));
      sum += v;
    }
    const float d = amax / 127.0f;
    EXPECT_EQ(b.d, f32_to_f16(d));
    EXPECT_NEAR(f16_to_f32(b.s), sum, 1e-2 * std::fabs(sum) + 1e-3 * amax);
    for (int i = 0; i < QK8_1; ++i) {
      EXPECT_EQ(b.qs[i], static_cast<int8_t>(std::round(x[i] / d))) << i;
    }
  }
  const std::vector<float> zeros(QK8_1, 0.0f);
  block_q8_1 z;
  quantize_q8_1_block(zeros.data(), &z);
  EXPECT_EQ(z.d, 0);
  for (int8_t q : z.qs) EXPECT_EQ(q, 0);
}

// Each quant type's integer dot against q8_1 equals the dot of its dequantized
// weights with the q8_1 blocks' values (the integers are exact; only the float
// sums round), and stays within the q8 rounding of the f32 dot.
TEST(MmvqMathTest, QuantDotsEqualDequantizedWeightsTimesTheQ8_1Values) {
  std::mt19937 rng(12);
  for (GgmlType type : kTypes) {
    if (!mmvq_type(type)) continue;
    SCOPED_TRACE(ggml_type_name(static_cast<uint32_t>(type)));
    for (int64_t n : {int64_t{256}, int64_t{1024}, int64_t{2560}, int64_t{8192}}) {
      const std::vector<float> w = Gaussian(rng, n);
      const std::vector<float> x = Gaussian(rng, n);
      std::vector<uint8_t> row(ggml_row_size(type, n));
      quantize_row(type, w.data(), row.data(), n);
      const Q8_1Vector q = QuantizeQ8_1(x);
      double expected, magnitude;
      ReferenceDot(type, row.data(), q.values.data(), n, &expected, &magnitude);
      // vec_dot_q4_0_q8_1 and q5_0's take "- 8" ("- 16") out of the block's f16
      // sum s of x, not of the q8_1 values; q4_1 and q5_1 add min * s: the same
      // differences here. q4_1 and q5_1 also round d * d8 and m * s to f16
      // (__hmul2): a relative 2^-11 of each block's part.
      const bool offset = type == GgmlType::kQ4_0 || type == GgmlType::kQ5_0;
      const bool with_min = type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1;
      if (offset || with_min) {
        const size_t block_bytes = quant_block_bytes(type);
        for (size_t b = 0; b < q.blocks.size(); ++b) {
          double values = 0.0;
          for (int i = 0; i < QK8_1; ++i) values += q.values[b * QK8_1 + i];
          const double s = f16_to_f32(q.blocks[b].s);
          uint16_t d_or_m;  // d at offset 0 (q4_0, q5_0), the min at 2 (q4_1, q5_1)
          std::memcpy(&d_or_m, row.data() + b * block_bytes + (with_min ? 2 : 0), sizeof(d_or_m));
          const double v = f16_to_f32(d_or_m);
          expected +=
              offset ? (type == GgmlType::kQ4_0 ? 8.0 : 16.0) * v * (values - s) : v * (s - values);
        }
      }
      const float got = matvec_row_reference(type, row.data(), nullptr, q.blocks.data(), n);
      EXPECT_NEAR(got, expected, (with_min ? 1e-3 : 1e-5) * magnitude) << "n=" << n;
      double f32_dot, f32_magnitude;
      ReferenceDot(type, row.data(), x.data(), n, &f32_dot, &f32_magnitude);
      EXPECT_NEAR(got, f32_dot, 2e-2 * f32_magnitude) << "n=" << n;
    }
  }
}

TEST(MmvqMathTest, ElementDotsMatchDequantizeThenDot) {
  std::mt19937 rng(13);
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16}) {
    SCOPED_TRACE(ggml_type_name(static_cast<uint32_t>(type)));
    for (int64_t n : {int64_t{8}, int64_t{64}, int64_t{1000}, int64_t{4096}}) {
      const std::vector<float> w = Gaussian(rng, n);
      const std::vector<float> x = Gaussian(rng, n);
      std::vector<uint8_t> row(ggml_row_size(type, n));
      quantize_row(type, w.data(), row.data(), n);
      double expected, magnitude;
      ReferenceDot(type, row.data(), x.data(), n, &expected, &magnitude);
      const float got = matvec_row_reference(type, row.data(), x.data(), nullptr, n);
      EXPECT_NEAR(got, expected, 1e-6 * magnitude) << "n=" << n;
    }
  }
}

// Unit u of a row against the activations, alone.
template <GgmlType T>
float UnitDot(const uint8_t* row, const float* x, const block_q8_1* y, int64_t u) {
  return dot_row_unit<T>(load_row_unit<T>(row, u), x, y, u);
}
float DotRowUnit(GgmlType type, const uint8_t* row, const float* x, const block_q8_1* y,
                 int64_t u) {
  switch (type) {
    case GgmlType::kF32: return UnitDot<GgmlType::kF32>(row, x, y, u);
    case GgmlType::kF16: return UnitDot<GgmlType::kF16>(row, x, y, u);
    case GgmlType::kBF16: return UnitDot<GgmlType::kBF16>(row, x, y, u);
    case GgmlType::kQ4_K: return UnitDot<GgmlType::kQ4_K>(row, x, y, u);
    default: ADD_FAILURE() << "no UnitDot instance"; return 0.0f;
  }
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Each thread adds its units in unit order, whatever number of units a trip
// loads first (element types load kThreadTripUnits, twice kTripUnits): the
// row's sum is the one from each thread's plain loop over its units.
TEST(MmvqMathTest, ATripsLengthChangesNoBit) {
  std::mt19937 rng(17);
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_K}) {
    SCOPED_TRACE(ggml_type_name(static_cast<uint32_t>(type)));
    for (int64_t n : {int64_t{256}, int64_t{768}, int64_t{2048}, int64_t{4096}, int64_t{6144}}) {
      const std::vector<float> w = Gaussian(rng, n);
      const std::vector<float> x = Gaussian(rng, n);
      std::vector<uint8_t> row(ggml_row_size(type, n));
      quantize_row(type, w.data(), row.data(), n);
      const std::vector<block_q8_1> y = QuantizeQ8_1(x).blocks;
      const int threads = matvec_geometry(type, n).threads_per_row;
      float parts[kMatvecThreads];
      for (int t = 0; t < threads; ++t) {
        parts[t] = 0.0f;
        for (int64_t u = t; u < row_units(type, n); u += threads) {
          parts[t] += DotRowUnit(type, row.data(), x.data(), y.data(), u);
        }
      }
      const float want = row_sum_of_parts(parts, threads);
      const float got = matvec_row_reference(type, row.data(), x.data(), y.data(), n);
      EXPECT_EQ(Bits(got), Bits(want)) << "n=" << n;
    }
  }
}

// Every thread's part of an element-type row's dot with x (a const float* or
// a NormedInput).
template <GgmlType T, typename X>
std::vector<float> ThreadParts(const std::vector<uint8_t>& row, const X& x, int64_t n) {
  const int threads = matvec_geometry(T, n).threads_per_row;
  const uint8_t* const rows[1] = {row.data()};
  std::vector<float> parts(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    float sums[1] = {0.0f};
    thread_partials<T, 1>(rows, x, nullptr, n, t, threads, sums);
    parts[static_cast<size_t>(t)] = sums[0];
  }
  return parts;
}

// A row that normalizes its input as it reads it (NormedInput: the router
// chained to attn_out) has, thread by thread, the bits of the row reading what
// block_rmsnorm writes, x * scale * weight in that order.
template <GgmlType T>
void ExpectNormedInputIsTheNormsOutput(std::mt19937& rng, int64_t n) {
  const std::vector<float> w = Gaussian(rng, n), x = Gaussian(rng, n, 4.0f),
                           weight = Gaussian(rng, n);
  std::vector<uint8_t> row(ggml_row_size(T, n));
  quantize_row(T, w.data(), row.data(), n);
  float sum_sq = 0.0f;
  for (float v : x) sum_sq += v * v;
  const float scale = rms_scale(sum_sq, static_cast<int32_t>(n), 1e-6f);
  std::vector<float> normed(static_cast<size_t>(n));
  for (size_t i = 0; i < normed.size(); ++i) normed[i] = x[i] * scale * weight[i];
  const std::vector<float> want = ThreadParts<T>(row, normed.data(), n);
  const NormedInput normed_input{x.data(), weight.data(), scale};
  const std::vector<float> got = ThreadParts<T>(row, normed_input, n);
  ASSERT_EQ(got.size(), want.size());
  for (size_t t = 0; t < got.size(); ++t) EXPECT_EQ(Bits(got[t]), Bits(want[t])) << "thread " << t;
}

TEST(MmvqMathTest, ARowReadingItsNormedInputHasTheBitsOfTheNormsOutput) {
  std::mt19937 rng(41);
  for (int64_t n : {int64_t{512}, int64_t{2048}, int64_t{4096}}) {
    SCOPED_TRACE(n);
    ExpectNormedInputIsTheNormsOutput<GgmlType::kF32>(rng, n);
    ExpectNormedInputIsTheNormsOutput<GgmlType::kF16>(rng, n);
    ExpectNormedInputIsTheNormsOutput<GgmlType::kBF16>(rng, n);
  }
}

// The matvec's geometry: ggml's (a whole block of 4 warps on one row) where a
// row has the units for it, the fewest threads that take a row in one trip
// otherwise, rows sharing the block; every shape a power of two.
TEST(MmvqMathTest, GeometryPutsTheBlockOnOneRowWhereTheRowFillsIt) {
  for (GgmlType type : kTypes) {
    for (int64_t cols : {int64_t{256}, int64_t{512}, int64_t{2048}, int64_t{8192}}) {
      if (!grouped_matvec_supports(type, cols)) continue;
      const MatvecGeometry g = matvec_geometry(type, cols);
      EXPECT_GE(g.threads_per_row, kMinThreadsPerRow);
      EXPECT_LE(g.threads_per_row, kMatvecThreads);
      EXPECT_EQ(g.threads_per_row & (g.threads_per_row - 1), 0) << g.threads_per_row;
      EXPECT_EQ(g.threads_per_row * g.rows_per_block, kMatvecThreads);
      const int64_t trips = (row_units(type, cols) + kTripUnits - 1) / kTripUnits;
      // One trip a thread, or the whole block on the row.
      EXPECT_TRUE(trips <= g.threads_per_row || g.threads_per_row == kMatvecThreads) << cols;
      // Not more threads than the trips need (but the fewest allowed).
      EXPECT_TRUE(g.threads_per_row == kMinThreadsPerRow || 2 * trips > g.threads_per_row)
          << cols;
    }
  }
  // Qwen3-30B-A3B's shapes: q8_0 q/k/v and q6_K lm_head (2048 wide), attn_out
  // (4096 wide): mul_mat_vec_q's block on one row; a q4_K expert's gate/up
  // (2048 wide) two rows a block, its down (768 wide) four.
  EXPECT_EQ(matvec_geometry(GgmlType::kQ8_0, 2048).rows_per_block, 1);
  EXPECT_EQ(matvec_geometry(GgmlType::kQ6_K, 2048).rows_per_block, 1);
  EXPECT_EQ(matvec_geometry(GgmlType::kQ4_K, 4096).rows_per_block, 1);
  EXPECT_EQ(matvec_geometry(GgmlType::kQ4_K, 2048).rows_per_block, 2);
  EXPECT_EQ(matvec_geometry(GgmlType::kQ4_K, 768).rows_per_block, 4);
  EXPECT_EQ(matvec_geometry(GgmlType::kF32, 2048).rows_per_block, 1);  // the router
  // A tiny fixture's rows: 32 rows a block, four threads each.
  EXPECT_EQ(matvec_geometry(GgmlType::kQ8_0, 64).rows_per_block, kMaxRowsPerBlock);
}

// Qwen3-30B-A3B's weight-streaming launches as the launchers grid them
// (matvec_row_blocks x ranks), at its shape (2048 wide, 32 q and 4 kv heads of
// 128, 128 experts of 768, top-8, vocabulary 151,936) and the device check's
// types (q8_0 dense, q4_K experts, f32 router): each puts at least 4 blocks on
// every SM of an H100 (132), where the kernels before issue 40 had 64-192 in
// all; the router is the exception, its 128 rows (1 MB) one block each.
TEST(MmvqMathTest, Qwen3LaunchesPutFourBlocksOnEverySm) {
  constexpr int64_t kFourPerSm = 4 * 132;
  const int64_t embd = 2048, q_rows = 32 * 128, kv_rows = 4 * 128, ff = 768, k = 8;
  struct Launch {
    const char* name;
    int64_t blocks;
  };
  const Launch launches[] = {
      {"qkv", matvec_row_blocks(GgmlType::kQ8_0, q_rows, embd) +
                  2 * matvec_row_blocks(GgmlType::kQ8_0, kv_rows, embd)},
      {"attn_out", matvec_row_blocks(GgmlType::kQ8_0, embd, q_rows)},
      {"gate_up", k * matvec_row_blocks(GgmlType::kQ4_K, ff, embd)},
      {"down", k * matvec_row_blocks(GgmlType::kQ4_K, embd, ff)},
      {"lm_head", matvec_row_blocks(GgmlType::kQ8_0, 151936, embd)},
  };
  for (const Launch& l : launches) EXPECT_GE(l.blocks, kFourPerSm) << l.name;
  EXPECT_EQ(launches[0].blocks, 5120);
  EXPECT_EQ(launches[2].blocks, 3072);
  EXPECT_EQ(launches[3].blocks, 4096);
  EXPECT_EQ(matvec_row_blocks(GgmlType::kF32, 128, embd), 128);  // the router
}

// The device's weight loads (aligned words joined by funnel shifts, 16-bit
// and 8-bit fields out of their aligned word) give the host's bytes at every
// alignment; run here on a buffer padded to whole words.
TEST(MmvqMathTest, AlignedLoadsGiveTheFieldsAtEveryAlignment) {
  alignas(16) uint8_t bytes[64];
  for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>(37 * i + 11);
  for (int at = 0; at < 40; ++at) {
    int words[3];
    words_from_aligned_loads<3>(bytes + at, words);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(static_cast<uint32_t>(words[i]), host_word(bytes + at + 4 * i)) << at << " " << i;
    }
    EXPECT_EQ(u8_from_aligned_load(bytes + at), bytes[at]) << at;
    if (at % 2 == 0) {
      EXPECT_EQ(u16_from_aligned_load(bytes + at), bytes[at] | (bytes[at + 1] << 8)) << at;
    }
  }
}

TEST(MmvqMathTest, TheGroupedMatvecTakesWholeBlocksOfItsTypes) {
  EXPECT_TRUE(grouped_matvec_supports(GgmlType::kF32, 76));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kF32, 77));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kF16, 76));
  EXPECT_TRUE(grouped_matvec_supports(GgmlType::kQ4_K, 512));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kQ4_K, 288));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kQ8_0, 48));
  EXPECT_TRUE(grouped_matvec_supports(GgmlType::kQ2_K, 256));
  EXPECT_TRUE(grouped_matvec_supports(GgmlType::kMXFP4, 64));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kMXFP4, 48));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kIQ2_XXS, 256));
  EXPECT_FALSE(grouped_matvec_supports(GgmlType::kF16, 0));
}

TEST(NnMathTest, RopeIsTheExactRotationWithinUlps) {
  std::mt19937 rng(3);
  const int n_head = 3;
  for (RopeType type : {RopeType::kNorm, RopeType::kNeox}) {
    for (int head_dim : {64, 128}) {
      for (int32_t pos : {0, 1, 17, 4095, 32767}) {
        for (float base : {10000.0f, 1000000.0f}) {
          std::vector<float> x = Gaussian(rng, n_head * head_dim);
          std::vector<float> expected = x;
          const int32_t positions[] = {pos};
          Rope(absl::MakeSpan(expected), n_head, head_dim, positions, base, type);
          const int32_t rope_type = type == RopeType::kNorm ? kRopeNorm : kRopeNeox;
          // The exact rotation in f64 by rope_theta's angle.
          std::vector<double> exact(x.begin(), x.end());
          for (int h = 0; h < n_head; ++h) {
            double* head = exact.data() + h * head_dim;
            for (int i = 0; i < head_dim / 2; ++i) {
              int32_t a, b;
              rope_pair_offsets(i, head_dim, rope_type, &a, &b);
              const double theta = rope_theta(pos, i, head_dim, base);
              const double x0 = head[a], x1 = head[b];
              head[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
              head[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
            }
          }
          for (size_t i = 0; i < x.size(); ++i) {
            ASSERT_NEAR(expected[i], exact[i], 1e-6 * std::max(1.0, std::fabs(exact[i])))
                << "pos " << pos << " element " << i;
          }
        }
      }
    }
  }
}

// glm4moe's partial RoPE: pairs of the first n_rot dimensions turn as a head of
// n_rot would, the rest stay, as the oracle's Rope with n_rot.
TEST(NnMathTest, PartialRopeTurnsTheFirstDimensionsOnly) {
  std::mt19937 rng(5);
  const int n_head = 2, head_dim = 64, n_rot = 32;
  for (RopeType type : {RopeType::kNorm, RopeType::kNeox}) {
    std::vector<float> x = Gaussian(rng, n_head * head_dim);
    std::vector<float> expected = x;
    const int32_t positions[] = {37};
    Rope(absl::MakeSpan(expected), n_head, head_dim, positions, 1e6f, type, RopeScaling(), n_rot);
    const int32_t rope_type = type == RopeType::kNorm ? kRopeNorm : kRopeNeox;
    const std::vector<float> before = x;
    for (int h = 0; h < n_head; ++h) {
      float* head = x.data() + h * head_dim;
      for (int i = 0; i < n_rot / 2; ++i) {
        int32_t a, b;
        rope_pair_offsets(i, n_rot, rope_type, &a, &b);
        float c, sine;
        rope_cos_sin(37, i, n_rot, 1e6f, RopeYarn{}, &c, &sine);
        rope_rotate_cs(head + a, head + b, c, sine);
      }
    }
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(x[i], expected[i]) << "element " << i;
      if (static_cast<int>(i % head_dim) >= n_rot) {
        EXPECT_EQ(x[i], before[i]);
      }
    }
    EXPECT_NE(x[1], before[1]);
  }
}

TEST(NnMathTest, RmsScaleMatchesReference) {
  std::mt19937 rng(4);
  for (int n : {1, 128, 4096}) {
    const std::vector<float> x = Gaussian(rng, n, 3.0f);
    const std::vector<float> weight = Gaussian(rng, n);
    std::vector<float> expected(n);
    RmsNorm(x, weight, 1e-6f, absl::MakeSpan(expected));
    float sum_sq = 0.0f;
    for (float v : x) sum_sq += v * v;
    const float scale = rms_scale(sum_sq, n, 1e-6f);
    for (int i = 0; i < n; ++i) {
      EXPECT_NEAR(x[i] * scale * weight[i], expected[i], 2e-6 * std::fabs(expected[i]) + 1e-12);
    }
  }
}

TEST(NnMathTest, ActivationsMatchReference) {
  for (float x = -30.0f; x <= 30.0f; x += 0.37f) {
    EXPECT_NEAR(silu(x), Silu(x), 1e-6 * std::max(1.0f, std::fabs(x))) << x;
    EXPECT_NEAR(sigmoid(x), Sigmoid(x), 1e-7) << x;
  }
  EXPECT_EQ(sigmoid(0.0f), 0.5f);
  EXPECT_EQ(silu(0.0f), 0.0f);
}

// Softmax of scores, weighted sum of values (dim floats per score), in f64.
std::vector<double> OnePassAttention(const std::vector<float>& scores,
                                     const std::vector<float>& values, int dim) {
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0.0;
  std::vector<double> acc(dim, 0.0);
  for (size_t j = 0; j < scores.size(); ++j) {
    const double e = std::exp(scores[j] - max);
    sum += e;
    for (int d = 0; d < dim; ++d) acc[d] += e * values[j * dim + d];
  }
  for (double& a : acc) a /= sum;
  return acc;
}

TEST(NnMathTest, MergedSplitsEqualOnePassSoftmax) {
  std::mt19937 rng(5);
  const int dim = 8;
  for (int n : {1, 5, 128, 1000}) {
    for (int split : {1, 7, 128, 4096}) {
      const std::vector<float> scores = Gaussian(rng, n, 4.0f);
      const std::vector<float> values = Gaussian(rng, n * dim);
      // Splits as the attention kernel makes them, plus empty splits past the end.
      const int n_splits = (n + split - 1) / split + 2;
      SoftmaxPartial state = empty_softmax();
      std::vector<float> acc(dim, 0.0f);
      for (int s = 0; s < n_splits; ++s) {
        const int begin = s * split;
        const int end = std::min(n, begin + split);
        SoftmaxPartial part = empty_softmax();
        std::vector<float> part_acc(dim, 0.0f);
        if (begin < end) {
          part.max = *std::max_element(scores.begin() + begin, scores.begin() + end);
          part.sum = 0.0f;
          for (int j = begin; j < end; ++j) {
            const float e = std::exp(scores[j] - part.max);
            part.sum += e;
            for (int d = 0; d < dim; ++d) part_acc[d] += e * values[j * dim + d];
          }
        }
        float scale_state, scale_part;
        state = softmax_merge(state, part, &scale_state, &scale_part);
        for (int d = 0; d < dim; ++d) acc[d] = acc[d] * scale_state + part_acc[d] * scale_part;
      }
      const std::vector<double> expected = OnePassAttention(scores, values, dim);
      for (int d = 0; d < dim; ++d) {
        EXPECT_NEAR(acc[d] / state.sum, expected[d], 1e-5) << "n=" << n << " split=" << split;
      }
    }
  }
}

TEST(NnMathTest, EmptySoftmaxStateIsTheMergeIdentity) {
  const SoftmaxPartial a = {2.5f, 3.25f};
  float scale_a, scale_b;
  SoftmaxPartial merged = softmax_merge(a, empty_softmax(), &scale_a, &scale_b);
  EXPECT_EQ(merged.max, a.max);
  EXPECT_EQ(merged.sum, a.sum);
  EXPECT_EQ(scale_a, 1.0f);
  EXPECT_EQ(scale_b, 0.0f);
  merged = softmax_merge(empty_softmax(), empty_softmax(), &scale_a, &scale_b);
  EXPECT_EQ(merged.max, -INFINITY);
  EXPECT_EQ(merged.sum, 0.0f);
  EXPECT_EQ(scale_a, 0.0f);
  EXPECT_EQ(scale_b, 0.0f);
}

// The f32 softmax (exp_nonpositive, the warp's sum shape) stays within a few
// ulps of the exact softmax, and sums to 1 as closely.
TEST(MoeMathTest, RouterSoftmaxIsTheF64SoftmaxWithinUlps) {
  std::mt19937 rng(6);
  for (int n : {8, 60, 128, 256}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> logits = Gaussian(rng, n, 2.0f);
      std::vector<float> probs(n);
      router_softmax(logits.data(), n, probs.data());
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (float l : logits) sum += std::exp(l - max);
      double total = 0.0;
      for (int i = 0; i < n; ++i) {
        const double want = std::exp(logits[i] - max) / sum;
        // f32's rounding of (logit - max) is an ulp of the exp's argument:
        // relative 6e-8 times its size, as in any f32 softmax (ggml's too).
        const double ulps = 3e-7 + 1.2e-7 * std::fabs(logits[i] - max);
        EXPECT_NEAR(probs[i], want, ulps * want) << "n " << n << " i " << i;
        total += probs[i];
      }
      EXPECT_NEAR(total, 1.0, 1e-6) << "n " << n;
    }
  }
}

// router_sigmoid: e^x / (1 + e^x) below 0, 1 / (1 + e^-x) from 0, both within
// ulps of the f64 sigmoid, the limits exact.
TEST(MoeMathTest, RouterSigmoidIsTheF64SigmoidWithinUlps) {
  for (float x = -40.0f; x <= 40.0f; x += 0.0173f) {
    const double want = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    EXPECT_NEAR(router_sigmoid(x), want, 4e-7 * want) << x;
  }
  EXPECT_EQ(router_sigmoid(0.0f), 0.5f);
  EXPECT_EQ(router_sigmoid(INFINITY), 1.0f);
  EXPECT_EQ(router_sigmoid(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(router_sigmoid(NAN)));
}

TEST(MoeMathTest, TopKEqualsReferenceOnRandomAndTiedInputs) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(0, 3);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 4 + trial % 125;
    const int k = 1 + trial % std::min(n, 8);
    std::vector<float> probs(n);
    if (trial % 2 == 0) {
      std::vector<float> logits = Gaussian(rng, n);
      router_softmax(logits.data(), n, probs.data());
    } else {
      for (float& p : probs) p = 0.125f * level(rng);  // heavy ties
    }
    const std::vector<int32_t> expected = TopK(probs, k);
    std::vector<int32_t> chosen(k);
    select_topk(probs.data(), n, k, chosen.data());
    EXPECT_EQ(chosen, expected) << "trial " << trial;
  }
}

// NaN probabilities (a model whose logits overflow) must still leave the order
// total: a warp argmax (the sampler's block_best) butterflies lanes against
// idle lanes' (-inf, INT32_MAX), and the router ranks against idle threads'.
TEST(MoeMathTest, TopKOrderStaysTotalWithNaN) {
  const float nan = std::nanf("");
  EXPECT_TRUE(topk_precedes(nan, 3, -INFINITY, INT32_MAX));
  EXPECT_FALSE(topk_precedes(-INFINITY, INT32_MAX, nan, 3));
  EXPECT_TRUE(topk_precedes(0.0f, 5, nan, 1));
  EXPECT_NE(topk_precedes(nan, 1, nan, 2), topk_precedes(nan, 2, nan, 1));
  // The kernel's butterfly over 32 lanes, lanes 0..n-1 holding (probs[i], i).
  const float probs[] = {nan, 0.25f, nan, 0.75f, nan};
  const int32_t n = 5;
  float value[32];
  int32_t index[32];
  for (int lane = 0; lane < 32; ++lane) {
    value[lane] = lane < n ? probs[lane] : -INFINITY;
    index[lane] = lane < n ? lane : INT32_MAX;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    float next_value[32];
    int32_t next_index[32];
    for (int lane = 0; lane < 32; ++lane) {
      const int other = lane ^ offset;
      const bool take = topk_precedes(value[other], index[other], value[lane], index[lane]);
      next_value[lane] = take ? value[other] : value[lane];
      next_index[lane] = take ? index[other] : index[lane];
    }
    std::copy(next_value, next_value + 32, value);
    std::copy(next_index, next_index + 32, index);
  }
  for (int lane = 0; lane < 32; ++lane) EXPECT_EQ(index[lane], 3) << "lane " << lane;
  int32_t chosen[n];
  select_topk(probs, n, n, chosen);
  EXPECT_EQ(std::vector<int32_t>(chosen, chosen + n), (std::vector<int32_t>{3, 1, 0, 2, 4}));
}

// The router ranks experts by counting with integer compares: RankedExpert's
// order (topk_key of the value, then the id) and rank_word's are topk_precedes'
// for every kind of f32 (NaNs of either sign, infinities, signed zeros,
// subnormals) and ids up to the idle pair's.
TEST(MoeMathTest, RankedExpertOrderIsTopKOrder) {
  std::mt19937 rng(31);
  std::vector<float> values = {std::nanf(""), -std::nanf(""), INFINITY, -INFINITY, 0.0f, -0.0f,
                               std::numeric_limits<float>::denorm_min(),
                               -std::numeric_limits<float>::denorm_min(), FLT_MIN, -FLT_MIN,
                               FLT_MAX, -FLT_MAX, 1.0f, -1.0f, 0.5f, std::nextafter(0.5f, 1.0f)};
  for (float v : Gaussian(rng, 16, 3.0f)) values.push_back(v);
  const int32_t ids[] = {0, 1, 7, 1023, INT32_MAX};
  int checked = 0;
  for (float a : values) {
    for (float b : values) {
      for (int32_t i : ids) {
        for (int32_t j : ids) {
          const RankedExpert ea{i, topk_key(a)}, eb{j, topk_key(b)};
          const bool want = topk_precedes(a, i, b, j);
          ASSERT_EQ(ea < eb, want) << a << " " << i << " against " << b << " " << j;
          ASSERT_EQ(rank_word(ea) < rank_word(eb), want) << a << " " << i << " against " << b
                                                         << " " << j;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 32 * 32 * 25);
}

// The router's block ranks at most kRouterThreads candidates: k a thread of
// ceil(n_expert / kRouterThreads) experts each.
TEST(MoeMathTest, RouterTopKFitsItsCandidates) {
  EXPECT_TRUE(router_topk_fits(128, 64));
  EXPECT_TRUE(router_topk_fits(256, 64));
  EXPECT_TRUE(router_topk_fits(257, 42));
  EXPECT_FALSE(router_topk_fits(257, 43));
  EXPECT_TRUE(router_topk_fits(512, 32));
  EXPECT_FALSE(router_topk_fits(512, 33));
  EXPECT_TRUE(router_topk_fits(1024, 16));
  EXPECT_FALSE(router_topk_fits(1024, 17));
  EXPECT_FALSE(router_topk_fits(1025, 1));
  EXPECT_FALSE(router_topk_fits(8, 9));
  EXPECT_FALSE(router_topk_fits(8, 0));
  EXPECT_FALSE(router_topk_fits(0, 0));
  // The models the project runs: Qwen3.5-397B 512 / top-10, DeepSeek-V3 256 / 8, Kimi-K2 384 / 8.
  EXPECT_TRUE(router_topk_fits(512, 10));
  EXPECT_TRUE(router_topk_fits(256, 8));
  EXPECT_TRUE(router_topk_fits(384, 8));
}

TEST(MoeMathTest, TopKWeightsRenormalise) {
  const float probs[] = {0.1f, 0.4f, 0.2f, 0.3f};
  const int32_t chosen[] = {1, 3};
  float weights[2];
  const float chosen_probs[] = {probs[chosen[0]], probs[chosen[1]]};
  topk_weights(chosen_probs, 2, RouterGating::kSoftmax, false, 1.0f, weights);
  EXPECT_EQ(weights[0], 0.4f);
  EXPECT_EQ(weights[1], 0.3f);
  topk_weights(chosen_probs, 2, RouterGating::kSoftmax, true, 1.0f, weights);
  EXPECT_FLOAT_EQ(weights[0], 0.4f / 0.7f);
  EXPECT_FLOAT_EQ(weights[1], 0.3f / 0.7f);
  EXPECT_NEAR(weights[0] + weights[1], 1.0f, 1e-7);
}

// The device router's decision equals the oracle's SelectExperts bit for bit for
// every gating: glm4moe's sigmoids with a score bias that changes the choice,
// normalized and scaled weights; gpt-oss's softmax over the k chosen logits.
TEST(MoeMathTest, RouterDecisionEqualsTheOraclesForEveryGating) {
  std::mt19937 rng(11);
  constexpr int n = 16, k = 4;
  int bias_changed_choice = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<float> logits = Gaussian(rng, n);
    const std::vector<float> score_bias = Gaussian(rng, n, 0.25f);
    for (RouterGating gating :
         {RouterGating::kSoftmax, RouterGating::kSigmoid, RouterGating::kSoftmaxWeight}) {
      const ExpertGating oracle_gating = gating == RouterGating::kSigmoid ? ExpertGating::kSigmoid
                                         : gating == RouterGating::kSoftmax
                                             ? ExpertGating::kSoftmax
                                             : ExpertGating::kSoftmaxWeight;
      const bool biased = gating == RouterGating::kSigmoid;
      const float scale = biased ? 2.5f : 1.0f;
      const bool norm = gating != RouterGating::kSoftmaxWeight;
      std::vector<float> probs = logits;
      GateProbs(oracle_gating, n, absl::MakeSpan(probs));
      std::vector<int32_t> want;
      std::vector<double> want_w;
      SelectExperts(probs, n, k, norm, &want, &want_w, oracle_gating,
                    biased ? absl::MakeConstSpan(score_bias) : absl::Span<const float>(), scale);
      // The device's path: its gating's values, the choice on value + bias.
      std::vector<float> values = logits;
      if (gating == RouterGating::kSigmoid) {
        for (float& v : values) v = router_sigmoid(v);
      } else if (gating == RouterGating::kSoftmax) {
        router_softmax(logits.data(), n, values.data());
      }
      std::vector<float> selection = values;
      if (biased) {
        for (int e = 0; e < n; ++e) selection[e] = values[e] + score_bias[e];
      }
      int32_t chosen[k];
      select_topk(selection.data(), n, k, chosen);
      float weights[k];
      float chosen_values[k];
      for (int r = 0; r < k; ++r) chosen_values[r] = values[chosen[r]];
      topk_weights(chosen_values, k, gating, norm, scale, weights);
      ASSERT_EQ(std::vector<int32_t>(chosen, chosen + k), want) << "trial " << trial;
      for (int r = 0; r < k; ++r) {
        EXPECT_EQ(weights[r], static_cast<float>(want_w[r])) << "trial " << trial << " rank " << r;
      }
      if (biased) {
        int32_t unbiased[k];
        select_topk(values.data(), n, k, unbiased);
        bias_changed_choice += std::vector<int32_t>(unbiased, unbiased + k) != want;
      }
    }
  }
  EXPECT_GT(bias_changed_choice, 20);  // the bias matters in the cases tested
}

// Routing replay: the row of (the trace step, layer) over the router's choice,
// 1/k weights without the trace's, and a missing row (first id < 0) keeps the
// choice.
TEST(MoeMathTest, ReplayPutsTheTracesRowOverTheChoice) {
  const int32_t k = 2;
  // [3 steps][2 layers][k]; step 1 layer 1 is missing.
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, -1, 0, 6, 7, 8, 9};
  std::vector<float> trace_weights(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) trace_weights[i] = 0.1f * static_cast<float>(i);
  RoutingReplay t;
  t.ids = ids.data();
  t.weights = trace_weights.data();
  t.uniform_weight = 0.5f;
  t.n_layer = 2;
  t.layer = 1;
  const int64_t step = 2;
  t.step = &step;
  int32_t experts[k] = {30, 31};
  float weights[k] = {0.5f, 0.5f};
  for (int32_t r = 0; r < k; ++r) replay_rank(t, k, r, experts, weights);
  EXPECT_EQ(experts[0], 8);
  EXPECT_EQ(experts[1], 9);
  EXPECT_EQ(weights[0], trace_weights[10]);
  EXPECT_EQ(weights[1], trace_weights[11]);
  t.weights = nullptr;
  replay_rank(t, k, 0, experts, weights);
  EXPECT_EQ(weights[0], 0.5f);
  const int64_t missing = 1;  // its layer 1 row is missing
  t.step = &missing;
  experts[0] = 30;
  replay_rank(t, k, 0, experts, weights);
  EXPECT_EQ(experts[0], 30);
}

TEST(MoeMathTest, PassPredicateSplitsRanksIntoHitsAndMisses) {
  for (uint8_t missed : {kRankHit, kRankStaging, kRankCopied}) {
    const bool hit = missed == kRankHit;
    EXPECT_EQ(rank_in_pass(ExpertPass::kHits, missed), hit);
    EXPECT_EQ(rank_in_pass(ExpertPass::kMisses, missed), !hit);
    EXPECT_TRUE(rank_in_pass(ExpertPass::kAll, missed));
    EXPECT_TRUE(rank_in_pass(ExpertPass::kReady, missed));
    // Every rank is computed by exactly one of the two split passes.
    EXPECT_NE(rank_in_pass(ExpertPass::kHits, missed), rank_in_pass(ExpertPass::kMisses, missed));
    // Only the one pass waits, and only for a missed rank; what it computes
    // after a copy counts where the split's misses pass does.
    EXPECT_EQ(rank_waits_for_copy(ExpertPass::kReady, missed), !hit);
    for (ExpertPass pass : {ExpertPass::kHits, ExpertPass::kMisses, ExpertPass::kAll}) {
      EXPECT_FALSE(rank_waits_for_copy(pass, missed));
    }
    EXPECT_EQ(rank_computed_after_copy(ExpertPass::kReady, missed),
              rank_computed_after_copy(hit ? ExpertPass::kHits : ExpertPass::kMisses, missed));
    EXPECT_FALSE(rank_computed_after_copy(ExpertPass::kAll, missed));
  }
}

// Residency state in host vectors for one pool over every slot.
struct HostResidency {
  HostResidency(int n_layer, int n_expert, int n_slots, int protected_cap)
      : table(n_layer * n_expert, kNoSlot),
        owner(n_slots, kNoKey),
        stamp(n_slots, 0),
        seg(n_slots, kProbation) {
    state = {table.data(), owner.data(), stamp.data(), seg.data(), n_expert};
    pool = {0, n_slots, protected_cap, &n_protected, &clock};
  }
  bool operator==(const HostResidency& o) const {
    return table == o.table && owner == o.owner && stamp == o.stamp && seg == o.seg &&
           n_protected == o.n_protected && clock == o.clock;
  }
  std::vector<int32_t> table, owner;
  std::vector<uint64_t> stamp;
  std::vector<uint8_t> seg;
  int32_t n_protected = 0;
  uint64_t clock = 0;
  ResidencyState state;
  ResidencyPool pool;
};

// The residency kernel's decomposition, with its argmins as loops; the misses
// as kernels/moe.cu's admit_misses takes them: every rank computed once, before
// any admission, then the least rank above the last victim's.
StepOutcome SplitStep(HostResidency& h, int32_t layer, const int32_t* experts, int32_t k,
                      int32_t* keys, int32_t* slot_of_rank, uint8_t* missed, int32_t* evicted) {
  const ResidencyState& s = h.state;
  const ResidencyPool& pool = h.pool;
  StepOutcome out = {0, 0, 0};
  for (int32_t r = 0; r < k; ++r) keys[r] = residency_key(layer, experts[r], s.n_expert);
  auto argmin = [&](auto rank_of) {
    int32_t best = kNoSlot;
    uint64_t best_rank = ~uint64_t{0};
    for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
      if (rank_of(slot) < best_rank) {
        best_rank = rank_of(slot);
        best = slot;
      }
    }
    return best;
  };
  for (int32_t r = 0; r < k; ++r) {
    const int32_t slot = s.table[keys[r]];
    missed[r] = slot == kNoSlot ? 1 : 0;
    slot_of_rank[r] = slot;
    if (slot == kNoSlot) continue;
    ++out.n_hits;
    if (hit_refresh(s, pool, slot)) {
      demote(s, pool, argmin([&](int32_t i) { return demotion_rank(s, i); }));
    }
  }
  std::vector<uint64_t> ranks;
  for (int32_t slot = pool.slot_begin; slot < pool.slot_begin + pool.n_slots; ++slot) {
    ranks.push_back(victim_rank(s, slot, keys, k));
  }
  uint64_t last_victim_rank = 0;
  bool first_miss = true;
  for (int32_t r = 0; r < k; ++r) {
    if (!missed[r]) continue;
    const int32_t victim = argmin([&](int32_t i) {
      const uint64_t rank = ranks[static_cast<size_t>(i - pool.slot_begin)];
      return !first_miss && rank <= last_victim_rank ? ~uint64_t{0} : rank;
    });
    first_miss = false;
    last_victim_rank = ranks[static_cast<size_t>(victim - pool.slot_begin)];
    admit_miss(s, pool, victim, keys[r], evicted, &out);
    slot_of_rank[r] = victim;
  }
  return out;
}

TEST(MoeMathTest, SplitResidencyStepEqualsPolicyStep) {
  const int n_layer = 3, n_expert = 16, k = 4;
  for (int n_slots : {4, 9, 30}) {
    for (int protected_cap : {0, n_slots / 2, n_slots - 1}) {
      SCOPED_TRACE("slots " + std::to_string(n_slots) + " P " + std::to_string(protected_cap));
      HostResidency policy(n_layer, n_expert, n_slots, protected_cap);
      HostResidency split(n_layer, n_expert, n_slots, protected_cap);
      std::mt19937 rng(n_slots * 100 + protected_cap);
      // Skewed routing: low ids more often, so hits, promotions and evictions all occur.
      std::geometric_distribution<int> skew(0.25);
      for (int step = 0; step < 400; ++step) {
        const int32_t layer = step % n_layer;
        std::vector<int32_t> experts;
        while (static_cast<int>(experts.size()) < k) {
          const int32_t e = std::min(skew(rng), n_expert - 1);
          if (std::find(experts.begin(), experts.end(), e) == experts.end()) experts.push_back(e);
        }
        int32_t keys_a[k], keys_b[k], slots_a[k], slots_b[k], evicted_a[k], evicted_b[k];
        uint8_t missed_a[k], missed_b[k];
        const StepOutcome a = residency_step(policy.state, policy.pool, layer, experts.data(), k,
                                             keys_a, slots_a, missed_a, evicted_a);
        const StepOutcome b =
            SplitStep(split, layer, experts.data(), k, keys_b, slots_b, missed_b, evicted_b);
        ASSERT_TRUE(policy == split) << "step " << step;
        ASSERT_EQ(a.n_hits, b.n_hits);
        ASSERT_EQ(a.n_misses, b.n_misses);
        ASSERT_EQ(a.n_evictions, b.n_evictions);
        for (int r = 0; r < k; ++r) {
          ASSERT_EQ(keys_a[r], keys_b[r]);
          ASSERT_EQ(slots_a[r], slots_b[r]);
          ASSERT_EQ(missed_a[r], missed_b[r]);
        }
        for (int e = 0; e < a.n_evictions; ++e) ASSERT_EQ(evicted_a[e], evicted_b[e]);
      }
      EXPECT_GT(policy.clock, 400u);  // the sequence really ran the policy
    }
  }
}

TEST(SampleMathTest, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32_10.
  const uint32_t zero_counter[4] = {0, 0, 0, 0};
  const uint32_t zero_key[2] = {0, 0};
  uint32_t out[4];
  philox4x32_10(zero_counter, zero_key, out);
  EXPECT_EQ(out[0], 0x6627e8d5u);
  EXPECT_EQ(out[1], 0xe169c58du);
  EXPECT_EQ(out[2], 0xbc57ac4cu);
  EXPECT_EQ(out[3], 0x9b00dbd8u);
  const uint32_t ones_counter[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
  const uint32_t ones_key[2] = {0xffffffffu, 0xffffffffu};
  philox4x32_10(ones_counter, ones_key, out);
  EXPECT_EQ(out[0], 0x408f276du);
  EXPECT_EQ(out[1], 0x41c83b0eu);
  EXPECT_EQ(out[2], 0xa20bc7c6u);
  EXPECT_EQ(out[3], 0x6d5451fdu);
}

SamplingParams Sampling(float temperature, float top_p, int32_t top_k = 0, float min_p = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.min_p = min_p;
  return p;
}

// The share of an even grid of draws each of n tokens gets (within 5e-4 of the
// probability: each of a token's two boundaries is off by at most one step).
std::vector<double> DrawShares(const float* logits, int32_t n, const SamplingParams& params) {
  std::vector<double> shares(static_cast<size_t>(n), 0.0);
  const int n_draws = 4000;
  for (int d = 0; d < n_draws; ++d) {
    const int32_t token = sample_token(logits, n, params, (d + 0.5f) / n_draws);
    EXPECT_GE(token, 0);
    EXPECT_LT(token, n);
    if (token >= 0 && token < n) shares[static_cast<size_t>(token)] += 1.0 / n_draws;
  }
  return shares;
}

TEST(FixedMathTest, ExpNonpositiveIsExpWithinTwoUlpsAndExactAtZero) {
  EXPECT_EQ(exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(-0.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(-88.0f), 0.0f);
  EXPECT_EQ(exp_nonpositive(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(exp_nonpositive(NAN)));
  for (float x = -87.0f; x <= 0.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    const float got = exp_nonpositive(x);
    const float ulp = std::nextafter(static_cast<float>(want), 1.0f) - static_cast<float>(want);
    EXPECT_LE(std::fabs(got - want), 2.0 * ulp) << x;
  }
}

TEST(SampleMathTest, SumsHaveTheFixedShape) {
  // The pairwise tree, written out for 8 of the 1024 leaves (the rest 0).
  float sums[kSampleRuns] = {};
  const float v[8] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0f, 0.5f, 0.25f, 7.0f};
  for (int i = 0; i < 8; ++i) sums[i] = v[i];
  const float want = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  EXPECT_EQ(sample_tree_sum(sums), want);
  // Runs cover [0, n) in order, contiguous.
  for (int32_t n : {1, 7, 1024, 1025, 151936}) {
    int32_t expected_begin = 0;
    for (int32_t r = 0; r < kSampleRuns; ++r) {
      int32_t begin, end;
      sample_run(n, r, &begin, &end);
      EXPECT_EQ(begin, expected_begin) << n << " run " << r;
      EXPECT_LE(begin, end);
      expected_begin = end;
    }
    EXPECT_EQ(expected_begin, n);
  }
}

// Probabilities 0.5, 0.3, 0.15, 0.05 (as logits, shuffled), temperature 1.
TEST(SampleMathTest, TopKKeepsTheKLargestAndTiesAtTheBoundary) {
  const float probs[] = {0.15f, 0.5f, 0.05f, 0.3f};
  float logits[4];
  for (int i = 0; i < 4; ++i) logits[i] = std::log(probs[i]);
  std::vector<double> shares = DrawShares(logits, 4, Sampling(1.0f, 1.0f, 2));
  EXPECT_NEAR(shares[1], 0.5 / 0.8, 5e-4);
  EXPECT_NEAR(shares[3], 0.3 / 0.8, 5e-4);
  EXPECT_EQ(shares[0] + shares[2], 0.0);
  shares = DrawShares(logits, 4, Sampling(1.0f, 1.0f, 4));  // k = n: no cut
  EXPECT_NEAR(shares[2], 0.05, 5e-4);
  const float tied[] = {1.0f, 2.0f, 2.0f, 0.0f};
  shares = DrawShares(tied, 4, Sampling(1.0f, 1.0f, 1));
  EXPECT_NEAR(shares[1], 0.5, 5e-4);
  EXPECT_NEAR(shares[2], 0.5, 5e-4);
}

TEST(SampleMathTest, MinPDropsTokensBelowItsShareOfTheLargest) {
  const float probs[] = {0.15f, 0.5f, 0.05f, 0.3f};
  float logits[4];
  for (int i = 0; i < 4; ++i) logits[i] = std::log(probs[i]);
  // 0.05 / 0.5 = 0.1 < 0.2 <= 0.15 / 0.5.
  const std::vector<double> shares = DrawShares(logits, 4, Sampling(1.0f, 1.0f, 0, 0.2f));
  EXPECT_EQ(shares[2], 0.0);
  EXPECT_NEAR(shares[0], 0.15 / 0.95, 5e-4);
  EXPECT_NEAR(shares[1], 0.5 / 0.95, 5e-4);
}

// As in llama.cpp's chain, the cuts see the untempered probabilities and the
// temperature only reshapes the draw among the survivors.
TEST(SampleMathTest, TheCutsComeBeforeTheTemperature) {
  const float probs[] = {0.15f, 0.5f, 0.05f, 0.3f};
  float logits[4];
  for (int i = 0; i < 4; ++i) logits[i] = std::log(probs[i]);
  const float t = 5.0f;
  // top_p 0.7 keeps 0.5 and 0.3 (0.8 >= 0.7 > 0.5); at T = 5 they are drawn
  // in proportion 0.5^(1/5) : 0.3^(1/5).
  const std::vector<double> shares = DrawShares(logits, 4, Sampling(t, 0.7f));
  const double a = std::pow(0.5, 1.0 / t), b = std::pow(0.3, 1.0 / t);
  EXPECT_NEAR(shares[1], a / (a + b), 5e-4);
  EXPECT_NEAR(shares[3], b / (a + b), 5e-4);
  EXPECT_EQ(shares[0] + shares[2], 0.0);
}

TEST(SampleMathTest, NaNLogitsAreNeverDrawn) {
  const float logits[] = {NAN, 0.0f, NAN, 0.0f};
  const std::vector<double> shares = DrawShares(logits, 4, Sampling(1.0f, 0.9f, 3, 0.01f));
  EXPECT_EQ(shares[0] + shares[2], 0.0);
  // Nothing survives: the argmax (NaN ranks as -inf), so a token is always in range.
  const float all_nan[] = {NAN, NAN};
  EXPECT_EQ(sample_token(all_nan, 2, Sampling(1.0f, 0.5f), 0.3f), 0);
  EXPECT_TRUE(sampling_params_valid(Sampling(0.8f, 0.95f, 40, 0.05f)));
  EXPECT_FALSE(sampling_params_valid(Sampling(-1.0f, 1.0f)));
  EXPECT_FALSE(sampling_params_valid(Sampling(1.0f, 0.0f)));
  EXPECT_FALSE(sampling_params_valid(Sampling(1.0f, 1.0f, -1)));
  EXPECT_FALSE(sampling_params_valid(Sampling(1.0f, 1.0f, 0, 1.5f)));
  EXPECT_FALSE(sampling_params_valid(Sampling(NAN, 1.0f)));
}

TEST(SampleMathTest, UniformDrawsStayInUnitIntervalAndDependOnSeedAndStep) {
  EXPECT_EQ(uniform_from_bits(0u), 0.0f);
  EXPECT_LT(uniform_from_bits(0xffffffffu), 1.0f);
  EXPECT_EQ(sample_uniform(42, 7), sample_uniform(42, 7));
  EXPECT_NE(sample_uniform(42, 7), sample_uniform(42, 8));
  EXPECT_NE(sample_uniform(42, 7), sample_uniform(43, 7));
  double mean = 0.0;
  for (int32_t step = 0; step < 10000; ++step) mean += sample_uniform(1234, step);
  EXPECT_NEAR(mean / 10000, 0.5, 0.02);
}

TEST(SampleMathTest, NearZeroTemperatureIsArgmax) {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = Gaussian(rng, 1000, 3.0f);
    const int32_t argmax = ArgMax(logits);
    for (float u : {0.0f, 0.3f, 0.999f}) {
      EXPECT_EQ(sample_token(logits.data(), 1000, Sampling(1e-4f, 1.0f), u), argmax);
      EXPECT_EQ(sample_token(logits.data(), 1000, Sampling(1e-4f, 0.9f), u), argmax);
      EXPECT_EQ(sample_token(logits.data(), 1000, Sampling(0.0f, 0.9f), u), argmax);
    }
  }
  EXPECT_TRUE(sample_is_greedy(0.0f));
  EXPECT_FALSE(sample_is_greedy(1e-4f));
}

TEST(SampleMathTest, SmallTopPKeepsOnlyTheTopToken) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = Gaussian(rng, 500);
    const int32_t argmax = ArgMax(logits);
    for (float u : {0.0f, 0.5f, 0.9999f}) {
      EXPECT_EQ(sample_token(logits.data(), 500, Sampling(1.0f, 1e-6f), u), argmax);
      EXPECT_EQ(sample_token(logits.data(), 500, Sampling(1.0f, 1.0f, 1), u), argmax);
    }
  }
}

// With probabilities 0.5, 0.3, 0.15, 0.05 (temperature 1), counts over an even
// grid of draws follow the nucleus's renormalised probabilities.
TEST(SampleMathTest, DrawsFollowTheNucleusDistribution) {
  const float probs[] = {0.15f, 0.5f, 0.05f, 0.3f};
  float logits[4];
  for (int i = 0; i < 4; ++i) logits[i] = std::log(probs[i]);
  struct Case {
    float top_p;
    float expected[4];
  };
  const Case cases[] = {
      {1.0f, {0.15f, 0.5f, 0.05f, 0.3f}},
      {0.9f, {0.15f / 0.95f, 0.5f / 0.95f, 0.0f, 0.3f / 0.95f}},  // 0.95 >= 0.9 > 0.8
      {0.7f, {0.0f, 0.5f / 0.8f, 0.0f, 0.3f / 0.8f}},
      {0.45f, {0.0f, 1.0f, 0.0f, 0.0f}},
  };
  const int n_draws = 4000;
  for (const Case& c : cases) {
    int counts[4] = {0, 0, 0, 0};
    for (int d = 0; d < n_draws; ++d) {
      const float u = (d + 0.5f) / n_draws;
      const int32_t token = sample_token(logits, 4, Sampling(1.0f, c.top_p), u);
      ASSERT_GE(token, 0);
      ASSERT_LT(token, 4);
      ++counts[token];
    }
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(counts[i] / static_cast<double>(n_draws), c.expected[i], 5e-4)
          << "top_p " << c.top_p << " token " << i;
    }
  }
}

TEST(SampleMathTest, TemperatureFlattensTheDistribution) {
  const float logits[] = {0.0f, 1.0f};
  // P(token 1) = sigmoid(1 / T): 0.731 at T = 1, 0.5498 at T = 5.
  for (float temperature : {1.0f, 5.0f}) {
    const double p1 = 1.0 / (1.0 + std::exp(-1.0 / temperature));
    int ones = 0;
    const int n_draws = 10000;
    for (int d = 0; d < n_draws; ++d) {
      ones += sample_token(logits, 2, Sampling(temperature, 1.0f), (d + 0.5f) / n_draws) == 1;
    }
    EXPECT_NEAR(ones / static_cast<double>(n_draws), p1, 5e-4) << temperature;
  }
}

}  // namespace
}  // namespace moegraph
