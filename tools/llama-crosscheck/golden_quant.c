// Writes golden quantization vectors with ggml's own code: for each type named on
// the command line, ggml_quantize_chunk (no importance matrix, the path
// llama-quantize takes without --imatrix) of the rows in INPUT, then the type's
// to_float. Built against llama.cpp's ggml sources by golden-quant.sh.
// Usage: golden_quant INPUT ROWS COLS OUT_DIR TYPE...
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"

static int write_file(const char* dir, const char* name, const char* suffix, const void* data,
                      size_t bytes) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s%s", dir, name, suffix);
  FILE* f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
    fprintf(stderr, "golden_quant: cannot write %s\n", path);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: golden_quant INPUT ROWS COLS OUT_DIR TYPE...\n");
    return 2;
  }
  const int64_t rows = atoll(argv[2]);
  const int64_t cols = atoll(argv[3]);
  float* input = malloc(sizeof(float) * rows * cols);
  FILE* in = fopen(argv[1], "rb");
  if (in == NULL || fread(input, sizeof(float), rows * cols, in) != (size_t)(rows * cols)) {
    fprintf(stderr, "golden_quant: cannot read %lld floats from %s\n", (long long)(rows * cols),
            argv[1]);
    return 1;
  }
  fclose(in);
  printf("| type | row bytes (%lld elements) | ggml rel. RMSE per row |\n| --- | --- | --- |\n",
         (long long)cols);
  for (int a = 5; a < argc; ++a) {
    int type = -1;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
      const char* name = ggml_type_name((enum ggml_type)t);
      if (name != NULL && strcmp(name, argv[a]) == 0) type = t;
    }
    if (type < 0) {
      fprintf(stderr, "golden_quant: unknown type %s\n", argv[a]);
      return 1;
    }
    const size_t row_bytes = ggml_row_size((enum ggml_type)type, cols);
    void* quant = malloc(row_bytes * rows);
    float* dequant = malloc(sizeof(float) * rows * cols);
    ggml_quantize_init((enum ggml_type)type);
    ggml_quantize_chunk((enum ggml_type)type, input, quant, 0, rows, cols, NULL);
    const struct ggml_type_traits* traits = ggml_get_type_traits((enum ggml_type)type);
    printf("| %s | %zu |", argv[a], row_bytes);
    for (int64_t r = 0; r < rows; ++r) {
      traits->to_float((const char*)quant + r * row_bytes, dequant + r * cols, cols);
      double err = 0, ref = 0;
      for (int64_t i = 0; i < cols; ++i) {
        const double x = input[r * cols + i], y = dequant[r * cols + i];
        err += (y - x) * (y - x);
        ref += x * x;
      }
      printf(" %.3g", ref > 0 ? __builtin_sqrt(err / ref) : 0.0);
    }
    printf(" |\n");
    if (write_file(argv[4], argv[a], ".quant", quant, row_bytes * rows) ||
        write_file(argv[4], argv[a], ".dequant.f32", dequant, sizeof(float) * rows * cols)) {
      return 1;
    }
    free(quant);
    free(dequant);
  }
  free(input);
  return 0;
}
