// The CPU path's inner loops in Google Highway, compiled for several targets
// (AVX-512, AVX2, and Highway's portable code, EMU128 or SCALAR) and picked at run
// time for the CPU at hand. Each weight row's dot with an activation row takes
// the same operations in the same order whatever the batch (several rows share
// a weight block's unpacking, not its sums), the thread count or where the row
// lives, so results do not depend on them; they do depend on the target (the
// order of the additions differs), which the tests cover one by one. On the
// x86 targets (AVX2, AVX-512) a quantized row's dot is the one ggml's CPU
// backend computes, bit for bit; the portable target's is within rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/act_quant.h"
#include "loader/ggml_type.h"

namespace moegraph {

// out[t * out_stride + r] = dot(weight row r, activation row t) for r in
// [row_begin, row_end) and t < n_act. Activation rows are in act_type_for(type)'s
// form (cpu/act_quant.h), act_row_bytes apart.
struct MatMulArgs {
  GgmlType type = GgmlType::kF32;
  const uint8_t* w = nullptr;
  size_t w_row_bytes = 0;
  int64_t cols = 0;
  int64_t row_begin = 0, row_end = 0;
  const uint8_t* act = nullptr;
  size_t act_row_bytes = 0;
  int64_t n_act = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
};
void SimdMatMulRows(const MatMulArgs& args);

// quantize_act_row (cpu/act_quant.h) in SIMD: the same bytes for finite x.
void SimdQuantizeActRow(ActType type, const float* x, int64_t cols, uint8_t* dst);

// Sum of a[i] * b[i]; b as f32 or f16 bits (the KV cache's two forms).
float SimdDotF32(const float* a, const float* b, int64_t n);
float SimdDotF16(const float* a, const uint16_t* b, int64_t n);
// y[i] += alpha * x[i]; x as f32 or f16 bits.
void SimdAxpyF32(float alpha, const float* x, float* y, int64_t n);
void SimdAxpyF16(float alpha, const uint16_t* x, float* y, int64_t n);

// One token of the gated delta rule on one value head (qwen35moe's linear
// attention, ggml_gated_delta_net's step): m is the head's state, head_dim
// rows (value j) of head_dim floats (key i). With M decayed by decay (exp(g)):
// delta_j = (v_j - m_j . k) beta, m_j += delta_j k, o_j = (m_j . q) scale.
// Each row is read twice (its dots with k and q in one pass, the update in
// the other) where the op's own loop reads it four times.
void SimdDeltaRuleStep(int head_dim, const float* q, const float* k, const float* v, float decay,
                       float beta, float scale, float* m, float* o);

// Attention of heads query heads that share their keys and values (a GQA
// group) over the n cached positions first..first+n-1; for head h (its query
// and output the head_dim floats at q and out + h * head_dim):
// scores[j] = scale * q.k_j, then out = sum_j softmax(scores)_j v_j, where k_j
// and v_j are head_dim elements (f16 bits or f32) at k and v plus row * stride
// bytes, the row of position first + j (its remainder mod rows in a ring of
// rows rows; rows 0: no ring); a finite sink (gpt-oss; sinks[h], sinks null:
// none) is one more logit in the softmax with no value. Each head's bits are
// what it gets alone. scores holds heads * n floats of scratch.
void SimdAttendHeads(const float* q, int heads, const uint8_t* k, const uint8_t* v, size_t stride,
                     bool f16, int64_t first, int64_t n, int64_t rows, int head_dim, float scale,
                     const float* sinks, float* scores, float* out);

// The target the calls above run on ("AVX3", "AVX2", "SCALAR", ...).
std::string SimdTargetName();

// The target SimdTargetName() names, as users know it: "AVX-512", "AVX-512 (Zen 4)",
// "AVX2", "portable (no SIMD target)".
std::string SimdTargetLabel();

// The targets this build holds code for that this CPU can run, best first,
// whatever SimdForceTarget forced.
std::vector<int64_t> SimdTargets();
std::string SimdTargetName(int64_t target);
// Restricts the calls above to one target of SimdTargets() (0: back to the best).
void SimdForceTarget(int64_t target);

}  // namespace moegraph
