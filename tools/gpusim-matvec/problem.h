// The host side shared by the gpusim matvec harnesses (tools/gpusim-matvec):
// the three cases' random weights and activations and the check of a kernel's
// output. Plain types only, so a translation unit that includes ggml's headers
// (whose QK8_1 and block_q8_1 are macros and globals) can include it too; the
// moegraph side lives in problem.cc, compiled against one tree's kernels/ (the
// working tree's, or HEAD's for the old kernel: its own reference order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// A CUDA call that must succeed (the harnesses; they include <cstdio> and <cstdlib>).
#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace gpusim_matvec {

struct Problem {
  std::string name;   // q8_0 | q4_K | q4_K_pair
  int ggml_type = 0;  // the GGUF type id (8 q8_0, 12 q4_K)
  int rows = 0, cols = 0;
  bool pair = false;  // out = silu(gate x) * (up x); w[0] gate, w[1] up
  size_t row_bytes = 0;
  std::vector<uint8_t> w[2];
  std::vector<float> x;
  std::vector<uint8_t> xq;  // x's q8_1 blocks (36 bytes each), as the host quantizes them
  std::vector<float> expected;  // this tree's matvec_row_reference (and glu for a pair)
};

// One of the cases, from fixed seeds (the same bytes in every harness).
bool MakeProblem(const std::string& name, Problem* p);

// Compares out with p.expected and prints one line; returns the mismatches:
// |out - ref| > 1e-5 * max(|ref|, rms of ref over the rows).
int CheckOutput(const Problem& p, const std::vector<float>& out, const char* kernel);

// The ordered list of names MakeProblem knows, for usage lines.
const char* ProblemNames();

}  // namespace gpusim_matvec
