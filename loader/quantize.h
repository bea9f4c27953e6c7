// Host quantizers: ports of ggml's reference quantizers (quantize_row_*_ref in
// ggml/src/ggml-quants.c, the path ggml_quantize_chunk takes without an importance
// matrix), so the bytes they write are the bytes ggml writes. Dequantization is
// dequantize_row in loader/quant.h.
#pragma once

#include <cstdint>
#include <string>

#include "loader/ggml_type.h"

namespace moegraph {

// True for the types moegraph reads and writes: f32, f16, bf16, q8_0, q4_0, q4_1,
// q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4.
bool quant_supported(GgmlType type);

// Those types' names, comma-separated in ggml's id order, for messages.
std::string quant_supported_names();

// Quantizes n floats into ggml_row_size(type, n) bytes at dst. type must be
// supported and n a multiple of its block size (CHECKed: a programming error).
void quantize_row(GgmlType type, const float* x, void* dst, int64_t n);

}  // namespace moegraph
