// NEW and OLD: moegraph's grouped_matvec_kernel<T> (kernels/matvec.cu) under
// gpusim, on the cases of problem.h. Built twice by run.sh: against the
// working tree (NEW, mul_mat_vec_q's geometry) and, with -DGPUSIM_OLD, against
// HEAD's kernels/ exported to build-gpusim/old (the kernel before the rewrite).
//
// The kernel is launched with <<<>>> (gpusim has no cudaLaunchKernelEx) with
// the parameters its launchers build: launch_matvec (Dense) for one matrix,
// launch_matvec_swiglu for the gate/up pair (no q8_1 output: ggml's fused
// kernel writes only the f32 rows), one rank, no epilogue. sm_86 has no PDL:
// wait_for_prior_grids() is empty there.
#include "kernels/matvec.cu"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tools/gpusim-matvec/problem.h"

namespace moegraph {
namespace {

#if defined(GPUSIM_OLD)
constexpr const char* kLabel = "OLD";
#else
constexpr const char* kLabel = "NEW";
#endif

template <GgmlType T>
void Launch(const gpusim_matvec::Problem& p, const uint8_t* const (&w)[2], const block_q8_1* xq,
            float* out) {
  const DeviceMatrix gate{w[0], T, p.cols, p.rows, p.row_bytes};
#if defined(GPUSIM_OLD)
  // HEAD's launch_matvec / launch_matvec_swiglu: MatvecArgs by value, kRows rows a block.
  MatvecArgs a = DenseArgs(gate, nullptr, xq);
  a.out = out;
  if (p.pair) {
    a.w[1] = w[1];
    a.row_bytes[1] = p.row_bytes;
    a.pair = true;
  }
  const dim3 grid(ceil_div(a.rows, kRows), 1);
  const int threads = kThreads;
  std::printf("launch OLD grouped_matvec_kernel<%d> grid (%u,%u,1) block (%d,1,1) group %d\n",
              static_cast<int>(T), grid.x, grid.y, threads, a.group);
  grouped_matvec_kernel<T><<<grid, threads>>>(a);
#else
  // The working tree's launch_matvec / launch_matvec_swiglu: weights and args.
  MatvecLaunch l = Dense(gate, nullptr, xq);
  l.args.out = out;
  if (p.pair) {
    l.weights.w[1] = w[1];
    l.args.row_bytes[1] = p.row_bytes;
    l.args.pair = true;
  }
  const dim3 grid(matvec_row_blocks(T, l.args.rows, l.args.cols), 1);
  const int threads = kMatvecThreads;
  std::printf(
      "launch NEW grouped_matvec_kernel<%d> grid (%u,%u,1) block (%d,1,1) threads_per_row %d "
      "rows_per_block %d\n",
      static_cast<int>(T), grid.x, grid.y, threads, l.args.geometry.threads_per_row,
      l.args.geometry.rows_per_block);
  grouped_matvec_kernel<T><<<grid, threads>>>(l.weights, l.args);
#endif
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  using moegraph::GgmlType;
  gpusim_matvec::Problem p;
  if (argc != 2 || !gpusim_matvec::MakeProblem(argv[1], &p)) {
    std::fprintf(stderr, "usage: %s %s\n", argv[0], gpusim_matvec::ProblemNames());
    return 2;
  }
  const uint8_t* d_w[2] = {nullptr, nullptr};
  for (int m = 0; m < (p.pair ? 2 : 1); ++m) {
    void* d = nullptr;
    CK(cudaMalloc(&d, p.w[m].size()));
    CK(cudaMemcpy(d, p.w[m].data(), p.w[m].size(), cudaMemcpyHostToDevice));
    d_w[m] = static_cast<const uint8_t*>(d);
  }
  void* d_xq = nullptr;
  float* d_out = nullptr;
  CK(cudaMalloc(&d_xq, p.xq.size()));
  CK(cudaMemcpy(d_xq, p.xq.data(), p.xq.size(), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_out, p.rows * sizeof(float)));
  const auto* xq = static_cast<const moegraph::block_q8_1*>(d_xq);
  if (p.ggml_type == static_cast<int>(GgmlType::kQ8_0)) {
    moegraph::Launch<GgmlType::kQ8_0>(p, d_w, xq, d_out);
  } else {
    moegraph::Launch<GgmlType::kQ4_K>(p, d_w, xq, d_out);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> out(p.rows);
  CK(cudaMemcpy(out.data(), d_out, p.rows * sizeof(float), cudaMemcpyDeviceToHost));
  const int bad = gpusim_matvec::CheckOutput(p, out, moegraph::kLabel);
  std::printf(bad ? "RESULT: FAIL\n" : "RESULT: PASS\n");
  return bad ? 1 : 0;
}
