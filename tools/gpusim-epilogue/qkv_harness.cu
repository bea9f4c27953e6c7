// The layer's attn_norm before its projections under gpusim, at Qwen3-30B-A3B's
// shape (n_embd 2048; q q4_K 4096 rows, k q4_K and v q6_K 512; 32/4 heads of
// 128 with the per-head QK-norm and NEOX RoPE; f32 caches), two ways in one
// tree:
//
//   qkv_harness single     the norm in one block of 128 threads
//                          (run_norm_epilogue, the combine's last block before
//                          2026-12-07), then launch_qkv reading its output
//   qkv_harness prologue   launch_qkv with input_norm: its first 16 blocks
//                          write the norm, the matrix blocks ask L2 for their
//                          rows and wait for them
//
// Each runs twice (the first with the weights in DRAM, as a decode step finds
// them; the second with what fits of them in L2). Prints an FNV-1a hash of
// every output byte (the norm's output and q8_1 blocks, q, k, q_out, the cache
// rows): the two ways must print the same.
#include "kernels/matvec.cu"

#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/nn_math.h"
#include "tools/gpusim-epilogue/launch_harness.h"

namespace moegraph {
namespace {

// The combine's last block's norm, alone: one block, as combine_epilogue ran it.
__global__ void __launch_bounds__(kMatvecThreads)
    single_block_norm(const float* residual, int32_t n, const NormEpilogue norm) {
  __shared__ EpilogueShared shared;
  run_norm_epilogue(norm, residual, n, &shared);
}

int AttnNormQkv(bool prologue) {
  constexpr int32_t kEmbd = 2048, kHead = 32, kHeadKv = 4, kHeadDim = 128, kPos = 5;
  constexpr int32_t kQ = kHead * kHeadDim, kKv = kHeadKv * kHeadDim, kRows = kPos + 1;
  std::mt19937 rng(41);
  const DeviceMatrix wq = Matrix(rng, GgmlType::kQ4_K, kQ, kEmbd);
  const DeviceMatrix wk = Matrix(rng, GgmlType::kQ4_K, kKv, kEmbd);
  const DeviceMatrix wv = Matrix(rng, GgmlType::kQ6_K, kKv, kEmbd);
  const float* residual = Upload(Gaussian(rng, kEmbd, 4.0f));
  NormEpilogue norm;
  norm.weight = Upload(Gaussian(rng, kEmbd, 1.0f));
  norm.eps = 1e-6f;
  norm.out = Upload(std::vector<float>(kEmbd));
  norm.out_q = Upload(std::vector<block_q8_1>(kEmbd / QK8_1));
  std::vector<float> cos_sin(rope_table_floats(kHeadDim, kRows));
  fill_rope_table(kHeadDim, 1e6f, RopeYarn{}, kRows, cos_sin.data());
  QkvRope rope;
  rope.pos = Upload(std::vector<int32_t>{kPos});
  rope.n_head = kHead;
  rope.n_head_kv = kHeadKv;
  rope.head_dim = kHeadDim;
  rope.cos_sin = Upload(cos_sin);
  rope.rope_type = kRopeNeox;
  rope.use_norm = true;
  rope.norm.q_weight = Upload(Gaussian(rng, kHeadDim, 1.0f));
  rope.norm.k_weight = Upload(Gaussian(rng, kHeadDim, 1.0f));
  rope.norm.eps = 1e-6f;
  rope.q_out = Upload(std::vector<float>(kQ));
  rope.k_cache = Upload(std::vector<float>(kRows * kKv));
  rope.v_cache = Upload(std::vector<float>(kRows * kKv));
  float* q = Upload(std::vector<float>(kQ));
  float* k = Upload(std::vector<float>(kKv));
  unsigned int* tickets = Upload(std::vector<unsigned int>(kHead + kHeadKv + 3));
  for (int launch = 0; launch < 2; ++launch) {
    std::printf("launch %d %s: attn_norm %d, qkv q4_K %d, q4_K %d, q6_K %d\n", launch,
                prologue ? "qkv_kernel with its input norm" : "single_block_norm, qkv_kernel",
                kEmbd, kQ, kKv, kKv);
    cudaError_t err = cudaSuccess;
    if (prologue) {
      err = launch_qkv(wq, wk, wv, residual, nullptr, nullptr, nullptr, nullptr, q, k, nullptr,
                       &rope, norm, tickets, nullptr);
    } else {
      single_block_norm<<<1, kMatvecThreads>>>(residual, kEmbd, norm);
      err = cudaGetLastError();
      if (err == cudaSuccess) {
        err = launch_qkv(wq, wk, wv, norm.out, norm.out_q, nullptr, nullptr, nullptr, q, k,
                         nullptr, &rope, NormEpilogue{}, tickets, nullptr);
      }
    }
    if (err != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      std::fprintf(stderr, "launch %d failed\n", launch);
      return 1;
    }
  }
  OutputHash hash;
  const std::vector<float> h = Download(norm.out, kEmbd);
  hash.Mix(h);
  hash.Mix(Download(norm.out_q, kEmbd / QK8_1));
  hash.Mix(Download(q, kQ));
  hash.Mix(Download(k, kKv));
  hash.Mix(Download(rope.q_out, kQ));
  hash.Mix(Download(static_cast<const float*>(rope.k_cache), kRows * kKv));
  hash.Mix(Download(static_cast<const float*>(rope.v_cache), kRows * kKv));
  std::printf("check qkv h[0] %.7g bits %016llx\n", h[0], static_cast<unsigned long long>(hash.value));
  return 0;
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "single") == 0) return moegraph::AttnNormQkv(false);
  if (argc == 2 && std::strcmp(argv[1], "prologue") == 0) return moegraph::AttnNormQkv(true);
  std::fprintf(stderr, "usage: qkv_harness single|prologue\n");
  return 2;
}
