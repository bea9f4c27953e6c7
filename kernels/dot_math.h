// Dot products of quantized weight rows with an f32 vector, without
// materialising the dequantized row: each 32-element chunk of a block is reduced
// with the block's scales factored out. The result equals dequantize_row + dot up
// to float rounding (the scale multiplies a sum instead of each term).
//
// Work split for a warp: quantized rows go by 32-element chunks (lane l takes
// chunks l, l + 32, ...; neighbouring lanes read neighbouring bytes), element
// types (f32/f16/bf16) go by element (lane l takes l, l + 32, ...), so a warp's
// loads are coalesced either way. Light: .cu files include it.
#pragma once

#include <cstdint>

#include "loader/ggml_type.h"
#include "loader/host_device.h"
#include "loader/quant.h"

namespace moegraph {

// Elements per chunk; every quantized type's block is a whole number of chunks.
inline constexpr int kDotChunk = 32;

MG_HD inline bool is_element_type(GgmlType type) {
  return type == GgmlType::kF32 || type == GgmlType::kF16 || type == GgmlType::kBF16;
}

// Element i of a row of an element type.
MG_HD inline float element_at(GgmlType type, const uint8_t* row, int64_t i) {
  switch (type) {
    case GgmlType::kF16:
      return f16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
    case GgmlType::kBF16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
    default:
      return reinterpret_cast<const float*>(row)[i];
  }
}

// Dot of chunk j (elements [32j, 32j + 32)) of one quant block with x[0..32).
// type is a quantized type of loader/quant.h; j < quant_block_elems(type) / 32.
MG_HD inline float quant_chunk_dot(GgmlType type, const uint8_t* block, int j, const float* x) {
  switch (type) {
    case GgmlType::kQ8_0: {
      const block_q8_0* b = reinterpret_cast<const block_q8_0*>(block);
      float sum = 0.0f;
      for (int l = 0; l < QK8_0; ++l) sum += static_cast<float>(b->qs[l]) * x[l];
      return f16_to_f32(b->d) * sum;
    }
    case GgmlType::kQ4_0: {
      const block_q4_0* b = reinterpret_cast<const block_q4_0*>(block);
      float sum = 0.0f;
      for (int l = 0; l < QK4_0 / 2; ++l) {
        sum += static_cast<float>((b->qs[l] & 0x0f) - 8) * x[l];
        sum += static_cast<float>((b->qs[l] >> 4) - 8) * x[l + QK4_0 / 2];
      }
      return f16_to_f32(b->d) * sum;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      // q4_K and q5_K share the header (d, dmin, scales); chunk j is sub-block j,
      // the low (j even) or high (j odd) nibbles of 32 bytes, plus q5_K's bit j.
      const bool q5 = type == GgmlType::kQ5_K;
      const block_q4_K* b4 = reinterpret_cast<const block_q4_K*>(block);
      const block_q5_K* b5 = reinterpret_cast<const block_q5_K*>(block);
      const uint8_t* scales = q5 ? b5->scales : b4->scales;
      const uint8_t* q = (q5 ? b5->qs : b4->qs) + 32 * (j / 2);
      const int shift = (j & 1) * 4;
      uint8_t sc, m;
      get_scale_min_k4(j, scales, &sc, &m);
      float sum_qx = 0.0f;
      float sum_x = 0.0f;
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0xf;
        if (q5 && (b5->qh[l] & (1u << j))) v += 16;
        sum_qx += static_cast<float>(v) * x[l];
        sum_x += x[l];
      }
      const float d = f16_to_f32(b4->d) * sc;
      const float min = f16_to_f32(b4->dmin) * m;
      return d * sum_qx - min * sum_x;
    }
    case GgmlType::kQ6_K: {
      // Chunk j: half h = j / 4 of 128 elements, quarter c = j % 4 of it, as the
      // four y[l + 32c] streams of dequantize_block_q6_K; scales change at l = 16.
      const block_q6_K* b = reinterpret_cast<const block_q6_K*>(block);
      const int h = j / 4;
      const int c = j % 4;
      const uint8_t* ql = b->ql + 64 * h + (c & 1) * 32;
      const uint8_t* qh = b->qh + 32 * h;
      const int8_t* sc = b->scales + 8 * h + 2 * c;
      const int low_shift = (c >> 1) * 4;
      float sums[2] = {0.0f, 0.0f};
      for (int l = 0; l < 32; ++l) {
        const int q = (((ql[l] >> low_shift) & 0xf) | (((qh[l] >> (2 * c)) & 3) << 4)) - 32;
        sums[l / 16] += static_cast<float>(q) * x[l];
      }
      const float d = f16_to_f32(b->d);
      return (d * sc[0]) * sums[0] + (d * sc[1]) * sums[1];
    }
    default:
      return 0.0f;
  }
}

// Dot of one block of type (quant_block_elems(type) elements) with x.
MG_HD inline float block_dot(GgmlType type, const void* block, const float* x) {
  const uint8_t* bytes = static_cast<const uint8_t*>(block);
  if (is_element_type(type)) return element_at(type, bytes, 0) * x[0];
  const int chunks = static_cast<int>(quant_block_elems(type) / kDotChunk);
  float sum = 0.0f;
  for (int j = 0; j < chunks; ++j) sum += quant_chunk_dot(type, bytes, j, x + j * kDotChunk);
  return sum;
}

// The part of dot(row, x) that lane `lane` of `n_lanes` computes (see the top
// comment); the lanes' parts sum to the row's dot. cols: a multiple of the
// type's block size (any count for element types).
MG_HD inline float row_dot_lane(GgmlType type, const uint8_t* row, const float* x, int64_t cols,
                                int lane, int n_lanes) {
  float sum = 0.0f;
  if (is_element_type(type)) {
    for (int64_t i = lane; i < cols; i += n_lanes) sum += element_at(type, row, i) * x[i];
    return sum;
  }
  const int64_t chunks_per_block = quant_block_elems(type) / kDotChunk;
  const int64_t block_bytes = quant_block_bytes(type);
  const int64_t n_chunks = cols / kDotChunk;
  for (int64_t c = lane; c < n_chunks; c += n_lanes) {
    const uint8_t* block = row + (c / chunks_per_block) * block_bytes;
    sum += quant_chunk_dot(type, block, static_cast<int>(c % chunks_per_block), x + c * kDotChunk);
  }
  return sum;
}

// dot(row, x) over cols elements, in one sequence.
MG_HD inline float row_dot(GgmlType type, const uint8_t* row, const float* x, int64_t cols) {
  return row_dot_lane(type, row, x, cols, 0, 1);
}

// Whether a matvec can read rows of cols elements of type.
MG_HD inline bool matvec_supports(GgmlType type, int64_t cols) {
  const int64_t block_elems = quant_block_elems(type);
  return block_elems != 0 && cols > 0 && cols % block_elems == 0;
}

}  // namespace moegraph
