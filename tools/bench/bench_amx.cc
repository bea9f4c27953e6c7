// A prompt batch's quantized matmul on one thread: the AMX int8 tiles
// (cpu/amx_matmul.h) and their AVX-512 VNNI twin (cpu/vnni_matmul.h) against
// the per-row path (SimdMatMulRows, ggml's order, the best target this CPU
// runs) on the same weights and activation rows: q8_0, 2048 x
// 2048 by 512 activations; q4_K, 768 x 2048 by 32 (an expert's gate or up
// projection for its share of a prompt) and 2048 x 2048 by 512. items/s counts
// multiply-adds (rows * cols * activations).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/act_quant.h"
#include "cpu/amx_matmul.h"
#include "cpu/simd_kernels.h"
#include "cpu/vnni_matmul.h"
#include "loader/ggml_type.h"
#include "loader/quantize.h"

namespace moegraph {
namespace {

struct Batch {
  std::vector<uint8_t> weights, act;
  std::vector<float> out;
  MatMulArgs m;
};

// Gaussian weights quantized to type, Gaussian activations to its act type.
Batch MakeBatch(GgmlType type, int64_t rows, int64_t cols, int64_t n_act) {
  Batch b;
  std::mt19937 rng(11);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> row(cols);
  const size_t row_bytes = ggml_row_size(type, cols);
  b.weights.resize(row_bytes * rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = gaussian(rng);
    quantize_row(type, row.data(), b.weights.data() + r * row_bytes, cols);
  }
  const ActType act_type = act_type_for(type);
  const size_t act_bytes = act_row_bytes(act_type, cols);
  b.act.resize(act_bytes * n_act);
  for (int64_t t = 0; t < n_act; ++t) {
    for (float& v : row) v = gaussian(rng);
    quantize_act_row(act_type, row.data(), cols, b.act.data() + t * act_bytes);
  }
  b.out.resize(rows * n_act);
  b.m.type = type;
  b.m.w = b.weights.data();
  b.m.w_row_bytes = row_bytes;
  b.m.cols = cols;
  b.m.row_begin = 0;
  b.m.row_end = rows;
  b.m.act = b.act.data();
  b.m.act_row_bytes = act_bytes;
  b.m.n_act = n_act;
  b.m.out = b.out.data();
  b.m.out_stride = rows;
  return b;
}

// state's arguments: rows, cols, activations.
void Run(benchmark::State& state, GgmlType type, void (*matmul)(const MatMulArgs&)) {
  const int64_t rows = state.range(0), cols = state.range(1), n_act = state.range(2);
  const Batch b = MakeBatch(type, rows, cols, n_act);
  for (auto _ : state) {
    matmul(b.m);
    benchmark::DoNotOptimize(b.out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows * cols * n_act);
}

void RunAmx(benchmark::State& state, GgmlType type, void (*matmul)(const MatMulArgs&)) {
  if (!AmxInt8Available()) {
    state.SkipWithError("this CPU or kernel offers no AMX int8 tiles");
    return;
  }
  Run(state, type, matmul);
}

void RunVnni(benchmark::State& state, GgmlType type, void (*matmul)(const MatMulArgs&)) {
  if (!AvxVnniAvailable()) {
    state.SkipWithError("this CPU offers no AVX-512 VNNI");
    return;
  }
  Run(state, type, matmul);
}

void RunSimd(benchmark::State& state, GgmlType type) {
  state.SetLabel(SimdTargetLabel());
  Run(state, type, &SimdMatMulRows);
}

void BM_AmxQ8_0(benchmark::State& state) { RunAmx(state, GgmlType::kQ8_0, &AmxMatMulQ8_0); }
void BM_VnniQ8_0(benchmark::State& state) { RunVnni(state, GgmlType::kQ8_0, &VnniMatMulQ8_0); }
void BM_SimdQ8_0(benchmark::State& state) { RunSimd(state, GgmlType::kQ8_0); }
void BM_AmxQ4_K(benchmark::State& state) { RunAmx(state, GgmlType::kQ4_K, &AmxMatMulQ4_K); }
void BM_VnniQ4_K(benchmark::State& state) { RunVnni(state, GgmlType::kQ4_K, &VnniMatMulQ4_K); }
void BM_SimdQ4_K(benchmark::State& state) { RunSimd(state, GgmlType::kQ4_K); }

BENCHMARK(BM_AmxQ8_0)->Args({2048, 2048, 512})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_VnniQ8_0)->Args({2048, 2048, 512})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SimdQ8_0)->Args({2048, 2048, 512})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AmxQ4_K)
    ->Args({768, 2048, 8})
    ->Args({768, 2048, 32})
    ->Args({2048, 2048, 512})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_VnniQ4_K)
    ->Args({768, 2048, 8})
    ->Args({768, 2048, 32})
    ->Args({2048, 2048, 512})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SimdQ4_K)
    ->Args({768, 2048, 8})
    ->Args({768, 2048, 32})
    ->Args({2048, 2048, 512})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph
