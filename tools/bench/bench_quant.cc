// CPU dequantization throughput per type (loader/quant.h), in bytes of blocks
// read per second: the rate at which the CPU path can turn file bytes into f32.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"

namespace moegraph {
namespace {

// Large enough to leave the caches, as a weight tensor does.
constexpr size_t kTargetBlockBytes = 16u << 20;
// Quantizing is slow (q4_K runs a search per 32 elements): quantize this much
// once and tile it.
constexpr int64_t kTileElems = 1 << 16;

void BM_Dequantize(benchmark::State& state, GgmlType type) {
  std::mt19937 rng(7);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  std::vector<float> tile(kTileElems);
  for (float& v : tile) v = gaussian(rng);
  const size_t tile_bytes = ggml_row_size(type, kTileElems);
  const int64_t tiles = static_cast<int64_t>((kTargetBlockBytes + tile_bytes - 1) / tile_bytes);
  std::vector<uint8_t> blocks(tiles * tile_bytes);
  quantize_row(type, tile.data(), blocks.data(), kTileElems);
  for (int64_t t = 1; t < tiles; ++t) {
    std::memcpy(blocks.data() + t * tile_bytes, blocks.data(), tile_bytes);
  }
  const int64_t n = tiles * kTileElems;
  std::vector<float> out(n);
  for (auto _ : state) {
    if (!dequantize_row(type, blocks.data(), out.data(), n)) {
      state.SkipWithError("dequantize_row rejected the row");
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(blocks.size()));
  state.counters["elems/s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_CAPTURE(BM_Dequantize, f32, GgmlType::kF32)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, f16, GgmlType::kF16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, bf16, GgmlType::kBF16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, q8_0, GgmlType::kQ8_0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, q4_0, GgmlType::kQ4_0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, q4_K, GgmlType::kQ4_K)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, q5_K, GgmlType::kQ5_K)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Dequantize, q6_K, GgmlType::kQ6_K)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph
