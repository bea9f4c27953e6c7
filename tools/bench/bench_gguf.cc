// Opening and indexing a 1 GiB GGUF file: mmap, full validation of every key and
// tensor info, then FindTensor over every name. Reported as time per open.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"

namespace moegraph {
namespace {

constexpr int kTensors = 2048;
constexpr int64_t kRowLength = 2048;
constexpr int64_t kRows = 128;  // f16: 512 KiB per tensor, 1 GiB in all
constexpr char kPath[] = "/tmp/moegraph_bench_gguf_1gib.gguf";

std::string TensorName(int i) {
  static constexpr const char* kKinds[] = {"attn_q",        "attn_k",        "attn_v",
                                           "attn_output",   "ffn_gate_exps", "ffn_up_exps",
                                           "ffn_down_exps", "ffn_gate_inp"};
  return absl::StrCat("blk.", i / 8, ".", kKinds[i % 8], ".weight");
}

// Written once and reused by later runs; rewritten when it is not the expected file.
const std::string& BenchFile() {
  static const std::string* path = [] {
    auto existing = GgufFile::Open(kPath);
    if (!existing.ok() || (*existing)->tensors().size() != kTensors) {
      GgufWriter w;
      w.SetString("general.architecture", "bench");
      w.SetUint32("bench.block_count", kTensors / 8);
      std::vector<std::string> tokens(32000);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = absl::StrCat("tok", i);
      w.SetStringArray("tokenizer.ggml.tokens", tokens);
      for (int i = 0; i < kTensors; ++i) {
        w.AddTensor(TensorName(i), GgmlType::kF16, {kRowLength, kRows},
                    [i](uint8_t* dst, size_t n) { std::memset(dst, i & 0xFF, n); });
      }
      if (absl::Status s = w.WriteFile(kPath); !s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        std::abort();
      }
    }
    return new std::string(kPath);
  }();
  return *path;
}

void BM_OpenAndIndex1GiB(benchmark::State& state) {
  const std::string& path = BenchFile();
  std::vector<std::string> names;
  for (int i = 0; i < kTensors; ++i) names.push_back(TensorName(i));
  for (auto _ : state) {
    auto file = GgufFile::Open(path);
    if (!file.ok()) {
      state.SkipWithError(std::string(file.status().message()).c_str());
      break;
    }
    for (const std::string& name : names) benchmark::DoNotOptimize((*file)->FindTensor(name));
  }
  state.counters["tensors"] = kTensors;
}
BENCHMARK(BM_OpenAndIndex1GiB)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moegraph
