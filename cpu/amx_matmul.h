// q8_0 weights times q8_0 activations on Intel AMX int8 tiles (Sapphire Rapids
// and later), for prompt batches: a 16x16 tile of (weight row, activation row)
// dots per 32-element block in one tdpbssd, where the AVX-512 path
// (cpu/simd_kernels.h) needs a vector instruction per 64 products.
//
// The arithmetic, the contract AmxMatMulQ8_0 is held to bit for bit: for each
// weight row r and activation row t,
//   acc = 0.0f
//   for each block b in order:
//     isum = the exact int32 sum of the 32 products w.qs[i] * a.qs[i]
//     acc = fmaf(f16(w.d) * f16(a.d), (float)isum, acc)
//   out[t * out_stride + r] = acc
// isum converts to float exactly (|isum| <= 32 * 127 * 128 < 2^24) and so do
// the f16 scales, so the only roundings are the scale product and the fma, in
// block order: the result does not depend on n_act, the row range or the
// tiles' padding. It is not ggml's order (its SIMD q8_0 dots fma each block's
// partial sums per vector lane, then add the lanes), so this kernel is a path
// of its own, held to AmxMatMulQ8_0Reference rather than to ggml.
//
// q4_K weights times q8_K activations (the K-quant experts of a prompt) are
// held the same way to AmxMatMulQ4_KReference: for each weight row r and
// activation row t,
//   acc = 0.0f
//   for each 256-element super-block b in order:
//     sc[j], m[j] (j = 0..7) = get_scale_min_k4(j, w.scales)
//     isum = sum_j sc[j] * (the sum over sub-block j's 32 elements of
//            q4 (0..15) * a.qs)                                  exact int32
//     msum = sum_j m[j] * (a.bsums[2j] + a.bsums[2j + 1])        exact int32
//     acc = fmaf(f16(w.d) * a.d, (float)isum, acc)
//     acc = fmaf(-(f16(w.dmin) * a.d), (float)msum, acc)
//   out[t * out_stride + r] = acc
// The sums cannot overflow (|isum| <= 8 * 63 * 32 * 15 * 128 < 2^31); their
// float conversions may round, but the same way in kernel and reference. ggml
// instead sums each super-block's terms in float lanes (and its generic C code
// subtracts the min term in the same expression), so this too is a path of
// its own, not ggml's order.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/simd_kernels.h"

namespace moegraph {

// Weight rows (and activation rows) a step of the kernels computes, on 2x2
// tiles: a row range that is not a multiple of it is padded with zero rows.
inline constexpr int64_t kAmxStepRows = 32;

// Whether this CPU and kernel let the process use AMX int8 tiles: CPUID leaf 7
// (AMX-TILE, AMX-INT8, and AVX512F and VNNI for the kernel's epilogue) and Linux's
// permission for the tile data state, asked once with
// arch_prctl(ARCH_REQ_XCOMP_PERM). Cached after the first call; thread-safe.
bool AmxInt8Available();

// q8_0 activation rows repacked for the tiles (16 rows a group, each block's
// quants in the layout tdpbssd reads, the scales as f32), padded with zero
// rows to a multiple of 32; made once per matrix product, read by every task.
struct AmxQ8_0Acts {
  std::vector<uint8_t> vnni;  // [group of 16 rows][block][8 x 64 bytes]
  std::vector<float> scale;   // [group of 16 rows][block][16]
  int64_t n_act = 0, nb = 0;
};
void PackAmxQ8_0Acts(const uint8_t* act, size_t act_row_bytes, int64_t n_act, int64_t cols,
                     AmxQ8_0Acts* out);

// q8_K activation rows packed for the tiles as AmxQ8_0Acts packs them, a
// 32-element sub-block for a block, with each row's d per super-block and its
// bsums summed per sub-block, a pair of them per int32 (two int16, even
// sub-block low) for the min term.
struct AmxQ8_KActs {
  std::vector<uint8_t> vnni;     // [group of 16 rows][sub-block][8 x 64 bytes]
  std::vector<float> scale;      // [group of 16 rows][super-block][16]: d
  std::vector<uint32_t> bsums;   // [group of 16 rows][super-block][pair][16]
  int64_t n_act = 0, nb = 0;     // nb: super-blocks a row
};
void PackAmxQ8_KActs(const uint8_t* act, size_t act_row_bytes, int64_t n_act, int64_t cols,
                     AmxQ8_KActs* out);

// The MatMulArgs contract (out[t * out_stride + r] for r in [row_begin,
// row_end), t < n_act) for type kQ8_0, cols % 32 == 0, with the arithmetic
// above, the activations (m.act) packed in acts. Requires AmxInt8Available().
void AmxMatMulQ8_0(const MatMulArgs& m, const AmxQ8_0Acts& acts);
// The same, packing m.act first.
void AmxMatMulQ8_0(const MatMulArgs& m);

// The same for type kQ4_K, cols % 256 == 0, with the q4_K arithmetic above
// and q8_K activations. Requires AmxInt8Available().
void AmxMatMulQ4_K(const MatMulArgs& m, const AmxQ8_KActs& acts);
void AmxMatMulQ4_K(const MatMulArgs& m);

// AmxMatMulQ8_0 and AmxMatMulQ4_K calls in this process (the CPU forward's
// prompts take them): tests check the path ran from its delta.
uint64_t AmxMatMulCalls();

// The same numbers by plain scalar C++: the definitions the kernels are held to.
void AmxMatMulQ8_0Reference(const MatMulArgs& m);
void AmxMatMulQ4_KReference(const MatMulArgs& m);

}  // namespace moegraph
