// GGML: llama.cpp's ggml-cuda mul_mat_vec_q (mmvq.cu) under gpusim, on the
// cases of problem.h. The kernel is compiled from the peer's source: run.sh
// copies mmvq.cu from its start up to its MoE kernel (the helpers and
// mul_mat_vec_q itself, verbatim) into build-gpusim/ggml/mmvq_kernel.cuh, and
// this file includes that; ggml's host dispatch (the rest of mmvq.cu) would
// pull in the whole backend and instantiate every type. Nothing of ggml is
// committed here.
//
// The launch is what ggml_cuda_mul_mat_vec_q / mul_mat_vec_q_switch_ncols_dst
// make of one f32 column on an sm_86 (the GENERIC parameter table): ncols_dst
// 1, small_k false (K 2048 fills the block's first trip: 8 q4_K blocks vs
// nwarps * blocks_per_iter_1warp = 8, 64 q8_0 blocks vs 32), halve_iters
// false (GB10 only), grid (rows, 1, 1) of blocks (32, 4). The pair is ggml's
// fused up/gate: vx = up, fusion.gate = gate, glu SWIGLU: up * silu(gate).
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mmvq_kernel.cuh"
#include "tools/gpusim-matvec/problem.h"

// ggml.c's symbols that the copied host code names: GGML_ASSERT's abort and
// ggml_cuda_should_use_mmvq's ggml_is_quantized (never called here).
extern "C" bool ggml_is_quantized(enum ggml_type) {
  std::fprintf(stderr, "ggml_is_quantized: not part of this harness\n");
  std::abort();
}
extern "C" void ggml_abort(const char* file, int line, const char* fmt, ...) {
  std::fprintf(stderr, "ggml_abort at %s:%d: ", file, line);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::abort();
}

namespace {

template <ggml_type type, bool kFusion>
void Launch(const gpusim_matvec::Problem& p, const void* vx, const void* gate, const void* vy,
            float* dst) {
  constexpr int kNcolsDst = 1;
  constexpr mmvq_parameter_table_id table = MMVQ_PARAMETERS_GENERIC;  // what sm_86 gets
  constexpr int nwarps = calc_nwarps(type, kNcolsDst, table, false, false);
  constexpr int rows_per_block = calc_rows_per_block(kNcolsDst, table, false, nwarps);
  static_assert(nwarps == 4 && rows_per_block == 1, "ggml's ncols_dst 1 geometry");
  const int warp_size = 32;
  const dim3 grid((p.rows + rows_per_block - 1) / rows_per_block, 1, 1);
  const dim3 block(warp_size, nwarps, 1);
  ggml_cuda_mm_fusion_args_device fusion{};
  fusion.glu_op = GGML_GLU_OP_SWIGLU;
  if (kFusion) fusion.gate = gate;
  // ggml_cuda_mul_mat_vec_q's strides for src0 [rows][cols], src1 one column,
  // dst one column: in blocks of src0, q8_1 blocks of src1, floats of dst.
  const uint32_t s01 = p.cols / ggml_cuda_type_traits<type>::qk;  // rows packed
  const uint32_t s11 = p.cols / QK8_1;
  const uint32_t s1 = p.rows;
  const uint3 nchannels_y_fd = make_uint3(0, 0, 0);  // no ids
  const uint3 channel_ratio_fd = init_fastdiv_values(1);
  const uint3 sample_ratio_fd = init_fastdiv_values(1);
  std::printf("launch ggml mul_mat_vec_q<%s, 1, %s, false, false> grid (%u,%u,%u) block (%u,%u,%u)\n",
              type == GGML_TYPE_Q8_0 ? "GGML_TYPE_Q8_0" : "GGML_TYPE_Q4_K",
              kFusion ? "true" : "false", grid.x, grid.y, grid.z, block.x, block.y, block.z);
  mul_mat_vec_q<type, kNcolsDst, kFusion, false, false><<<grid, block>>>(
      vx, vy, nullptr, fusion, dst, p.cols, nchannels_y_fd, s01, s11, s1, channel_ratio_fd,
      s01 * p.rows, s11, s1, sample_ratio_fd, s01 * p.rows, s11, s1, 0);
}

}  // namespace

int main(int argc, char** argv) {
  gpusim_matvec::Problem p;
  if (argc != 2 || !gpusim_matvec::MakeProblem(argv[1], &p)) {
    std::fprintf(stderr, "usage: %s %s\n", argv[0], gpusim_matvec::ProblemNames());
    return 2;
  }
  // ggml's fused pair: vx the up matrix (w[1]), the gate (w[0]) through fusion.
  const int m_count = p.pair ? 2 : 1;
  void* d_w[2] = {nullptr, nullptr};
  for (int m = 0; m < m_count; ++m) {
    CK(cudaMalloc(&d_w[m], p.w[m].size()));
    CK(cudaMemcpy(d_w[m], p.w[m].data(), p.w[m].size(), cudaMemcpyHostToDevice));
  }
  void* d_xq = nullptr;
  float* d_out = nullptr;
  CK(cudaMalloc(&d_xq, p.xq.size()));
  CK(cudaMemcpy(d_xq, p.xq.data(), p.xq.size(), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_out, p.rows * sizeof(float)));
  if (p.name == "q8_0") {
    Launch<GGML_TYPE_Q8_0, false>(p, d_w[0], nullptr, d_xq, d_out);
  } else if (!p.pair) {
    Launch<GGML_TYPE_Q4_K, false>(p, d_w[0], nullptr, d_xq, d_out);
  } else {
    Launch<GGML_TYPE_Q4_K, true>(p, d_w[1], d_w[0], d_xq, d_out);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> out(p.rows);
  CK(cudaMemcpy(out.data(), d_out, p.rows * sizeof(float), cudaMemcpyDeviceToHost));
  const int bad = gpusim_matvec::CheckOutput(p, out, "GGML");
  std::printf(bad ? "RESULT: FAIL\n" : "RESULT: PASS\n");
  return bad ? 1 : 0;
}
