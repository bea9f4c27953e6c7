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
#include <vector>

#include "tools/gpusim-epilogue/launch_harness.h"

namespace moegraph {
namespace {

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
  OutputHash hash;
  hash.Mix(Download(residual, kEmbd));
  hash.Mix(Download(norm.out, kEmbd));
  hash.Mix(Download(norm.out_q, kEmbd / QK8_1));
  hash.Mix(Download(logits, kExperts));
  const std::vector<int32_t> experts = Download(router.experts, kTopK);
  hash.Mix(experts);
  hash.Mix(Download(router.weights, kTopK));
  std::printf("check chain experts");
  for (int32_t e : experts) std::printf(" %d", e);
  std::printf(" bits %016llx\n", static_cast<unsigned long long>(hash.value));
  return 0;
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "attn-out-router") == 0) return moegraph::AttnOutRouter();
  std::fprintf(stderr, "usage: chain_harness attn-out-router\n");
  return 2;
}
