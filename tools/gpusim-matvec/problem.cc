// The cases' data and the output check (problem.h), against the kernels/ tree
// on the include path: its matvec_row_reference is the expected row, so the
// working tree's kernel and HEAD's each meet their own order (bitwise up to fma
// contraction), and ggml's, a different order for q4_K, meets the working
// tree's within the tolerance.
#include "tools/gpusim-matvec/problem.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "kernels/mmvq_math.h"
#include "kernels/nn_math.h"
#include "loader/ggml_type.h"
#include "loader/quant.h"
#include "loader/quantize.h"

namespace gpusim_matvec {
namespace {

using moegraph::GgmlType;

std::vector<float> Gaussian(std::mt19937& rng, int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// rows x cols of type, quantized from Gaussian values (tests/kernels_gpu_test.cc's RandomMatrix).
std::vector<uint8_t> RandomMatrix(std::mt19937& rng, GgmlType type, int64_t rows, int64_t cols) {
  const size_t row_bytes = moegraph::ggml_row_size(type, cols);
  std::vector<uint8_t> bytes(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> values = Gaussian(rng, cols, 0.5f);
    moegraph::quantize_row(type, values.data(), bytes.data() + r * row_bytes, cols);
  }
  return bytes;
}

}  // namespace

const char* ProblemNames() { return "q8_0 | q4_K | q4_K_pair"; }

bool MakeProblem(const std::string& name, Problem* p) {
  GgmlType type;
  if (name == "q8_0") {
    // Qwen3-30B-A3B's q projection: 4096 rows (32 heads x 128) of n_embd 2048.
    type = GgmlType::kQ8_0;
    p->rows = 4096;
    p->cols = 2048;
    p->pair = false;
  } else if (name == "q4_K" || name == "q4_K_pair") {
    // One expert's gate (and up) projection: n_ff_exp 768 rows of n_embd 2048.
    type = GgmlType::kQ4_K;
    p->rows = 768;
    p->cols = 2048;
    p->pair = name == "q4_K_pair";
  } else {
    return false;
  }
  p->name = name;
  p->ggml_type = static_cast<int>(type);
  p->row_bytes = moegraph::ggml_row_size(type, p->cols);
  std::mt19937 rng(20261207);
  for (int m = 0; m < (p->pair ? 2 : 1); ++m) p->w[m] = RandomMatrix(rng, type, p->rows, p->cols);
  p->x = Gaussian(rng, p->cols, 1.0f);
  std::vector<moegraph::block_q8_1> xq(p->cols / moegraph::QK8_1);
  for (size_t b = 0; b < xq.size(); ++b) {
    moegraph::quantize_q8_1_block(p->x.data() + b * moegraph::QK8_1, &xq[b]);
  }
  static_assert(sizeof(moegraph::block_q8_1) == 36, "q8_1 block");
  p->xq.resize(xq.size() * sizeof(moegraph::block_q8_1));
  std::memcpy(p->xq.data(), xq.data(), p->xq.size());
  p->expected.resize(p->rows);
  for (int r = 0; r < p->rows; ++r) {
    float v[2];
    for (int m = 0; m < (p->pair ? 2 : 1); ++m) {
      v[m] = moegraph::matvec_row_reference(type, p->w[m].data() + r * p->row_bytes, p->x.data(),
                                            xq.data(), p->cols);
    }
    p->expected[r] = p->pair ? moegraph::glu(moegraph::GluAct::kSilu, v[0], v[1]) : v[0];
  }
  return true;
}

int CheckOutput(const Problem& p, const std::vector<float>& out, const char* kernel) {
  double sq = 0.0;
  for (float e : p.expected) sq += static_cast<double>(e) * e;
  const double rms = std::sqrt(sq / p.rows);
  int bad = 0, exact = 0;
  double max_err = 0.0;  // |out - ref| / max(|ref|, rms)
  for (int r = 0; r < p.rows; ++r) {
    const double ref = p.expected[r];
    const double err = std::fabs(out[r] - ref) / std::fmax(std::fabs(ref), rms);
    if (out[r] == p.expected[r]) ++exact;
    if (!(err <= 1e-5)) {
      if (bad < 5) std::printf("  row %d: got %.9g want %.9g\n", r, out[r], ref);
      ++bad;
    }
    if (err > max_err || err != err) max_err = err;
  }
  std::printf("check %s %s: rows=%d cols=%d bitwise_equal=%d mismatches=%d max_rel_err=%.3g\n",
              kernel, p.name.c_str(), p.rows, p.cols, exact, bad, max_err);
  return bad;
}

}  // namespace gpusim_matvec
