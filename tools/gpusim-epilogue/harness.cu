// The serial tails of the decode step under gpusim: what one block does after
// the last ticket (kernels/epilogue.cuh), measured alone. Built by run.sh
// against the working tree (NEW) and against an older commit's kernels/ (OLD).
//
//   harness norm N [cold]
//                       block_rmsnorm of N floats with q8_1 blocks (attn_out's
//                       ffn_norm, the down pass's next attn_norm), 128 threads;
//                       cold: the second launch reads another copy of the
//                       weights, not in L2 (as the step finds a layer's norm
//                       weights after streaming a layer of experts)
//   harness router N K  the router's top-k (block_router_topk) over N softmax
//                       logits, top K, norm_topk
//
// Each launches its kernel twice: the first warms the L2 with the inputs (an
// epilogue reads what other blocks just wrote), the second is the one to read.
// Prints a checksum of the second launch's outputs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/epilogue.cuh"
#include "tools/gpusim-epilogue/transfer.h"

namespace moegraph {
namespace {

__global__ void norm_kernel(const float* x, const float* weight, float* out, block_q8_1* out_q,
                            int32_t n) {
  __shared__ EpilogueShared shared;
  block_rmsnorm(x, weight, out, n, 1e-6f, out_q, &shared);
}

// A tree before block_router_topk ran the top-k on one warp (run.sh defines
// HARNESS_WARP_ROUTER for it).
#ifdef HARNESS_WARP_ROUTER
constexpr int kRouterKernelThreads = 32;
#else
constexpr int kRouterKernelThreads = kRouterThreads;
#endif

__global__ void router_kernel(float* logits, int32_t n, RouterEpilogue router) {
  __shared__ EpilogueShared shared;
#ifdef HARNESS_WARP_ROUTER
  warp_router_topk(logits, n, router, router.experts, router.weights, &shared);
#else
  block_router_topk(logits, n, router, router.experts, router.weights, &shared);
#endif
}

// Deterministic values in about [-2, 2].
std::vector<float> Values(int32_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / static_cast<float>(1u << 24) * 4.0f - 2.0f;
  }
  return v;
}

int Norm(int32_t n, bool cold) {
  float* x = Upload(Values(n, 1));
  float* weights[2] = {Upload(Values(n, 2)), nullptr};
  weights[1] = cold ? Upload(Values(n, 2)) : weights[0];
  float* out = Upload(std::vector<float>(static_cast<size_t>(n)));
  block_q8_1* out_q = Upload(std::vector<block_q8_1>(static_cast<size_t>(n / QK8_1)));
  for (int launch = 0; launch < 2; ++launch) {
    std::printf("launch %d norm_kernel n %d%s grid (1,1,1) block (128,1,1)\n", launch, n,
                cold ? " cold weights" : "");
    norm_kernel<<<1, 128>>>(x, weights[launch], out, out_q, n);
    if (cudaDeviceSynchronize() != cudaSuccess) return 1;
  }
  double sum = 0.0;
  const std::vector<float> values = Download(out, static_cast<size_t>(n));
  for (float v : values) sum += v;
  long q_sum = 0;
  const std::vector<block_q8_1> blocks = Download(out_q, static_cast<size_t>(n / QK8_1));
  for (const block_q8_1& b : blocks) {
    for (int i = 0; i < QK8_1; ++i) q_sum += b.qs[i];
  }
  // FNV-1a over every output byte: equal hashes, the same bits.
  uint64_t hash = 14695981039346656037ull;
  auto mix = [&](const void* p, size_t bytes) {
    const uint8_t* byte = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < bytes; ++i) hash = (hash ^ byte[i]) * 1099511628211ull;
  };
  mix(values.data(), values.size() * sizeof(float));
  mix(blocks.data(), blocks.size() * sizeof(block_q8_1));
  std::printf("check norm sum %.9g q8_1 sum %ld bits %016llx\n", sum, q_sum,
              static_cast<unsigned long long>(hash));
  return 0;
}

int Router(int32_t n, int32_t k) {
  const std::vector<float> logits = Values(n, 3);
  float* d_logits = Upload(logits);
  RouterEpilogue router;
  router.k = k;
  router.norm_topk = true;
  router.experts = Upload(std::vector<int32_t>(static_cast<size_t>(k)));
  router.weights = Upload(std::vector<float>(static_cast<size_t>(k)));
  for (int launch = 0; launch < 2; ++launch) {
    cudaMemcpy(d_logits, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice);
    std::printf("launch %d router_kernel n %d k %d grid (1,1,1) block (%d,1,1)\n", launch, n, k,
                kRouterKernelThreads);
    router_kernel<<<1, kRouterKernelThreads>>>(d_logits, n, router);
    if (cudaDeviceSynchronize() != cudaSuccess) return 1;
  }
  std::printf("check router experts");
  for (int32_t e : Download(router.experts, static_cast<size_t>(k))) std::printf(" %d", e);
  std::printf(" weights");
  for (float w : Download(router.weights, static_cast<size_t>(k))) std::printf(" %.7g", w);
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "norm") == 0) {
    return moegraph::Norm(std::atoi(argv[2]), argc >= 4 && std::strcmp(argv[3], "cold") == 0);
  }
  if (argc >= 4 && std::strcmp(argv[1], "router") == 0) {
    return moegraph::Router(std::atoi(argv[2]), std::atoi(argv[3]));
  }
  std::fprintf(stderr, "usage: harness norm N [cold] | harness router N K\n");
  return 2;
}
