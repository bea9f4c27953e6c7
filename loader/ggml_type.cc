#include "loader/ggml_type.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace moegraph {
namespace {

// ggml/src/ggml.c type_traits, indexed by id (ggml.h enum ggml_type, up to
// GGML_TYPE_Q2_0 = 42). Ids 4, 5 (q4_2, q4_3), 31-33 (q4_0_4x4 ...) and 36-38
// (iq4_nl_4x4 ...) were removed from GGUF files and stay empty here.
constexpr GgmlTypeInfo kTypes[] = {
    {"f32", 1, 4},         // 0
    {"f16", 1, 2},         // 1
    {"q4_0", 32, 18},      // 2
    {"q4_1", 32, 20},      // 3
    {},                    // 4: q4_2, removed
    {},                    // 5: q4_3, removed
    {"q5_0", 32, 22},      // 6
    {"q5_1", 32, 24},      // 7
    {"q8_0", 32, 34},      // 8
    {"q8_1", 32, 36},      // 9
    {"q2_K", 256, 84},     // 10
    {"q3_K", 256, 110},    // 11
    {"q4_K", 256, 144},    // 12
    {"q5_K", 256, 176},    // 13
    {"q6_K", 256, 210},    // 14
    {"q8_K", 256, 292},    // 15
    {"iq2_xxs", 256, 66},  // 16
    {"iq2_xs", 256, 74},   // 17
    {"iq3_xxs", 256, 98},  // 18
    {"iq1_s", 256, 50},    // 19
    {"iq4_nl", 32, 18},    // 20
    {"iq3_s", 256, 110},   // 21
    {"iq2_s", 256, 82},    // 22
    {"iq4_xs", 256, 136},  // 23
    {"i8", 1, 1},          // 24
    {"i16", 1, 2},         // 25
    {"i32", 1, 4},         // 26
    {"i64", 1, 8},         // 27
    {"f64", 1, 8},         // 28
    {"iq1_m", 256, 56},    // 29
    {"bf16", 1, 2},        // 30
    {},                    // 31: q4_0_4_4, removed
    {},                    // 32: q4_0_4_8, removed
    {},                    // 33: q4_0_8_8, removed
    {"tq1_0", 256, 54},    // 34
    {"tq2_0", 256, 66},    // 35
    {},                    // 36: iq4_nl_4_4, removed
    {},                    // 37: iq4_nl_4_8, removed
    {},                    // 38: iq4_nl_8_8, removed
    {"mxfp4", 32, 17},     // 39
    {"nvfp4", 64, 36},     // 40
    {"q1_0", 128, 18},     // 41
    {"q2_0", 64, 18},      // 42
};
constexpr uint32_t kTypeCount = sizeof(kTypes) / sizeof(kTypes[0]);

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t type) {
  if (type >= kTypeCount || kTypes[type].block_size == 0) return nullptr;
  return &kTypes[type];
}

std::string ggml_type_name(uint32_t type) {
  const GgmlTypeInfo* info = ggml_type_info(type);
  return info ? std::string(info->name) : "type " + std::to_string(type);
}

bool ggml_type_from_name(std::string_view name, GgmlType* out) {
  for (uint32_t id = 0; id < kTypeCount; ++id) {
    const GgmlTypeInfo& info = kTypes[id];
    if (info.block_size == 0) continue;
    if (EqualsIgnoringCase(name, info.name)) {
      *out = static_cast<GgmlType>(id);
      return true;
    }
  }
  return false;
}

size_t ggml_row_size(GgmlType type, int64_t n) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  if (info == nullptr || n < 0 || n % info->block_size != 0) {
    std::fprintf(stderr, "ggml_row_size: %lld elements of %s is not a whole number of blocks\n",
                 static_cast<long long>(n), ggml_type_name(static_cast<uint32_t>(type)).c_str());
    std::abort();
  }
  return static_cast<size_t>(n / info->block_size) * info->type_size;
}

}  // namespace moegraph
