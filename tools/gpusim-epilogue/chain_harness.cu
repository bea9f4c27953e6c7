// The router's wait on attn_out under gpusim: launch_matvec_residual_router
// (kernels/matvec.cu, one chained launch) at Qwen3-30B-A3B's shape: attn_out
// q4_K 2048 x 4096 adding into the residual with ffn_norm, then the f32
// router of 128 experts over 2048, top 8. Built by run.sh against the working
// tree (NEW) and an older commit's kernels/ (OLD): the launcher's signature is
// the same in both, so this file calls it unchanged.
//
//   chain_harness attn-out-router
//
// Launched twice (the first warms the L2 with what fits of the weights); the
// second's cycles are the row. Prints an FNV-1a hash of every output byte
// (residual, the norm's output and q8_1 blocks, logits, experts, weights).
#include "kernels/matvec.cu"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "loader/ggml_type.h"
#include "loader/quantize.h"
#include "tools/gpusim-epilogue/transfer.h"

// gpusim's cudart has no cudaLaunchKernelExC, which launch_kernel's
// cudaLaunchKernelEx calls: the launch <<<>>> makes instead (its configuration
// pushed, then cudaLaunchKernel), without the attributes (none are set outside
// a ProgrammaticLaunchScope; sm_86 has no PDL).
extern "C" cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func,
                                           void** args) {
  __cudaPushCallConfiguration(config->gridDim, config->blockDim, config->dynamicSmemBytes,
                              config->stream);
  return cudaLaunchKernel(func, config->gridDim, config->blockDim, args,
                          config->dynamicSmemBytes, config->stream);
}

namespace moegraph {
namespace {

std::vector<float> Gaussian(std::mt19937& rng, int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = dist(rng);
  return v;
}

DeviceMatrix Matrix(std::mt19937& rng, GgmlType type, int32_t rows, int32_t cols) {
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> bytes(static_cast<size_t>(rows) * row_bytes);
  for (int32_t r = 0; r < rows; ++r) {
    const std::vector<float> values = Gaussian(rng, cols, 0.5f);
    quantize_row(type, values.data(), bytes.data() + r * row_bytes, cols);
  }
  return {Upload(bytes), type, cols, rows, row_bytes};
}

int AttnOutRouter() {
  constexpr int32_t kEmbd = 2048, kAttn = 4096, kExperts = 128, kTopK = 8;
  std::mt19937 rng(40);
  const DeviceMatrix wo = Matrix(rng, GgmlType::kQ4_K, kEmbd, kAttn);
  const DeviceMatrix router_w = Matrix(rng, GgmlType::kF32, kExperts, kEmbd);
  std::vector<block_q8_1> attn_q(kAttn / QK8_1);
  const std::vector<float> attn = Gaussian(rng, kAttn, 1.0f);
  for (int32_t b = 0; b < kAttn / QK8_1; ++b) quantize_q8_1_block(&attn[b * QK8_1], &attn_q[b]);
  const block_q8_1* d_attn_q = Upload(attn_q);
  float* residual = Upload(Gaussian(rng, kEmbd, 4.0f));
  NormEpilogue norm;
  norm.weight = Upload(Gaussian(rng, kEmbd, 1.0f));
  norm.eps = 1e-6f;
  norm.out = Upload(std::vector<float>(kEmbd));
  norm.out_q = Upload(std::vector<block_q8_1>(kEmbd / QK8_1));
  float* logits = Upload(std::vector<float>(kExperts));
  RouterEpilogue router;
  router.k = kTopK;
  router.norm_topk = true;
  router.experts = Upload(std::vector<int32_t>(kTopK));
  router.weights = Upload(std::vector<float>(kTopK));
  DeviceCounters* counters = Upload(std::vector<DeviceCounters>(1));
  unsigned int* tickets = Upload(std::vector<unsigned int>(64));
  for (int launch = 0; launch < 2; ++launch) {
    std::printf("launch %d chained_matvec_kernel attn_out q4_K %d x %d, router f32 %d x %d "
                "top %d\n",
                launch, kEmbd, kAttn, kExperts, kEmbd, kTopK);
    if (launch_matvec_residual_router(wo, nullptr, d_attn_q, nullptr, residual, norm, router_w,
                                      logits, router, counters, tickets, nullptr) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      std::fprintf(stderr, "launch %d failed\n", launch);
      return 1;
    }
  }
  uint64_t hash = 14695981039346656037ull;
  auto mix = [&](const auto& values) {
    const uint8_t* byte = reinterpret_cast<const uint8_t*>(values.data());
    for (size_t i = 0; i < values.size() * sizeof(values[0]); ++i) {
      hash = (hash ^ byte[i]) * 1099511628211ull;
    }
  };
  mix(Download(residual, kEmbd));
  mix(Download(norm.out, kEmbd));
  mix(Download(norm.out_q, kEmbd / QK8_1));
  mix(Download(logits, kExperts));
  const std::vector<int32_t> experts = Download(router.experts, kTopK);
  mix(experts);
  mix(Download(router.weights, kTopK));
  std::printf("check chain experts");
  for (int32_t e : experts) std::printf(" %d", e);
  std::printf(" bits %016llx\n", static_cast<unsigned long long>(hash));
  return 0;
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "attn-out-router") == 0) return moegraph::AttnOutRouter();
  std::fprintf(stderr, "usage: chain_harness attn-out-router\n");
  return 2;
}
