// The CPU path's pieces: activation quantization as ggml's reference code, the
// SIMD dot products on every target this machine runs (the portable one,
// EMU128 or SCALAR, included) against the scalar ones, the x86 targets' against
// ggml's own results bit for bit, and the thread pool.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/act_quant.h"
#include "cpu/simd_kernels.h"
#include "cpu/thread_pool.h"
#include "reference/delta_net.h"
#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"

namespace moegraph {
namespace {

constexpr GgmlType kTypes[] = {
    GgmlType::kF32,  GgmlType::kF16,    GgmlType::kBF16,   GgmlType::kQ8_0,
    GgmlType::kQ4_0, GgmlType::kQ4_K,   GgmlType::kQ5_K,   GgmlType::kQ6_K,
    GgmlType::kQ4_1, GgmlType::kQ5_0,   GgmlType::kQ5_1,   GgmlType::kQ2_K,
    GgmlType::kQ3_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS, GgmlType::kMXFP4};

std::vector<float> RandomFloats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// rows x cols weights of type, quantized from random floats (kept in `values`).
std::vector<uint8_t> RandomWeights(GgmlType type, int64_t rows, int64_t cols, uint32_t seed,
                                   std::vector<float>* values) {
  *values = RandomFloats(rows * cols, seed, 0.05f);
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> w(row_bytes * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(type, values->data() + r * cols, w.data() + r * row_bytes, cols);
    dequantize_row(type, w.data() + r * row_bytes, values->data() + r * cols, cols);
  }
  return w;
}

// Restores the best target when a test that forced one ends.
class SimdTargetsTest : public ::testing::Test {
 protected:
  void TearDown() override { SimdForceTarget(0); }
};

TEST(ActQuantTest, Q8_0MatchesGgmlsReference) {
  std::vector<float> x = RandomFloats(64, 1);
  x[5] = 0.0f;
  std::vector<uint8_t> q(act_row_bytes(ActType::kQ8_0, 64));
  quantize_act_row(ActType::kQ8_0, x.data(), 64, q.data());
  const auto* b = reinterpret_cast<const block_q8_0*>(q.data());
  for (int blk = 0; blk < 2; ++blk) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[blk * 32 + j]));
    const float d = amax / 127.0f;
    EXPECT_EQ(b[blk].d, f32_to_f16(d));
    for (int j = 0; j < 32; ++j) {
      EXPECT_EQ(b[blk].qs[j], static_cast<int8_t>(std::round(x[blk * 32 + j] / d))) << j;
    }
  }
}

// q8_1 (for q4_1 / q5_1 weights) is q8_0's quants and scale with s = d * sum(qs).
TEST(ActQuantTest, Q8_1IsQ8_0WithTheScaledSum) {
  const std::vector<float> x = RandomFloats(96, 7);
  std::vector<uint8_t> q0(act_row_bytes(ActType::kQ8_0, 96)), q1(act_row_bytes(ActType::kQ8_1, 96));
  ASSERT_EQ(q1.size(), 3 * sizeof(block_q8_1));
  quantize_act_row(ActType::kQ8_0, x.data(), 96, q0.data());
  quantize_act_row(ActType::kQ8_1, x.data(), 96, q1.data());
  const auto* b0 = reinterpret_cast<const block_q8_0*>(q0.data());
  const auto* b1 = reinterpret_cast<const block_q8_1*>(q1.data());
  for (int blk = 0; blk < 3; ++blk) {
    EXPECT_EQ(b1[blk].d, b0[blk].d);
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      EXPECT_EQ(b1[blk].qs[j], b0[blk].qs[j]) << j;
      sum += b1[blk].qs[j];
    }
    EXPECT_EQ(b1[blk].s, f32_to_f16(static_cast<float>(sum) * f16_to_f32(b1[blk].d)));
    EXPECT_NE(sum, 0);
  }
}

TEST(ActQuantTest, Q8_KKeepsTheSignedMaxAtMinus127AndSumsEach16) {
  std::vector<float> x = RandomFloats(256, 2);
  x[77] = 9.0f;  // the largest magnitude, positive: ggml's iscale = -127 / max
  std::vector<uint8_t> q(act_row_bytes(ActType::kQ8_K, 256));
  quantize_act_row(ActType::kQ8_K, x.data(), 256, q.data());
  const auto* b = reinterpret_cast<const block_q8_K*>(q.data());
  EXPECT_EQ(b->qs[77], -127);
  EXPECT_FLOAT_EQ(b->d, -9.0f / 127.0f);
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += b->qs[16 * g + i];
    EXPECT_EQ(b->bsums[g], sum);
  }
  // All zero: d 0 and zero quants, no division by zero.
  std::vector<float> zeros(256, 0.0f);
  quantize_act_row(ActType::kQ8_K, zeros.data(), 256, q.data());
  EXPECT_EQ(b->d, 0.0f);
  EXPECT_EQ(b->qs[0], 0);
}

// The scalar dot equals the dequantized weights dotted (in f64) with the
// dequantized activations, up to float rounding: the integer path is exact.
TEST(ActQuantTest, ScalarDotsEqualTheDequantizedDot) {
  constexpr int64_t kCols = 512;
  for (const GgmlType type : kTypes) {
    std::vector<float> w_values;
    const std::vector<uint8_t> w = RandomWeights(type, 1, kCols, 3, &w_values);
    const std::vector<float> x = RandomFloats(kCols, 4);
    const ActType at = act_type_for(type);
    std::vector<uint8_t> act(act_row_bytes(at, kCols));
    quantize_act_row(at, x.data(), kCols, act.data());
    std::vector<float> x_seen(kCols);
    // q8_1 carries s = d * sum(qs) rounded to f16, which ggml multiplies by the
    // weights' min in place of the exact sum.
    double min_times_s_rounding = 0.0;
    if (at == ActType::kQ8_0) {
      dequantize_row(GgmlType::kQ8_0, act.data(), x_seen.data(), kCols);
    } else if (at == ActType::kQ8_1) {
      const auto* b = reinterpret_cast<const block_q8_1*>(act.data());
      const size_t w_block = quant_block_bytes(type);
      for (int64_t blk = 0; blk < kCols / 32; ++blk) {
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          x_seen[32 * blk + j] = f16_to_f32(b[blk].d) * b[blk].qs[j];
          sum += b[blk].qs[j];
        }
        uint16_t m;  // q4_1 and q5_1 keep the min right after d
        std::memcpy(&m, w.data() + blk * w_block + 2, sizeof(m));
        min_times_s_rounding +=
            static_cast<double>(f16_to_f32(m)) *
            (f16_to_f32(b[blk].s) - static_cast<double>(f16_to_f32(b[blk].d)) * sum);
      }
    } else if (at == ActType::kQ8_K) {
      const auto* b = reinterpret_cast<const block_q8_K*>(act.data());
      for (int64_t i = 0; i < kCols; ++i) x_seen[i] = b[i / 256].d * b[i / 256].qs[i % 256];
    } else {
      x_seen = x;
    }
    double want = min_times_s_rounding, magnitude = 0.0;
    for (int64_t i = 0; i < kCols; ++i) {
      want += static_cast<double>(w_values[i]) * x_seen[i];
      magnitude += std::fabs(static_cast<double>(w_values[i]) * x_seen[i]);
    }
    const float got = dot_row_ref(type, w.data(), act.data(), kCols);
    EXPECT_NEAR(got, want, 1e-5 * magnitude) << ggml_type_name(static_cast<uint32_t>(type));
  }
}

// 6 activation rows: one tile of 4 (the x86 kernels unpack a weight block once
// for 4 rows) and 2 rows alone; each must equal its row computed alone.
// Forcing a target narrows the calls, not the list of targets the CPU runs.
TEST_F(SimdTargetsTest, TheListStaysWholeWhileATargetIsForced) {
  const std::vector<int64_t> all = SimdTargets();
  ASSERT_FALSE(all.empty());
  SimdForceTarget(all.back());
  EXPECT_EQ(SimdTargets(), all);
  EXPECT_EQ(SimdTargetName(), SimdTargetName(all.back()));
  SimdForceTarget(0);
  EXPECT_EQ(SimdTargetName(), SimdTargetName(all.front()));
}

TEST_F(SimdTargetsTest, EveryTargetEqualsTheScalarDotsUpToRounding) {
  constexpr int64_t kRows = 8, kCols = 768, kAct = 6;
  const std::vector<int64_t> targets = SimdTargets();
  ASSERT_FALSE(targets.empty());
  bool saw_portable = false;
  for (const int64_t target : targets) {
    saw_portable |= SimdTargetName(target) == "EMU128" || SimdTargetName(target) == "SCALAR";
  }
  EXPECT_TRUE(saw_portable) << "the portable target must be built and tested";
  for (const GgmlType type : kTypes) {
    std::vector<float> w_values;
    const std::vector<uint8_t> w = RandomWeights(type, kRows, kCols, 5, &w_values);
    const ActType at = act_type_for(type);
    const size_t arb = act_row_bytes(at, kCols);
    std::vector<uint8_t> act(arb * kAct);
    for (int t = 0; t < kAct; ++t) {
      const std::vector<float> x = RandomFloats(kCols, 10 + t);
      quantize_act_row(at, x.data(), kCols, act.data() + t * arb);
    }
    for (const int64_t target : targets) {
      SimdForceTarget(target);
      ASSERT_EQ(SimdTargetName(), SimdTargetName(target));
      std::vector<float> out(kRows * kAct, NAN);
      MatMulArgs a;
      a.type = type;
      a.w = w.data();
      a.w_row_bytes = ggml_row_size(type, kCols);
      a.cols = kCols;
      a.row_begin = 1;  // row 0 untouched
      a.row_end = kRows;
      a.act = act.data();
      a.act_row_bytes = arb;
      a.n_act = kAct;
      a.out = out.data();
      a.out_stride = kRows;
      SimdMatMulRows(a);
      for (int t = 0; t < kAct; ++t) {
        std::vector<float> alone(kRows, NAN);
        MatMulArgs one = a;
        one.act = act.data() + t * arb;
        one.n_act = 1;
        one.out = alone.data();
        SimdMatMulRows(one);
        EXPECT_TRUE(std::isnan(out[t * kRows])) << "row 0 is outside the range";
        for (int64_t r = 1; r < kRows; ++r) {
          const float want =
              dot_row_ref(type, w.data() + r * a.w_row_bytes, act.data() + t * arb, kCols);
          EXPECT_NEAR(out[t * kRows + r], want, 2e-5f * (std::fabs(want) + 1.0f))
              << SimdTargetName(target) << " " << ggml_type_name(static_cast<uint32_t>(type))
              << " row " << r << " act " << t;
          EXPECT_EQ(out[t * kRows + r], alone[r])
              << SimdTargetName(target) << " " << ggml_type_name(static_cast<uint32_t>(type))
              << " row " << r << " act " << t << ": in a batch and alone differ";
        }
      }
    }
  }
}

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

uint64_t SplitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// golden_dot.c's golden_input: uniform in [-scale / 2, scale / 2), in exact
// float arithmetic (24 random bits, a power-of-two scale).
float GoldenInput(uint32_t seed, int64_t r, int64_t i, float scale) {
  const uint64_t h = SplitMix64((static_cast<uint64_t>(seed) << 48) ^
                                (static_cast<uint64_t>(r) << 32) ^ static_cast<uint64_t>(i));
  return (static_cast<float>(h >> 40) * 0x1p-24f - 0.5f) * scale;
}

// ggml's own dots: ggml_vec_dot_* of llama.cpp v0.5.0's CPU backend
// (node-llama-cpp 3.22.1's prebuilt libggml-cpu-haswell.so, the AVX2 build) for
// 2 weight rows (GoldenInput seed 1, scale 1/8, ggml_quantize_chunk) by 5
// activation rows (seed 2, scale 2, the vec_dot_type's from_float), weight row
// major; printed by tools/llama-crosscheck/golden-dot.sh.
struct GgmlDots {
  const char* type;
  int64_t cols;
  uint32_t bits[2 * 5];
};
// The lines as golden-dot.sh prints them.
// clang-format off
constexpr GgmlDots kGgmlDots[] = {
    {"q8_0", 800, {0xbee2a042, 0x3e61853b, 0x3e85af93, 0xbf24f3a0, 0x3f590257, 0x3ee10ae2, 0xbfc480fe, 0x3d847b30, 0xbe85d042, 0xbf2bd026}},
    {"q4_0", 800, {0xbeed1a9c, 0x3e829a78, 0x3e4c1597, 0xbf1e5dc0, 0x3f4209ea, 0x3ed03466, 0xbfc8191e, 0x3d3aee1c, 0xbe816760, 0xbf1666ee}},
    {"q4_1", 800, {0xbed3ac88, 0x3e415db8, 0x3e803278, 0xbf1d17e5, 0x3f5c2f9c, 0x3edb6558, 0xbfca99ee, 0x3c521d30, 0xbe8be0dc, 0xbf218e50}},
    {"q5_0", 800, {0xbed7fe02, 0x3e54b876, 0x3e8ba425, 0xbf2a3875, 0x3f554b72, 0x3ee2bbfd, 0xbfc3c556, 0x3d9fe26c, 0xbe8671c8, 0xbf368c4a}},
    {"q5_1", 800, {0xbeed2f50, 0x3e5239b0, 0x3e7f2cc1, 0xbf1d5ec3, 0x3f5e3dc6, 0x3ee3d9b8, 0xbfc52988, 0x3dbe05ac, 0xbe818cac, 0xbf27ae94}},
    {"iq4_nl", 800, {0xbeca2600, 0x3e62abb5, 0x3e9367c0, 0xbf214bac, 0x3f4598f7, 0x3ed638b0, 0xbfbf46cb, 0x3d1e449c, 0xbe9b542a, 0xbf3a5e94}},
    {"mxfp4", 800, {0xbedca61e, 0x3e7df7db, 0x3dc7c5e2, 0xbef641ea, 0x3f3c9708, 0x3f033cca, 0xbfb3d83b, 0x3e1813c4, 0xbe87ca4c, 0xbf2b8271}},
    {"q2_K", 768, {0xbefa80bc, 0x3d988666, 0x3e2e07d0, 0xbf548076, 0x3f14910a, 0x3e774894, 0xbfaa45d7, 0x3d412fdd, 0x3c3026a0, 0xbf46ec10}},
    {"q3_K", 768, {0xbeaa1022, 0x3e84d28c, 0x3e8261ef, 0xbf15a055, 0x3f2b5708, 0x3eabfcd8, 0xbfa528ef, 0x3e4017a5, 0xbe8b475a, 0xbf30a4b0}},
    {"q4_K", 768, {0xbee557b8, 0x3e980e2c, 0x3e5603ef, 0xbf217d52, 0x3f1bb500, 0x3e900298, 0xbfaec948, 0x3e4624a0, 0xbe9a7700, 0xbf444fc7}},
    {"q5_K", 768, {0xbef3ea50, 0x3ea2fdfa, 0x3e383abe, 0xbf1d35ef, 0x3f1906ac, 0x3e8ff130, 0xbfb07071, 0x3e3ae57b, 0xbe92dc93, 0xbf382274}},
    {"q6_K", 768, {0xbee7ca61, 0x3e940532, 0x3e47a2e2, 0xbf1ee8e0, 0x3f1b7da9, 0x3e8a37b8, 0xbfabf128, 0x3e328aa6, 0xbe94d550, 0xbf3dde1a}},
    {"iq4_xs", 768, {0xbec7b90f, 0x3e911624, 0x3e8b2cb2, 0xbf2145ca, 0x3f08e93f, 0x3e81fb10, 0xbfa9e206, 0x3e20a927, 0xbeb07bde, 0xbf47cbf2}},
};
// clang-format on

// The x86 targets follow ggml's AVX2 code operation for operation
// (cpu/simd_kernels.cc): their dots are ggml's bit for bit, in a tile of 2
// weight rows by 4 activation rows, by 1, and alone. Both sides quantize the
// same floats (moegraph's quantizers are ggml's byte for byte: quant_test).
TEST_F(SimdTargetsTest, TheX86TargetsGiveGgmlsDotsBitForBit) {
  constexpr int kRows = 2, kAct = 5;
  const std::vector<int64_t> targets = SimdTargets();
  bool saw_x86 = false;
  for (const GgmlDots& g : kGgmlDots) {
    GgmlType type;
    ASSERT_TRUE(ggml_type_from_name(g.type, &type)) << g.type;
    const size_t w_bytes = ggml_row_size(type, g.cols);
    const ActType at = act_type_for(type);
    const size_t arb = act_row_bytes(at, g.cols);
    std::vector<uint8_t> w(kRows * w_bytes), act(kAct * arb);
    std::vector<float> x(g.cols);
    for (int r = 0; r < kRows; ++r) {
      for (int64_t i = 0; i < g.cols; ++i) x[i] = GoldenInput(1, r, i, 0.125f);
      quantize_row(type, x.data(), w.data() + r * w_bytes, g.cols);
    }
    for (int t = 0; t < kAct; ++t) {
      for (int64_t i = 0; i < g.cols; ++i) x[i] = GoldenInput(2, t, i, 2.0f);
      quantize_act_row(at, x.data(), g.cols, act.data() + t * arb);
    }
    for (const int64_t target : targets) {
      if (SimdTargetName(target) != "AVX2" && SimdTargetName(target).rfind("AVX3", 0) != 0) continue;
      saw_x86 = true;
      SimdForceTarget(target);
      MatMulArgs a;
      a.type = type;
      a.w = w.data();
      a.w_row_bytes = w_bytes;
      a.cols = g.cols;
      a.row_end = kRows;
      a.act = act.data();
      a.act_row_bytes = arb;
      a.out_stride = kRows;
      std::vector<float> out(kAct * kRows, NAN), alone(kAct * kRows, NAN);
      a.n_act = kAct;
      a.out = out.data();
      SimdMatMulRows(a);
      for (int t = 0; t < kAct; ++t) {
        MatMulArgs one = a;
        one.act = act.data() + t * arb;
        one.n_act = 1;
        one.out = alone.data() + t * kRows;
        SimdMatMulRows(one);
      }
      for (int r = 0; r < kRows; ++r) {
        for (int t = 0; t < kAct; ++t) {
          const uint32_t want = g.bits[r * kAct + t];
          const std::string where = SimdTargetName(target) + " " + g.type + " row " +
                                    std::to_string(r) + " act " + std::to_string(t);
          EXPECT_EQ(Bits(out[t * kRows + r]), want) << where << " in a batch";
          EXPECT_EQ(Bits(alone[t * kRows + r]), want) << where << " alone";
        }
      }
    }
  }
  if (!saw_x86) GTEST_SKIP() << "no x86 SIMD target on this CPU";
}

TEST_F(SimdTargetsTest, AttentionHelpersOnEveryTarget) {
  const std::vector<int64_t> targets = SimdTargets();
  for (const int64_t n : {1, 7, 64, 100}) {
    const std::vector<float> a = RandomFloats(n, 20), b = RandomFloats(n, 21);
    std::vector<uint16_t> b16(static_cast<size_t>(n));
    double want = 0.0, want16 = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      b16[i] = f32_to_f16(b[i]);
      want += static_cast<double>(a[i]) * b[i];
      want16 += static_cast<double>(a[i]) * f16_to_f32(b16[i]);
    }
    for (const int64_t target : targets) {
      SimdForceTarget(target);
      EXPECT_NEAR(SimdDotF32(a.data(), b.data(), n), want, 1e-4) << SimdTargetName(target);
      EXPECT_NEAR(SimdDotF16(a.data(), b16.data(), n), want16, 1e-4) << SimdTargetName(target);
      std::vector<float> y(a), y16(a);
      SimdAxpyF32(0.5f, b.data(), y.data(), n);
      SimdAxpyF16(0.5f, b16.data(), y16.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_FLOAT_EQ(y[i], std::fma(0.5f, b[i], a[i])) << i;
        EXPECT_FLOAT_EQ(y16[i], std::fma(0.5f, f16_to_f32(b16[i]), a[i])) << i;
      }
    }
  }
}

// The gated delta rule's step, token after token from a random state, equals
// the oracle's recurrence (reference/delta_net.h, f64) on every target.
TEST_F(SimdTargetsTest, DeltaRuleStepIsTheOraclesRecurrenceOnEveryTarget) {
  const std::vector<int64_t> targets = SimdTargets();
  for (const int d : {8, 100, 128}) {
    const int n = 6;
    auto normalized = [&](std::vector<float> rows) {
      for (int t = 0; t < n; ++t) {
        double sum_sq = 0.0;
        for (int i = 0; i < d; ++i) sum_sq += double{rows[t * d + i]} * rows[t * d + i];
        for (int i = 0; i < d; ++i) rows[t * d + i] /= static_cast<float>(std::sqrt(sum_sq));
      }
      return rows;
    };
    const std::vector<float> q = normalized(RandomFloats(n * d, 30));
    const std::vector<float> k = normalized(RandomFloats(n * d, 31));
    const std::vector<float> v = RandomFloats(n * d, 32), m0 = RandomFloats(d * d, 33, 0.5f);
    const std::vector<float> g = {-0.1f, -1.5f, -0.02f, -0.7f, 0.0f, -2.0f};
    const std::vector<float> beta = {0.9f, 0.1f, 0.5f, 1.0f, 0.3f, 0.7f};
    std::vector<double> m(m0.begin(), m0.end()), o(static_cast<size_t>(n) * d);
    DeltaRule(d, std::vector<double>(q.begin(), q.end()), std::vector<double>(k.begin(), k.end()),
              std::vector<double>(v.begin(), v.end()), std::vector<double>(g.begin(), g.end()),
              std::vector<double>(beta.begin(), beta.end()), absl::MakeSpan(m), absl::MakeSpan(o));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (const int64_t target : targets) {
      SimdForceTarget(target);
      std::vector<float> state = m0, out(static_cast<size_t>(n) * d);
      for (int t = 0; t < n; ++t) {
        SimdDeltaRuleStep(d, q.data() + t * d, k.data() + t * d, v.data() + t * d,
                          std::exp(g[t]), beta[t], scale, state.data(), out.data() + t * d);
      }
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], o[i], 2e-5) << SimdTargetName(target) << " d " << d << " " << i;
      }
      for (size_t i = 0; i < state.size(); ++i) {
        ASSERT_NEAR(state[i], m[i], 2e-5) << SimdTargetName(target) << " d " << d << " " << i;
      }
    }
  }
}

// One head over n positions of an interleaved cache (rows of 2 heads): the
// softmax-weighted sum of v, against f64 arithmetic on the same (f16) values;
// the same positions wrapped in a ring give the same bits.
TEST_F(SimdTargetsTest, AttendHeadIsSoftmaxWeightedValuesOnEveryTarget) {
  constexpr int kHeadDim = 64;
  constexpr int64_t kPositions = 37;
  const std::vector<float> q = RandomFloats(kHeadDim, 30);
  const std::vector<float> k = RandomFloats(2 * kHeadDim * kPositions, 31);
  const std::vector<float> v = RandomFloats(2 * kHeadDim * kPositions, 32);
  std::vector<uint16_t> k16(k.size()), v16(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k16[i] = f32_to_f16(k[i]);
    v16[i] = f32_to_f16(v[i]);
  }
  const float scale = 0.125f;
  const std::vector<int64_t> targets = SimdTargets();
  for (const bool f16 : {false, true}) {
    // Head 1 of each row: elements [kHeadDim, 2 * kHeadDim).
    auto at = [&](const std::vector<float>& f, const std::vector<uint16_t>& h, int64_t j, int d) {
      const size_t i = static_cast<size_t>(j * 2 * kHeadDim + kHeadDim + d);
      return f16 ? static_cast<double>(f16_to_f32(h[i])) : static_cast<double>(f[i]);
    };
    std::vector<double> score(kPositions);
    double max = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < kPositions; ++j) {
      for (int d = 0; d < kHeadDim; ++d) score[j] += q[d] * at(k, k16, j, d);
      score[j] *= scale;
      max = std::max(max, score[j]);
    }
    for (double& s : score) sum += (s = std::exp(s - max));
    std::vector<double> want(kHeadDim, 0.0);
    for (int64_t j = 0; j < kPositions; ++j) {
      for (int d = 0; d < kHeadDim; ++d) want[d] += score[j] / sum * at(v, v16, j, d);
    }
    // A sink 2 above the top score: one more column, e^2 times the top one's.
    const float sink = static_cast<float>(max + 2.0);
    const double sink_scale = sum / (sum + std::exp(2.0));
    const size_t elem = f16 ? 2 : 4;
    const uint8_t* kb = f16 ? reinterpret_cast<const uint8_t*>(k16.data())
                            : reinterpret_cast<const uint8_t*>(k.data());
    const uint8_t* vb = f16 ? reinterpret_cast<const uint8_t*>(v16.data())
                            : reinterpret_cast<const uint8_t*>(v.data());
    for (const int64_t target : targets) {
      SimdForceTarget(target);
      std::vector<float> scores(kPositions), out(kHeadDim, NAN);
      SimdAttendHeads(q.data(), 1, kb + kHeadDim * elem, vb + kHeadDim * elem, 2 * kHeadDim * elem,
                      f16, 0, kPositions, 0, kHeadDim, scale, nullptr, scores.data(), out.data());
      for (int d = 0; d < kHeadDim; ++d) {
        EXPECT_NEAR(out[d], want[d], 1e-5) << SimdTargetName(target) << " f16 " << f16 << " " << d;
      }
      SimdAttendHeads(q.data(), 1, kb + kHeadDim * elem, vb + kHeadDim * elem, 2 * kHeadDim * elem,
                      f16, 0, kPositions, 0, kHeadDim, scale, &sink, scores.data(), out.data());
      for (int d = 0; d < kHeadDim; ++d) {
        EXPECT_NEAR(out[d], want[d] * sink_scale, 1e-5) << SimdTargetName(target) << " sink " << d;
      }
      // The same positions in a ring of kPositions + 3 rows, starting at
      // position 50 (row 10): wrapped after 30 of them, and the same bits.
      constexpr int64_t kRows = kPositions + 3, kFirst = 50;
      const size_t row = 2 * kHeadDim * elem;
      std::vector<uint8_t> k_ring(kRows * row), v_ring(kRows * row);
      for (int64_t j = 0; j < kPositions; ++j) {
        const size_t at_row = static_cast<size_t>((kFirst + j) % kRows) * row;
        std::memcpy(k_ring.data() + at_row, kb + j * row, row);
        std::memcpy(v_ring.data() + at_row, vb + j * row, row);
      }
      std::vector<float> ring_out(kHeadDim, NAN);
      SimdAttendHeads(q.data(), 1, k_ring.data() + kHeadDim * elem, v_ring.data() + kHeadDim * elem,
                      row, f16, kFirst, kPositions, kRows, kHeadDim, scale, &sink, scores.data(),
                      ring_out.data());
      for (int d = 0; d < kHeadDim; ++d) {
        EXPECT_EQ(ring_out[d], out[d]) << SimdTargetName(target) << " ring " << d;
      }
    }
  }
}

// Heads of 64 and 128 elements keep the output in registers and a GQA group
// shares each K row's loads (AttendGroupInRegisters); every head size, alone
// or in a group of 3, gives each head the bits of the general loop: scores by
// SimdDotF16/F32, softmax in f64, values by SimdAxpyF16/F32.
TEST_F(SimdTargetsTest, AttentionHeadsOfEverySizeGiveTheGeneralLoopsBits) {
  constexpr int64_t kPositions = 37;
  const std::vector<int64_t> targets = SimdTargets();
  for (const int head_dim : {32, 64, 96, 128}) {
    const std::vector<float> k = RandomFloats(head_dim * kPositions, 42);
    const std::vector<float> v = RandomFloats(head_dim * kPositions, 43);
    std::vector<uint16_t> k16(k.size()), v16(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k16[i] = f32_to_f16(k[i]);
      v16[i] = f32_to_f16(v[i]);
    }
    for (const int heads : {1, 3}) {
      const std::vector<float> q = RandomFloats(heads * head_dim, 41 + heads);
      for (const int64_t target : targets) {
        SimdForceTarget(target);
        for (const bool f16 : {false, true}) {
          for (const bool with_sinks : {false, true}) {
            const std::vector<float> sinks = {0.5f, -0.25f, 1.0f};
            const float scale = 0.125f;
            std::vector<float> want(heads * head_dim, 0.0f);
            for (int h = 0; h < heads; ++h) {
              const float* qh = q.data() + h * head_dim;
              const float sink = with_sinks ? sinks[h] : -INFINITY;
              std::vector<float> scores(kPositions);
              float max = sink;
              for (int64_t j = 0; j < kPositions; ++j) {
                scores[j] = scale * (f16 ? SimdDotF16(qh, k16.data() + j * head_dim, head_dim)
                                         : SimdDotF32(qh, k.data() + j * head_dim, head_dim));
                max = std::max(max, scores[j]);
              }
              double sum = sink == -INFINITY ? 0.0 : std::exp(static_cast<double>(sink) - max);
              for (float& s : scores) sum += (s = std::exp(s - max));
              float* wh = want.data() + h * head_dim;
              for (int64_t j = 0; j < kPositions; ++j) {
                if (f16) {
                  SimdAxpyF16(scores[j], v16.data() + j * head_dim, wh, head_dim);
                } else {
                  SimdAxpyF32(scores[j], v.data() + j * head_dim, wh, head_dim);
                }
              }
              const float inv = static_cast<float>(1.0 / sum);
              for (int d = 0; d < head_dim; ++d) wh[d] *= inv;
            }

            const size_t stride = static_cast<size_t>(head_dim) * (f16 ? 2 : 4);
            const uint8_t* kb = f16 ? reinterpret_cast<const uint8_t*>(k16.data())
                                    : reinterpret_cast<const uint8_t*>(k.data());
            const uint8_t* vb = f16 ? reinterpret_cast<const uint8_t*>(v16.data())
                                    : reinterpret_cast<const uint8_t*>(v.data());
            std::vector<float> got(heads * head_dim, NAN), scratch(heads * kPositions);
            SimdAttendHeads(q.data(), heads, kb, vb, stride, f16, 0, kPositions, 0, head_dim,
                            scale, with_sinks ? sinks.data() : nullptr, scratch.data(),
                            got.data());
            for (int i = 0; i < heads * head_dim; ++i) {
              ASSERT_EQ(got[i], want[i])
                  << SimdTargetName(target) << " head_dim " << head_dim << " heads " << heads
                  << " f16 " << f16 << " sinks " << with_sinks << " element " << i;
            }
          }
        }
      }
    }
  }
}

// SimdQuantizeActRow gives quantize_act_row's bytes on every target: random
// rows, a zero block, halves exactly between two quants (q8_0 rounds them
// away from zero, q8_K to even), and the largest magnitude twice with both
// signs (the first sets q8_K's sign).
TEST_F(SimdTargetsTest, ActivationRowsQuantizeToTheReferencesBytes) {
  constexpr int64_t kCols = 4 * QK_K;
  std::vector<float> x = RandomFloats(kCols, 50);
  std::fill(x.begin() + QK_K, x.begin() + QK_K + QK8_0, 0.0f);  // q8_0 block 8, in q8_K block 1
  // Block 9 (q8_0) / block 2 (q8_K, with -127 its max): scale 1, so x itself is x * id.
  const int64_t tie = 2 * QK_K;
  std::fill(x.begin() + tie, x.begin() + tie + QK_K, 0.25f);
  x[tie] = 127.0f;
  x[tie + 1] = -127.0f;
  x[tie + 2] = 2.5f;
  x[tie + 3] = -3.5f;
  x[tie + 4] = 0.5f;
  x[tie + 5] = -0.5f;
  x[tie + 6] = 126.5f;
  x[tie + 7] = 1.5f;
  x[3 * QK_K + 5] = -9.0f;  // block 3's largest magnitude, first negative
  x[3 * QK_K + 9] = 9.0f;
  const std::vector<int64_t> targets = SimdTargets();
  for (const ActType type : {ActType::kQ8_0, ActType::kQ8_K, ActType::kQ8_1, ActType::kF32}) {
    const size_t bytes = act_row_bytes(type, kCols);
    std::vector<uint8_t> want(bytes);
    quantize_act_row(type, x.data(), kCols, want.data());
    for (const int64_t target : targets) {
      SimdForceTarget(target);
      std::vector<uint8_t> got(bytes, 0xAB);
      SimdQuantizeActRow(type, x.data(), kCols, got.data());
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(got[i], want[i]) << SimdTargetName(target) << " type " << static_cast<int>(type)
                                   << " byte " << i;
      }
    }
  }
}

// A row of NaNs (a model that overflowed) quantizes without reading past its
// end on every target: the row ends where a page no one may read begins.
TEST_F(SimdTargetsTest, ANanRowQuantizesWithoutReadingPastItsEnd) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* map = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  ASSERT_EQ(mprotect(static_cast<uint8_t*>(map) + page, page, PROT_NONE), 0);
  float* row = reinterpret_cast<float*>(static_cast<uint8_t*>(map) + page) - QK_K;
  std::fill(row, row + QK_K, std::nanf(""));
  for (const int64_t target : SimdTargets()) {
    SimdForceTarget(target);
    for (const ActType type : {ActType::kQ8_0, ActType::kQ8_K, ActType::kQ8_1}) {
      std::vector<uint8_t> out(act_row_bytes(type, QK_K));
      SimdQuantizeActRow(type, row, QK_K, out.data());
    }
  }
  munmap(map, 2 * page);
}

TEST(ThreadPoolTest, EveryTaskRunsOnceInEveryJob) {
  for (const int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int job = 0; job < 100; ++job) {
      const int64_t n = job % 13;
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      pool.Run(n, [&](int64_t task) { runs[task].fetch_add(1); });
      for (int64_t t = 0; t < n; ++t) ASSERT_EQ(runs[t].load(), 1) << job << " " << t;
    }
  }
}

// Jobs larger than the cursor's unit count (tasks grouped into units), jobs
// back to back faster than sleeping workers wake, and more threads than cores.
TEST(ThreadPoolTest, EveryTaskRunsOnceInLargeAndBackToBackJobs) {
  for (const int threads : {2, 5}) {
    ThreadPool pool(threads);
    for (int job = 0; job < 3000; ++job) {
      const int64_t n = job % 500 == 0 ? 200003 : job % 7;
      std::vector<int> runs(static_cast<size_t>(n));  // plain ints: Run must publish them
      pool.Run(n, [&](int64_t task) { ++runs[task]; });
      for (int64_t t = 0; t < n; ++t) ASSERT_EQ(runs[t], 1) << job << " " << t;
    }
  }
}

TEST(ThreadPoolTest, CoreCountsArePositiveAndPhysicalAtMostLogical) {
  EXPECT_GE(PhysicalCores(), 1);
  EXPECT_LE(PhysicalCores(), LogicalCpus());
}

}  // namespace
}  // namespace moegraph
