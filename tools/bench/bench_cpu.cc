// The CPU path's dot products per weight type, one thread: GB/s of weight bytes
// read (bytes_per_second) for ggml's scalar code (dot_row_ref, the baseline)
// and for every SIMD target this CPU runs, with one activation row (decode) and
// with 16 (a prompt's batch, where a weight block is unpacked once for several
// rows).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/act_quant.h"
#include "cpu/simd_kernels.h"
#include "loader/ggml_type.h"
#include "loader/quantize.h"

namespace moegraph {
namespace {

constexpr int64_t kCols = 4096;
// 16 MiB or more of weights: out of the caches, as a layer's matrices are.
constexpr size_t kWeightBytes = 16u << 20;

struct DotCase {
  GgmlType type;
  std::vector<uint8_t> weights;
  std::vector<uint8_t> act;
  size_t row_bytes = 0;
  size_t act_row_bytes = 0;
  int64_t rows = 0;
};

// One quantized row repeated: quantizing 16 MiB of K-quants would take seconds.
DotCase MakeCase(GgmlType type, int64_t n_act) {
  DotCase c;
  c.type = type;
  std::mt19937 rng(3);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> row(kCols);
  for (float& v : row) v = gaussian(rng);
  c.row_bytes = ggml_row_size(type, kCols);
  c.rows = static_cast<int64_t>((kWeightBytes + c.row_bytes - 1) / c.row_bytes);
  c.weights.resize(c.row_bytes * static_cast<size_t>(c.rows));
  quantize_row(type, row.data(), c.weights.data(), kCols);
  for (int64_t r = 1; r < c.rows; ++r) {
    std::memcpy(c.weights.data() + r * c.row_bytes, c.weights.data(), c.row_bytes);
  }
  const ActType at = act_type_for(type);
  c.act_row_bytes = act_row_bytes(at, kCols);
  c.act.resize(c.act_row_bytes * static_cast<size_t>(n_act));
  for (int64_t t = 0; t < n_act; ++t) {
    for (float& v : row) v = gaussian(rng);
    quantize_act_row(at, row.data(), kCols, c.act.data() + t * c.act_row_bytes);
  }
  return c;
}

void BM_DotRef(benchmark::State& state, GgmlType type) {
  const DotCase c = MakeCase(type, 1);
  for (auto _ : state) {
    float sum = 0.0f;
    for (int64_t r = 0; r < c.rows; ++r) {
      sum += dot_row_ref(type, c.weights.data() + r * c.row_bytes, c.act.data(), kCols);
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(c.weights.size()));
}

void BM_DotSimd(benchmark::State& state, GgmlType type, int64_t target, int64_t n_act) {
  const DotCase c = MakeCase(type, n_act);
  SimdForceTarget(target);
  std::vector<float> out(static_cast<size_t>(c.rows * n_act));
  MatMulArgs m;
  m.type = type;
  m.w = c.weights.data();
  m.w_row_bytes = c.row_bytes;
  m.cols = kCols;
  m.row_begin = 0;
  m.row_end = c.rows;
  m.act = c.act.data();
  m.act_row_bytes = c.act_row_bytes;
  m.n_act = n_act;
  m.out = out.data();
  m.out_stride = c.rows;
  for (auto _ : state) {
    SimdMatMulRows(m);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  SimdForceTarget(0);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(c.weights.size()));
  state.counters["dots/s"] = benchmark::Counter(static_cast<double>(c.rows * n_act),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

const GgmlType kTypes[] = {GgmlType::kQ8_0,  GgmlType::kQ4_0,   GgmlType::kQ4_K, GgmlType::kQ5_K,
                           GgmlType::kQ6_K,  GgmlType::kF16,    GgmlType::kBF16, GgmlType::kF32,
                           GgmlType::kMXFP4, GgmlType::kIQ4_NL, GgmlType::kQ4_1, GgmlType::kQ5_0,
                           GgmlType::kQ5_1,  GgmlType::kQ2_K,   GgmlType::kQ3_K, GgmlType::kIQ4_XS};

// Rows per type: ref, then each target with 1 and 16 activation rows.
const bool kRegistered = [] {
  for (const GgmlType type : kTypes) {
    const std::string name = ggml_type_name(static_cast<uint32_t>(type));
    benchmark::RegisterBenchmark(("BM_Dot/" + name + "/ref").c_str(), BM_DotRef, type)
        ->Unit(benchmark::kMillisecond);
    for (const int64_t target : SimdTargets()) {
      for (const int64_t n_act : {1, 16}) {
        benchmark::RegisterBenchmark(
            ("BM_Dot/" + name + "/" + SimdTargetName(target) + "/act:" + std::to_string(n_act))
                .c_str(),
            BM_DotSimd, type, target, n_act)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace moegraph
