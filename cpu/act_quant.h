// The activations' side of the CPU path's dot products, as ggml's CPU backend
// does it: each matmul input row is quantized once to the weight type's
// vec_dot_type (ggml-cpu.c type_traits_cpu: q8_0 for q8_0/q4_0/q5_0/iq4_nl/mxfp4
// weights, q8_1 for q4_1/q5_1, q8_K for the K-quants and iq4_xs; f32 rows stay
// f32), by ggml's reference code (ggml-quants.c quantize_row_q8_0_ref,
// quantize_row_q8_1_ref and quantize_row_q8_K_ref). The scalar dot products here follow
// ggml-cpu/quants.c's
// *_generic functions; they are what the SIMD kernels (cpu/simd_kernels.h) are
// tested against, and the speed baseline in the benchmarks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "loader/ggml_type.h"
#include "loader/quant.h"

namespace moegraph {

// ggml's block_q8_K: the activations of one 256-element super-block.
struct block_q8_K {
  float d;                   // scale
  int8_t qs[QK_K];           // quants
  int16_t bsums[QK_K / 16];  // sums of each 16 quants
};
static_assert(sizeof(block_q8_K) == 292, "block_q8_K must match ggml");

// How an activation row is held for a weight type's dot product.
enum class ActType { kF32, kQ8_0, kQ8_1, kQ8_K };

// The activation form for weights of type w, ggml's vec_dot_type (see above);
// kF32 for f32, f16 and bf16.
ActType act_type_for(GgmlType w);

// Bytes of one activation row of cols elements (cols a multiple of the block).
size_t act_row_bytes(ActType type, int64_t cols);

// x[0..cols) into dst (act_row_bytes(type, cols) bytes).
void quantize_act_row(ActType type, const float* x, int64_t cols, uint8_t* dst);

// The dot of one weight row of type w (cols elements) with one activation row
// in act_type_for(w)'s form, computed as ggml's generic C code does.
float dot_row_ref(GgmlType w, const uint8_t* w_row, const uint8_t* act_row, int64_t cols);

}  // namespace moegraph
