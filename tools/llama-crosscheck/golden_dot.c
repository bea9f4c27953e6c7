// Prints golden dot products made by ggml's CPU backend: for each type named on
// the command line, 2 weight rows quantized by ggml_quantize_chunk (no importance
// matrix) and 5 activation rows quantized by the type's vec_dot_type from_float,
// both from golden_input below, then the type's vec_dot (ggml_vec_dot_*) of every
// pair, as a C++ table for tests/cpu_kernels_test.cc (kGgmlDots). Built against
// node-llama-cpp's prebuilt ggml by golden-dot.sh.
// Usage: golden_dot TYPE...
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"

enum { kWeightRows = 2, kActRows = 5 };

static uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Element i of row r of input `seed`: uniform in [-scale / 2, scale / 2), in
// float arithmetic that is exact (24 random bits, a power-of-two scale), so the
// test makes the same values. Keep in step with GoldenInput in the test.
static float golden_input(uint32_t seed, int64_t r, int64_t i, float scale) {
  const uint64_t h = splitmix64(((uint64_t)seed << 48) ^ ((uint64_t)r << 32) ^ (uint64_t)i);
  return ((float)(h >> 40) * 0x1p-24f - 0.5f) * scale;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: golden_dot TYPE...\n");
    return 2;
  }
  ggml_cpu_init();
  for (int a = 1; a < argc; ++a) {
    int type = -1;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
      const char* name = ggml_type_name((enum ggml_type)t);
      if (name != NULL && strcmp(name, argv[a]) == 0) type = t;
    }
    if (type < 0) {
      fprintf(stderr, "golden_dot: unknown type %s\n", argv[a]);
      return 1;
    }
    // An odd count of 32-element blocks (iq4_nl and mxfp4 take the last apart);
    // three super-blocks for the K-quants.
    const int64_t cols = ggml_blck_size((enum ggml_type)type) == 256 ? 768 : 800;
    const struct ggml_type_traits_cpu* traits = ggml_get_type_traits_cpu((enum ggml_type)type);
    const struct ggml_type_traits_cpu* act_traits = ggml_get_type_traits_cpu(traits->vec_dot_type);
    const size_t w_bytes = ggml_row_size((enum ggml_type)type, cols);
    const size_t a_bytes = ggml_row_size(traits->vec_dot_type, cols);
    float* x = malloc(sizeof(float) * kWeightRows * cols);
    char* w = malloc(w_bytes * kWeightRows);
    char* act = malloc(a_bytes * kActRows);
    for (int64_t r = 0; r < kWeightRows; ++r) {
      for (int64_t i = 0; i < cols; ++i) x[r * cols + i] = golden_input(1, r, i, 0.125f);
    }
    ggml_quantize_init((enum ggml_type)type);
    ggml_quantize_chunk((enum ggml_type)type, x, w, 0, kWeightRows, cols, NULL);
    for (int64_t t = 0; t < kActRows; ++t) {
      for (int64_t i = 0; i < cols; ++i) x[i] = golden_input(2, t, i, 2.0f);
      act_traits->from_float(x, act + t * a_bytes, cols);
    }
    printf("    {\"%s\", %lld, {", argv[a], (long long)cols);
    for (int64_t r = 0; r < kWeightRows; ++r) {
      for (int64_t t = 0; t < kActRows; ++t) {
        float s;
        traits->vec_dot((int)cols, &s, 0, w + r * w_bytes, 0, act + t * a_bytes, 0, 1);
        uint32_t bits;
        memcpy(&bits, &s, sizeof(bits));
        printf("%s0x%08x", r + t > 0 ? ", " : "", bits);
      }
    }
    printf("}},\n");
    free(x);
    free(w);
    free(act);
  }
  return 0;
}
