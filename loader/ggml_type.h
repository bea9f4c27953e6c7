// ggml tensor types as GGUF stores them: the numeric ids, block sizes and block
// byte sizes of ggml.h / ggml.c (type_traits). Ids that ggml removed stay unknown.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moegraph {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
  kQ2_0 = 42,
};

struct GgmlTypeInfo {
  std::string_view name;  // ggml's name: "f32", "q4_K", ...
  int64_t block_size;     // elements per block
  size_t type_size;       // bytes per block
};

// Null for an id ggml does not define (never defined, or removed).
const GgmlTypeInfo* ggml_type_info(uint32_t type);

// Name for messages: ggml's name, or "type N" for an unknown id.
std::string ggml_type_name(uint32_t type);

// Parses ggml's name in any case ("q4_K", "Q4_K", "q4_k"), as llama-quantize
// does. Returns false on an unknown name.
bool ggml_type_from_name(std::string_view name, GgmlType* out);

// Bytes of one row of n elements; n must be a multiple of the block size.
size_t ggml_row_size(GgmlType type, int64_t n);

}  // namespace moegraph
