// The prompt matmuls, q8_0 and q4_K on AMX tiles (cpu/amx_matmul.h) and on
// AVX-512 VNNI (cpu/vnni_matmul.h): each kernel against its scalar reference
// bit for bit over shapes that exercise every tile padding and pass length, a
// row's result alone against in a batch, the references against an f64 dot
// (q8_0) and ggml's generic dot (q4_K), and the availability checks against
// the CPU's flags.
#include "cpu/amx_matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/act_quant.h"
#include "cpu/vnni_matmul.h"
#include "loader/quant.h"

namespace moegraph {
namespace {

// Random q8_0 rows as ggml's quantizer makes them: quants in [-127, 127] and
// f16 scales rounded from real floats. pad_bytes of junk after each row.
std::vector<uint8_t> RandomRows(int64_t rows, int64_t cols, size_t pad_bytes, uint32_t seed) {
  const int64_t nb = cols / QK8_0;
  const size_t row_bytes = nb * sizeof(block_q8_0) + pad_bytes;
  std::vector<uint8_t> data(rows * row_bytes);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> quant(-127, 127);
  std::uniform_real_distribution<float> scale(1e-4f, 0.05f);
  for (int64_t r = 0; r < rows; ++r) {
    auto* blocks = reinterpret_cast<block_q8_0*>(data.data() + r * row_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      blocks[b].d = f32_to_f16(scale(rng));
      for (int8_t& q : blocks[b].qs) q = static_cast<int8_t>(quant(rng));
    }
    for (size_t i = 0; i < pad_bytes; ++i) data[r * row_bytes + nb * sizeof(block_q8_0) + i] = 0xa5;
  }
  return data;
}

// Random q4_K rows: random bytes for the quants and the packed scales and
// mins, f16 d and dmin rounded from small positive floats. pad_bytes of junk
// after each row.
std::vector<uint8_t> RandomQ4_KRows(int64_t rows, int64_t cols, size_t pad_bytes, uint32_t seed) {
  const int64_t nb = cols / QK_K;
  const size_t row_bytes = nb * sizeof(block_q4_K) + pad_bytes;
  std::vector<uint8_t> data(rows * row_bytes, 0xa5);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-4f, 0.05f);
  for (int64_t r = 0; r < rows; ++r) {
    auto* blocks = reinterpret_cast<block_q4_K*>(data.data() + r * row_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      blocks[b].d = f32_to_f16(scale(rng));
      blocks[b].dmin = f32_to_f16(scale(rng));
      for (uint8_t& q : blocks[b].scales) q = static_cast<uint8_t>(byte(rng));
      for (uint8_t& q : blocks[b].qs) q = static_cast<uint8_t>(byte(rng));
    }
  }
  return data;
}

// q8_K rows as the CPU forward makes them (quantize_act_row) from Gaussian
// floats, a row's scale varying by row. pad_bytes of junk after each row.
std::vector<uint8_t> RandomQ8_KRows(int64_t rows, int64_t cols, size_t pad_bytes, uint32_t seed) {
  const size_t row_bytes = act_row_bytes(ActType::kQ8_K, cols) + pad_bytes;
  std::vector<uint8_t> data(rows * row_bytes, 0xa5);
  std::mt19937 rng(seed);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> x(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : x) v = gaussian(rng) * (1 + r % 5);
    quantize_act_row(ActType::kQ8_K, x.data(), cols, data.data() + r * row_bytes);
  }
  return data;
}

struct Case {
  std::vector<uint8_t> w, act;
  MatMulArgs m;
};

// rows weight rows (kQ8_0 or kQ4_K) used of row_begin + rows held;
// out_stride past the rows held, so writes outside the range would show.
Case MakeCase(GgmlType type, int64_t row_begin, int64_t rows, int64_t n_act, int64_t cols,
              size_t pad_bytes, uint32_t seed) {
  Case c;
  const int64_t held = row_begin + rows;
  const bool q8_0 = type == GgmlType::kQ8_0;
  c.w = (q8_0 ? RandomRows : RandomQ4_KRows)(held, cols, pad_bytes, seed);
  c.act = (q8_0 ? RandomRows : RandomQ8_KRows)(n_act, cols, pad_bytes / 2, seed + 1);
  c.m.type = type;
  c.m.w = c.w.data();
  c.m.w_row_bytes = c.w.size() / held;
  c.m.cols = cols;
  c.m.row_begin = row_begin;
  c.m.row_end = held;
  c.m.act = c.act.data();
  c.m.act_row_bytes = c.act.size() / n_act;
  c.m.n_act = n_act;
  c.m.out_stride = held + 3;
  return c;
}

// out_stride * n_act floats of a NaN no kernel produces, so unwritten slots show.
std::vector<float> Sentinel(const MatMulArgs& m) {
  return std::vector<float>(m.out_stride * m.n_act, f32_from_bits(0x7fc0beefu));
}

using MatMul = void (*)(const MatMulArgs&);
using Sizes = std::vector<int64_t>;

// kernel against reference over every (cols, rows, n_act), with row_begin
// and the rows' padding varying, sentinel-filled outputs compared whole.
void ExpectKernelMatchesReference(GgmlType type, MatMul kernel, MatMul reference,
                                  const Sizes& cols_list, const Sizes& rows_list,
                                  const Sizes& n_act_list) {
  uint32_t seed = 1;
  for (int64_t cols : cols_list) {
    for (int64_t rows : rows_list) {
      for (int64_t n_act : n_act_list) {
        const int64_t row_begin = (seed % 3) * 5;
        const size_t pad_bytes = (seed % 2) * 8;  // keeps every block type aligned
        Case c = MakeCase(type, row_begin, rows, n_act, cols, pad_bytes, seed++);
        std::vector<float> want = Sentinel(c.m), got = Sentinel(c.m);
        c.m.out = want.data();
        reference(c.m);
        c.m.out = got.data();
        kernel(c.m);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
            << "rows " << row_begin << ".." << row_begin + rows << ", n_act " << n_act
            << ", cols " << cols;
      }
    }
  }
}

// Each of n_act activation rows alone gives the bits it gets in the batch.
void ExpectRowInBatchEqualsRowAlone(GgmlType type, MatMul kernel, int64_t n_act, int64_t cols) {
  Case c = MakeCase(type, 3, 100, n_act, cols, 0, 77);
  std::vector<float> batch = Sentinel(c.m);
  c.m.out = batch.data();
  kernel(c.m);
  for (int64_t t = 0; t < n_act; ++t) {
    MatMulArgs one = c.m;
    one.act = c.m.act + t * c.m.act_row_bytes;
    one.n_act = 1;
    std::vector<float> alone = Sentinel(one);
    one.out = alone.data();
    kernel(one);
    ASSERT_EQ(std::memcmp(alone.data(), batch.data() + t * c.m.out_stride,
                          alone.size() * sizeof(float)),
              0)
        << "activation row " << t;
  }
}

// A batch kernel under test: AMX tiles or AVX-512 VNNI, one contract.
struct BatchKernel {
  const char* name;  // a test name's part
  const char* what;  // the skip's words
  bool (*available)();
  MatMul q8_0, q4_K;
  uint64_t (*calls)();
};
void PrintTo(const BatchKernel& k, std::ostream* os) { *os << k.name; }

class BatchKernelTest : public ::testing::TestWithParam<BatchKernel> {
 protected:
  void SetUp() override {
    if (!GetParam().available()) {
      GTEST_SKIP() << "this CPU (or its kernel) offers no " << GetParam().what;
    }
  }
};

// Row counts around VNNI's 8-row passes and AMX's 32-row steps, activation
// counts around both kernels' 16-row groups and AMX's 32-row steps.
TEST_P(BatchKernelTest, Q8_0MatchesTheReferenceBitForBit) {
  const uint64_t calls = GetParam().calls();
  ExpectKernelMatchesReference(GgmlType::kQ8_0, GetParam().q8_0, AmxMatMulQ8_0Reference,
                               {32, 64, 2048}, {1, 7, 9, 15, 17, 33, 100},
                               {1, 7, 16, 17, 31, 64, 512});
  EXPECT_EQ(GetParam().calls() - calls, 3u * 7 * 7);
}

TEST_P(BatchKernelTest, Q8_0RowInBatchEqualsRowAlone) {
  ExpectRowInBatchEqualsRowAlone(GgmlType::kQ8_0, GetParam().q8_0, 512, 2048);
}

TEST_P(BatchKernelTest, Q4_KMatchesTheReferenceBitForBit) {
  const uint64_t calls = GetParam().calls();
  ExpectKernelMatchesReference(GgmlType::kQ4_K, GetParam().q4_K, AmxMatMulQ4_KReference,
                               {256, 768, 2048}, {1, 7, 9, 15, 17, 100}, {1, 7, 16, 17, 31, 200});
  EXPECT_EQ(GetParam().calls() - calls, 3u * 6 * 6);
}

TEST_P(BatchKernelTest, Q4_KRowInBatchEqualsRowAlone) {
  ExpectRowInBatchEqualsRowAlone(GgmlType::kQ4_K, GetParam().q4_K, 200, 2048);
}

// Extreme quants: every weight and activation -128 or 127 (ggml's quantizers
// make no -128, a file may hold one), where VNNI's +128 bias meets its ends.
TEST_P(BatchKernelTest, ExtremeQuantsMatchTheReference) {
  Case c = MakeCase(GgmlType::kQ8_0, 0, 9, 17, 64, 0, 3);
  for (std::vector<uint8_t>* rows : {&c.w, &c.act}) {
    auto* blocks = reinterpret_cast<block_q8_0*>(rows->data());
    for (size_t b = 0; b < rows->size() / sizeof(block_q8_0); ++b) {
      for (int i = 0; i < QK8_0; ++i) {
        blocks[b].qs[i] = static_cast<int8_t>((b + i) % 3 ? -128 : 127);
      }
    }
  }
  std::vector<float> want = Sentinel(c.m), got = Sentinel(c.m);
  c.m.out = want.data();
  AmxMatMulQ8_0Reference(c.m);
  c.m.out = got.data();
  GetParam().q8_0(c.m);
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, BatchKernelTest,
    ::testing::Values(BatchKernel{"amx", "AMX int8 tiles", &AmxInt8Available, &AmxMatMulQ8_0,
                                  &AmxMatMulQ4_K, &AmxMatMulCalls},
                      BatchKernel{"vnni", "AVX-512 VNNI", &AvxVnniAvailable, &VnniMatMulQ8_0,
                                  &VnniMatMulQ4_K, &VnniMatMulCalls}),
    [](const ::testing::TestParamInfo<BatchKernel>& info) { return std::string(info.param.name); });

// A weight row's expected dot with an activation row, and the absolute sum
// of the terms the float result may round across.
struct Expected {
  double value, magnitude;
};
using ExpectedDot = Expected (*)(const uint8_t* w_row, const uint8_t* act_row, int64_t cols);

// reference's 40 x 9 outputs, 4096 columns, each within 1e-5 of its
// expected magnitude of expected(...).value. Needs no AMX, so it runs
// everywhere.
void ExpectReferenceNear(GgmlType type, MatMul reference, ExpectedDot expected) {
  constexpr int64_t kRows = 40, kActs = 9, kCols = 4096;
  Case c = MakeCase(type, 0, kRows, kActs, kCols, 0, 5);
  std::vector<float> out = Sentinel(c.m);
  c.m.out = out.data();
  reference(c.m);
  for (int64_t t = 0; t < kActs; ++t) {
    for (int64_t r = 0; r < kRows; ++r) {
      const Expected e =
          expected(c.m.w + r * c.m.w_row_bytes, c.m.act + t * c.m.act_row_bytes, kCols);
      EXPECT_LE(std::fabs(out[t * c.m.out_stride + r] - e.value), 1e-5 * e.magnitude)
          << "row " << r << ", act " << t;
    }
  }
}

// The q8_0 dot in f64: the sum of the blocks' scaled integer dots, and the
// sum of their absolute values.
Expected F64Q8_0Dot(const uint8_t* w_row, const uint8_t* act_row, int64_t cols) {
  const auto* w = reinterpret_cast<const block_q8_0*>(w_row);
  const auto* a = reinterpret_cast<const block_q8_0*>(act_row);
  Expected e{0.0, 0.0};
  for (int64_t b = 0; b < cols / QK8_0; ++b) {
    double dot = 0.0;
    for (int i = 0; i < QK8_0; ++i) dot += static_cast<double>(w[b].qs[i]) * a[b].qs[i];
    const double term = static_cast<double>(f16_to_f32(w[b].d)) * f16_to_f32(a[b].d) * dot;
    e.value += term;
    e.magnitude += std::fabs(term);
  }
  return e;
}

// ggml's generic q4_K dot (dot_row_ref), and the absolute sum of the terms
// with the scale and min parts apart (they cancel in the dequantized weights).
Expected GgmlQ4_KDot(const uint8_t* w_row, const uint8_t* act_row, int64_t cols) {
  const auto* w = reinterpret_cast<const block_q4_K*>(w_row);
  const auto* a = reinterpret_cast<const block_q8_K*>(act_row);
  Expected e{dot_row_ref(GgmlType::kQ4_K, w_row, act_row, cols), 0.0};
  for (int64_t b = 0; b < cols / QK_K; ++b) {
    for (int i = 0; i < QK_K; ++i) {
      uint8_t sc, mn;
      get_scale_min_k4(i / 32, w[b].scales, &sc, &mn);
      const int q = (w[b].qs[i / 64 * 32 + i % 32] >> (4 * (i / 32 % 2))) & 0xf;
      const double weight = static_cast<double>(f16_to_f32(w[b].d)) * sc * q +
                            static_cast<double>(f16_to_f32(w[b].dmin)) * mn;
      e.magnitude += weight * std::fabs(a[b].qs[i] * a[b].d);
    }
  }
  return e;
}

// The q8_0 contract is the dot product, within f32 summation error.
TEST(AmxMatMulTest, ReferenceIsTheDotProduct) {
  ExpectReferenceNear(GgmlType::kQ8_0, AmxMatMulQ8_0Reference, &F64Q8_0Dot);
}

// The q4_K contract is ggml's generic dot in another float order.
TEST(AmxMatMulTest, Q4_KReferenceIsGgmlsDot) {
  ExpectReferenceNear(GgmlType::kQ4_K, AmxMatMulQ4_KReference, &GgmlQ4_KDot);
}

// The first flags line of /proc/cpuinfo, word by word (empty where unreadable:
// the tests then fail on the flags they need).
std::set<std::string> CpuFlags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line) && line.rfind("flags", 0) != 0) {
  }
  std::set<std::string> flags;
  if (line.rfind("flags", 0) != 0) return flags;
  std::istringstream words(line.substr(line.find(':') + 1));
  for (std::string flag; words >> flag;) flags.insert(flag);
  return flags;
}

// /proc/cpuinfo's flags say what the CPU and kernel offer. Not skipped without
// AMX or VNNI: a false "no" is the failure this guards against.
TEST(AmxMatMulTest, AvailabilityAgreesWithCpuinfo) {
#if !defined(__linux__) || !defined(__x86_64__)
  GTEST_SKIP() << "reads Linux's x86 /proc/cpuinfo";
#endif
  const std::set<std::string> flags = CpuFlags();
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
  EXPECT_EQ(AmxInt8Available(), flags.count("amx_int8") && flags.count("amx_tile") &&
                                    flags.count("avx512f") && flags.count("avx512_vnni"));
  EXPECT_EQ(AvxVnniAvailable(),
            flags.count("avx512f") && flags.count("avx512bw") && flags.count("avx512_vnni"));
}

}  // namespace
}  // namespace moegraph
