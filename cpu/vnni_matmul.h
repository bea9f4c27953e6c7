// The prompt matmuls of cpu/amx_matmul.h on AVX-512 VNNI, for CPUs without
// AMX tiles (Intel from Cascade Lake, AMD from Zen 4), with MOEGRAPH_AMX=0,
// and for products of 8 to 15 activation rows: the same activations packed
// the same way (AmxQ8_0Acts, AmxQ8_KActs) and the same arithmetic, held to
// AmxMatMulQ8_0Reference and AmxMatMulQ4_KReference bit for bit, so a
// prompt's logits do not depend on which of the two ran.
//
// Sixteen activation rows sit in the lanes of a vector (the packed layout's
// 16-row groups) and each weight row's four bytes are broadcast against
// them: vpdpbusd adds 64 products an instruction. It multiplies unsigned by
// signed bytes, so the activations go in with 128 added (their sign bit
// flipped) and the weights' sums times 128 come off: exact in int32.
#pragma once

#include <cstdint>

#include "cpu/amx_matmul.h"
#include "cpu/simd_kernels.h"

namespace moegraph {

// Weight rows a pass of the kernels computes at once (row ranges of any
// length run; a multiple of it takes no single-row passes).
inline constexpr int64_t kVnniPassRows = 8;

// Whether this CPU and OS run AVX-512 F, BW and VNNI. Cached; thread-safe.
bool AvxVnniAvailable();

// AmxMatMulQ8_0's and AmxMatMulQ4_K's contracts and bits. Require
// AvxVnniAvailable().
void VnniMatMulQ8_0(const MatMulArgs& m, const AmxQ8_0Acts& acts);
void VnniMatMulQ4_K(const MatMulArgs& m, const AmxQ8_KActs& acts);
// The same, packing m.act first.
void VnniMatMulQ8_0(const MatMulArgs& m);
void VnniMatMulQ4_K(const MatMulArgs& m);

// VnniMatMulQ8_0 and VnniMatMulQ4_K calls in this process: tests check the
// path ran from its delta.
uint64_t VnniMatMulCalls();

}  // namespace moegraph
