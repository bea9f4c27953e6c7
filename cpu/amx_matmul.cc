// Design. Each step computes 32 weight rows x 32 activations for one 32-element
// block on a 2x2 grid of tiles: A (16 weight rows x 32 int8) in tmm4-5, B (16
// activations in the VNNI layout tdpbssd reads, B[k/4][n*4 + k%4] = a_n[k]) in
// tmm6-7, the four 16x16 int32 sums in tmm0-3. The activations are repacked
// once per call; each group of 32 weight rows once (contiguous, zero-padded),
// then reused by every activation group. The contract's per-block fma (see the
// header) forbids accumulating blocks in the tiles, so each block's sums are
// stored and folded into f32 accumulators by AVX-512. Measured on Sapphire
// Rapids, the tile work (its 4 KiB of stores a step included) and that fold
// take comparable time; double-buffering the sums to overlap them measured no
// faster, so the loop runs them in turn.
//
// q4_K runs on the same 32 x 32 steps, a 256-element super-block a step, but
// folds each sub-block's 6-bit scale into the A operand so that the tiles sum
// a whole super-block: per element w = q4 * sc (0..945) = 256 * hi + lo, and
// A holds lo (u8) in tmm4 and hi (0..3) in tmm5, each 16 weight rows x 64
// elements, against B (16 activations x 64 int8, the q8_0 layout of two
// consecutive 32-element blocks) by tdpbusd; isum = 256 * C_hi + C_lo exactly.
// With 8 tiles that is one row half at a time: C_lo and C_hi for both
// activation halves in tmm0-3. Against a tile product and an int32 multiply
// per sub-block this takes twice the tile products (K = 64 where the
// sub-block has 32) but an eighth of the stores and no int32 multiplies in
// the fold. The min term, sum_j m[j] * bsum[j], is a vpmaddwd and 3 vpdpwssd
// a row: mins and bsums in int16 pairs.
#include "cpu/amx_matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/act_quant.h"
#include "loader/check.h"
#include "loader/quant.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace moegraph {
namespace {

void CheckArgs(const MatMulArgs& m, GgmlType type, int64_t block) {
  MG_CHECK(m.type == type, "the AMX matmul was given weights of another type");
  MG_CHECK(m.cols % block == 0, "cols must be a multiple of the weight type's block");
}

template <typename Block>
const Block* Row(const uint8_t* base, size_t row_bytes, int64_t i) {
  return reinterpret_cast<const Block*>(base + static_cast<size_t>(i) * row_bytes);
}

// q4_K sub-block j's sum of 2 * 16 bsums, the min term's multiplicand.
int32_t SubBlockSum(const block_q8_K& a, int j) { return a.bsums[2 * j] + a.bsums[2 * j + 1]; }

// The references' loop: each output is 0.0f folded through fold(weight
// block, activation block, acc) over the row's blocks of block elements in
// order.
template <typename WeightBlock, typename ActBlock, typename Fold>
void ReferenceLoop(const MatMulArgs& m, int64_t block, Fold fold) {
  const int64_t nb = m.cols / block;
  for (int64_t t = 0; t < m.n_act; ++t) {
    const auto* a = Row<ActBlock>(m.act, m.act_row_bytes, t);
    for (int64_t r = m.row_begin; r < m.row_end; ++r) {
      const auto* w = Row<WeightBlock>(m.w, m.w_row_bytes, r);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) acc = fold(w[b], a[b], acc);
      m.out[t * m.out_stride + r] = acc;
    }
  }
}

// The q8_0 contract's step: acc with block w . a added.
float FoldQ8_0Block(const block_q8_0& w, const block_q8_0& a, float acc) {
  int32_t isum = 0;
  for (int i = 0; i < QK8_0; ++i) isum += w.qs[i] * a.qs[i];
  const float scale = f16_to_f32(w.d) * f16_to_f32(a.d);
  return std::fmaf(scale, static_cast<float>(isum), acc);
}

// The q4_K contract's step: acc with super-block w . a added.
float FoldQ4_KSuperBlock(const block_q4_K& w, const block_q8_K& a, float acc) {
  int32_t isum = 0, msum = 0;
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t sc, mn;
    get_scale_min_k4(j, w.scales, &sc, &mn);
    const uint8_t* q = w.qs + 32 * (j / 2);  // j odd: the high nibbles
    const int8_t* x = a.qs + 32 * j;
    int32_t sub = 0;
    for (int i = 0; i < 32; ++i) sub += ((q[i] >> (4 * (j % 2))) & 0xf) * x[i];
    isum += sc * sub;
    msum += mn * SubBlockSum(a, j);
  }
  const float scale = f16_to_f32(w.d) * a.d;
  const float min_scale = f16_to_f32(w.dmin) * a.d;
  acc = std::fmaf(scale, static_cast<float>(isum), acc);
  return std::fmaf(-min_scale, static_cast<float>(msum), acc);
}

}  // namespace

void AmxMatMulQ8_0Reference(const MatMulArgs& m) {
  CheckArgs(m, GgmlType::kQ8_0, QK8_0);
  ReferenceLoop<block_q8_0, block_q8_0>(m, QK8_0, &FoldQ8_0Block);
}

void AmxMatMulQ4_KReference(const MatMulArgs& m) {
  CheckArgs(m, GgmlType::kQ4_K, QK_K);
  ReferenceLoop<block_q4_K, block_q8_K>(m, QK_K, &FoldQ4_KSuperBlock);
}

#if defined(__x86_64__) && defined(__linux__)

bool AmxInt8Available() {
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool avx512f = (ebx >> 16) & 1, avx512_vnni = (ecx >> 11) & 1;
    const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
    if (!avx512f || !avx512_vnni || !amx_tile || !amx_int8) return false;
    // The tile data state (XSTATE component 18) is off until the process asks;
    // the first tile instruction without this permission is a SIGILL.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

namespace {

#define MOEGRAPH_AMX_TARGET                                                                \
  __attribute__((target(                                                                   \
      "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

constexpr int kTile = 16;              // rows of a tile, int32 columns of C
constexpr int kStep = 2 * kTile;       // weight rows and activations per step (2x2 tiles)
static_assert(kStep == kAmxStepRows, "the header's step");
constexpr int kBTileBytes = 8 * 64;    // one block of 16 activations, VNNI layout
constexpr int kSubBlocks = QK_K / 32;  // q4_K sub-blocks (and q8_0-sized blocks) a super-block
constexpr int kChunks = QK_K / 64;     // q4_K tile products (K = 64) a super-block
constexpr int kChunkTile = 64 * kTile;  // bytes of one 16 x 64 A or B tile

// ldtilecfg's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

struct Q8_0Scratch {
  std::vector<uint8_t> w_quants;  // one row group's [block][kStep rows][32 bytes]
  std::vector<float> w_scale;     // one row group's [block][kStep rows]
};

// One row group of q4_K weights, unpacked for the tiles: q4 * sc split into
// bytes, [super-block][row half][64-element chunk][lo, hi][16 rows][64 bytes]
// (each A tile 1 KiB in a row); the min term's mins as int16 pairs
// [super-block][kStep rows][pair]; d and dmin [super-block][kStep rows].
struct Q4_KScratch {
  std::vector<uint8_t> w_quants;
  std::vector<uint32_t> w_mins;
  std::vector<float> w_d, w_dmin;
};

std::atomic<uint64_t> amx_calls{0};

// GCC's tile intrinsics are asm statements that name their pointer but not
// the memory behind it (ldtilecfg's operand claims 8 bytes): without this the
// stores that fill a buffer could move past the tile load that reads it.
inline void MemoryBarrier() { asm volatile("" ::: "memory"); }

int64_t PaddedActs(int64_t n_act) { return (n_act + kStep - 1) / kStep * kStep; }

// Column n of a group's B tiles, one tile (kBTileBytes) a 32-element block,
// n_blocks of them: block i's quants from qs + i * stride, zeros where qs is
// null (a padding row).
void PackVnniColumn(const int8_t* qs, size_t stride, int64_t n_blocks, int64_t n, uint8_t* tiles) {
  for (int64_t i = 0; i < n_blocks; ++i) {
    uint8_t* tile = tiles + i * kBTileBytes + n * 4;
    for (int k = 0; k < QK8_0; k += 4) {
      if (qs == nullptr) {
        std::memset(tile + k * 16, 0, 4);
      } else {
        std::memcpy(tile + k * 16, qs + i * stride + k, 4);
      }
    }
  }
}

// Palette 1 with tmm0-3 the 16 x 16 int32 sums (C), tmm4-5 16 weight rows x
// a_bytes (A), tmm6-7 b_rows x 16 activations' 4 bytes (B, VNNI).
MOEGRAPH_AMX_TARGET void ConfigureTiles(int a_bytes, int b_rows) {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = i < 6 ? kTile : b_rows;
    config.colsb[i] = i == 4 || i == 5 ? a_bytes : kTile * 4;
  }
  MemoryBarrier();
  _tile_loadconfig(&config);
}

// The step's accumulators (acc[row][act]) into m.out for the rows and
// activations that exist.
MOEGRAPH_AMX_TARGET inline void StoreStep(const MatMulArgs& m, int64_t r0, int64_t t0,
                                          const float (*acc)[kStep]) {
  const int64_t n_rows = std::min<int64_t>(kStep, m.row_end - r0);
  const int64_t n_acts = std::min<int64_t>(kStep, m.n_act - t0);
  for (int64_t t = 0; t < n_acts; ++t) {
    float* out = m.out + (t0 + t) * m.out_stride + r0;
    for (int64_t i = 0; i < n_rows; ++i) out[i] = acc[i][t];
  }
}

// Both kernels: the checks, the count, the tiles configured for
// Path::kABytes of A a row and Path::kBRows of B, then for each kStep weight
// rows path.PackRows(r0, n_rows) once and for each kStep activations (from
// group t0 / kTile of 16) f32 accumulators through path.Block(group, b, acc)
// for every block b (of Path::kBlock elements) in order, stored.
template <typename Path, typename Acts>
MOEGRAPH_AMX_TARGET void RunSteps(const MatMulArgs& m, const Acts& acts) {
  CheckArgs(m, Path::kType, Path::kBlock);
  const int64_t nb = m.cols / Path::kBlock;
  MG_CHECK(acts.n_act == m.n_act && acts.nb == nb, "the packed activations are another matrix's");
  if (m.row_end <= m.row_begin || m.n_act <= 0) return;
  amx_calls.fetch_add(1, std::memory_order_relaxed);
  thread_local typename Path::Scratch s;
  Path path{m, acts, s};
  ConfigureTiles(Path::kABytes, Path::kBRows);
  const int64_t act_pad = PaddedActs(m.n_act);
  alignas(64) float acc[kStep][kStep];
  for (int64_t r0 = m.row_begin; r0 < m.row_end; r0 += kStep) {
    path.PackRows(r0, std::min<int64_t>(kStep, m.row_end - r0));
    MemoryBarrier();
    for (int64_t t0 = 0; t0 < act_pad; t0 += kStep) {
      std::memset(acc, 0, sizeof(acc));
      for (int64_t b = 0; b < nb; ++b) path.Block(t0 / kTile, b, acc);
      StoreStep(m, r0, t0, acc);
    }
  }
  _tile_release();
}

// tmm0-3, the four C tiles, zeroed.
MOEGRAPH_AMX_TARGET inline void ZeroSums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The A tiles tmm4-5 from a0 and a1 (a_stride bytes a row), the B tiles
// tmm6-7 from b0 and b1 (64 bytes a row).
MOEGRAPH_AMX_TARGET inline void LoadOperands(const uint8_t* a0, const uint8_t* a1, size_t a_stride,
                                             const uint8_t* b0, const uint8_t* b1) {
  _tile_loadd(4, a0, a_stride);
  _tile_loadd(5, a1, a_stride);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
}

// The C tiles tmm0-3 into c[0..3] (GCC's tilestored clobbers memory).
MOEGRAPH_AMX_TARGET inline void StoreSums(int32_t (*c)[kTile][kTile]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

// The kernels that pack first: m.act packed by pack into this thread's
// Acts, then kernel.
template <typename Acts>
void PackAndRun(const MatMulArgs& m, GgmlType type, int64_t block,
                void (*pack)(const uint8_t*, size_t, int64_t, int64_t, Acts*),
                void (*kernel)(const MatMulArgs&, const Acts&)) {
  CheckArgs(m, type, block);
  thread_local Acts acts;
  pack(m.act, m.act_row_bytes, m.n_act, m.cols, &acts);
  kernel(m, acts);
}

// Two int16 in an int32, a low, as vpmaddwd reads them.
uint32_t Int16Pair(int32_t a, int32_t b) {
  return static_cast<uint16_t>(a) | static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16;
}

}  // namespace

void PackAmxQ8_0Acts(const uint8_t* act, size_t act_row_bytes, int64_t n_act, int64_t cols,
                     AmxQ8_0Acts* out) {
  MG_CHECK(cols % QK8_0 == 0, "cols must be a multiple of the q8_0 block");
  const int64_t nb = cols / QK8_0;
  const int64_t act_pad = PaddedActs(n_act);
  out->n_act = n_act;
  out->nb = nb;
  out->vnni.resize(static_cast<size_t>(act_pad * nb) * QK8_0);
  out->scale.resize(static_cast<size_t>(act_pad * nb));
  for (int64_t t = 0; t < act_pad; ++t) {
    const int64_t group = t / kTile, n = t % kTile;
    const auto* a = t < n_act ? Row<block_q8_0>(act, act_row_bytes, t) : nullptr;
    PackVnniColumn(a == nullptr ? nullptr : a[0].qs, sizeof(block_q8_0), nb, n,
                   out->vnni.data() + group * nb * kBTileBytes);
    for (int64_t b = 0; b < nb; ++b) {
      out->scale[(group * nb + b) * kTile + n] = a == nullptr ? 0.0f : f16_to_f32(a[b].d);
    }
  }
}

void PackAmxQ8_KActs(const uint8_t* act, size_t act_row_bytes, int64_t n_act, int64_t cols,
                     AmxQ8_KActs* out) {
  MG_CHECK(cols % QK_K == 0, "cols must be a multiple of the q8_K super-block");
  const int64_t nb = cols / QK_K, n_sub = nb * kSubBlocks;
  const int64_t act_pad = PaddedActs(n_act);
  out->n_act = n_act;
  out->nb = nb;
  out->vnni.resize(static_cast<size_t>(act_pad * cols));
  out->scale.resize(static_cast<size_t>(act_pad * nb));
  out->bsums.resize(static_cast<size_t>(act_pad * nb) * kSubBlocks / 2);
  for (int64_t t = 0; t < act_pad; ++t) {
    const int64_t group = t / kTile, n = t % kTile;
    const auto* a = t < n_act ? Row<block_q8_K>(act, act_row_bytes, t) : nullptr;
    for (int64_t b = 0; b < nb; ++b) {
      PackVnniColumn(a == nullptr ? nullptr : a[b].qs, 32, kSubBlocks, n,
                     out->vnni.data() + (group * n_sub + b * kSubBlocks) * kBTileBytes);
      out->scale[(group * nb + b) * kTile + n] = a == nullptr ? 0.0f : a[b].d;
      for (int k = 0; k < kSubBlocks / 2; ++k) {
        out->bsums[((group * nb + b) * kSubBlocks / 2 + k) * kTile + n] =
            a == nullptr ? 0 : Int16Pair(SubBlockSum(a[b], 2 * k), SubBlockSum(a[b], 2 * k + 1));
      }
    }
  }
}

namespace {

// Rows r0..r0+n_rows of the weights into s.w_quants and s.w_scale, padded
// with zero rows to kStep: each block's A tiles become 1 KiB in a row, read
// in order, where the rows themselves would be 32 loads a w_row_bytes apart,
// half of them split across cache lines.
void PackWeights(const MatMulArgs& m, int64_t r0, int64_t n_rows, int64_t nb, Q8_0Scratch& s) {
  s.w_quants.resize(static_cast<size_t>(nb) * kStep * QK8_0);
  s.w_scale.resize(static_cast<size_t>(nb) * kStep);
  for (int64_t i = 0; i < kStep; ++i) {
    const auto* w = i < n_rows ? Row<block_q8_0>(m.w, m.w_row_bytes, r0 + i) : nullptr;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* quants = s.w_quants.data() + (b * kStep + i) * QK8_0;
      if (w == nullptr) {
        std::memset(quants, 0, QK8_0);
        s.w_scale[b * kStep + i] = 0.0f;
        continue;
      }
      std::memcpy(quants, w[b].qs, QK8_0);
      s.w_scale[b * kStep + i] = f16_to_f32(w[b].d);
    }
  }
}

// One block's int32 sums of 32 weight rows (packed, 32 bytes apart) x 32
// activations (two VNNI B tiles, b_next apart) into c[2 * row half + act half].
MOEGRAPH_AMX_TARGET inline void IntSums(const uint8_t* a_tile, const uint8_t* b_tile,
                                        size_t b_next, int32_t (*c)[kTile][kTile]) {
  LoadOperands(a_tile, a_tile + kTile * QK8_0, QK8_0, b_tile, b_tile + b_next);
  ZeroSums();
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(1, 4, 7);
  _tile_dpbssd(2, 5, 6);
  _tile_dpbssd(3, 5, 7);
  StoreSums(c);
}

// One step's 32x32 f32 accumulators += one block's four int32 tiles (c[tile]
// [row][act], tile = 2 * row half + act half) times the scale products.
MOEGRAPH_AMX_TARGET inline void FoldBlock(const int32_t (*c)[kTile][kTile], const float* w_scale,
                                          const float* act_scale0, const float* act_scale1,
                                          float (*acc)[kStep]) {
  const __m512 ad[2] = {_mm512_loadu_ps(act_scale0), _mm512_loadu_ps(act_scale1)};
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < kTile; ++i) {
      const int row = half * kTile + i;
      const __m512 wd = _mm512_set1_ps(w_scale[row]);
      for (int g = 0; g < 2; ++g) {
        const __m512 scale = _mm512_mul_ps(wd, ad[g]);
        // maskz: GCC 12 warns on _mm512_cvtepi32_ps's undefined pass-through.
        const __m512 isum = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_load_si512(c[2 * half + g][i]));
        float* a = acc[row] + g * kTile;
        _mm512_store_ps(a, _mm512_fmadd_ps(scale, isum, _mm512_load_ps(a)));
      }
    }
  }
}

// RunSteps' path for q8_0: a 32-element block a step; A 32 int8 a row, B a
// block of 16 activations.
struct Q8_0Path {
  static constexpr GgmlType kType = GgmlType::kQ8_0;
  static constexpr int kBlock = QK8_0, kABytes = QK8_0, kBRows = QK8_0 / 4;
  using Scratch = Q8_0Scratch;
  const MatMulArgs& m;
  const AmxQ8_0Acts& acts;
  Scratch& s;

  void PackRows(int64_t r0, int64_t n_rows) { PackWeights(m, r0, n_rows, acts.nb, s); }
  MOEGRAPH_AMX_TARGET void Block(int64_t group, int64_t b, float (*acc)[kStep]) {
    const int64_t nb = acts.nb;
    alignas(64) int32_t c[4][kTile][kTile];
    IntSums(s.w_quants.data() + b * kStep * QK8_0,
            acts.vnni.data() + (group * nb + b) * kBTileBytes, nb * kBTileBytes, c);
    const float* act_scale = acts.scale.data() + (group * nb + b) * kTile;
    FoldBlock(c, s.w_scale.data() + b * kStep, act_scale, act_scale + nb * kTile, acc);
  }
};

}  // namespace

MOEGRAPH_AMX_TARGET void AmxMatMulQ8_0(const MatMulArgs& m, const AmxQ8_0Acts& acts) {
  RunSteps<Q8_0Path>(m, acts);
}

void AmxMatMulQ8_0(const MatMulArgs& m) {
  PackAndRun(m, GgmlType::kQ8_0, QK8_0, &PackAmxQ8_0Acts, &AmxMatMulQ8_0);
}

namespace {

// One q4_K super-block's 256 quants (qs) times its 8 scales (sc), as the low
// and high bytes of the products, into the A tiles' row at quants (chunk c's
// lo at c * 2 * kChunkTile, its hi a kChunkTile further).
MOEGRAPH_AMX_TARGET void ExpandQ4_K(const uint8_t* qs, const uint8_t* sc, uint8_t* quants) {
  // 32 bytes of qs hold chunk c's elements 0..31 in their low nibbles and
  // 32..63 in their high: broadcast to both halves, shift the upper by 4.
  // maskz and mask forms: GCC 12 warns on the others' undefined pass-through.
  constexpr __mmask32 kUpperWords = 0xffff0000u;
  const __m512i nibble_shift = _mm512_maskz_set1_epi16(kUpperWords, 4);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  constexpr __mmask64 kOddBytes = 0xaaaaaaaaaaaaaaaaull;
  for (int c = 0; c < kChunks; ++c) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m512i q = _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_maskz_broadcast_i64x4(0xff, packed), nibble_shift), low_nibbles);
    // vpmaddubsw with the scale in one byte of each pair and 0 in the other
    // gives the even and the odd elements' products q4 * sc (<= 945) as int16.
    const __m512i even_scale =
        _mm512_mask_set1_epi16(_mm512_set1_epi16(sc[2 * c]), kUpperWords, sc[2 * c + 1]);
    const __m512i even = _mm512_maddubs_epi16(q, even_scale);
    const __m512i odd = _mm512_maddubs_epi16(q, _mm512_slli_epi16(even_scale, 8));
    const __m512i lo = _mm512_mask_blend_epi8(kOddBytes, even, _mm512_slli_epi16(odd, 8));
    const __m512i hi = _mm512_mask_blend_epi8(kOddBytes, _mm512_srli_epi16(even, 8), odd);
    _mm512_storeu_si512(quants + 2 * c * kChunkTile, lo);
    _mm512_storeu_si512(quants + (2 * c + 1) * kChunkTile, hi);
  }
}

// Rows r0..r0+n_rows of q4_K weights into s (see Q4_KScratch), padded with
// zero rows to kStep.
MOEGRAPH_AMX_TARGET void PackQ4_KWeights(const MatMulArgs& m, int64_t r0, int64_t n_rows,
                                         int64_t nb, Q4_KScratch& s) {
  s.w_quants.resize(static_cast<size_t>(nb) * kStep * QK_K * 2);
  s.w_mins.resize(static_cast<size_t>(nb) * kStep * kSubBlocks / 2);
  s.w_d.resize(static_cast<size_t>(nb) * kStep);
  s.w_dmin.resize(static_cast<size_t>(nb) * kStep);
  for (int64_t i = 0; i < kStep; ++i) {
    const auto* w = i < n_rows ? Row<block_q4_K>(m.w, m.w_row_bytes, r0 + i) : nullptr;
    const int64_t half = i / kTile, row = i % kTile;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* quants = s.w_quants.data() + (b * 2 + half) * 2 * kChunks * kChunkTile + row * 64;
      uint8_t sc[kSubBlocks] = {}, mn[kSubBlocks] = {};
      if (w == nullptr) {
        for (int k = 0; k < 2 * kChunks; ++k) std::memset(quants + k * kChunkTile, 0, 64);
      } else {
        for (int j = 0; j < kSubBlocks; ++j) get_scale_min_k4(j, w[b].scales, &sc[j], &mn[j]);
        ExpandQ4_K(w[b].qs, sc, quants);
      }
      for (int k = 0; k < kSubBlocks / 2; ++k) {
        s.w_mins[(b * kStep + i) * kSubBlocks / 2 + k] = Int16Pair(mn[2 * k], mn[2 * k + 1]);
      }
      s.w_d[b * kStep + i] = w == nullptr ? 0.0f : f16_to_f32(w[b].d);
      s.w_dmin[b * kStep + i] = w == nullptr ? 0.0f : f16_to_f32(w[b].dmin);
    }
  }
}

// One super-block's int32 sums of 16 weight rows (a_tiles: their lo and hi
// A tiles, chunk by chunk) x 32 activations (B tiles for two 32-element
// blocks at b_tiles, the second 16 activations b_next further) into c[lo
// act half 0, lo act half 1, hi act half 0, hi act half 1].
MOEGRAPH_AMX_TARGET inline void Q4_KIntSums(const uint8_t* a_tiles, const uint8_t* b_tiles,
                                            size_t b_next, int32_t (*c)[kTile][kTile]) {
  ZeroSums();
  for (int k = 0; k < kChunks; ++k) {
    const uint8_t* b_tile = b_tiles + 2 * k * kBTileBytes;
    LoadOperands(a_tiles + 2 * k * kChunkTile, a_tiles + (2 * k + 1) * kChunkTile, 64, b_tile,
                 b_tile + b_next);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  StoreSums(c);
}

// One super-block into a step's 32x32 f32 accumulators, in the contract's
// order: c[row half][tile][row][act] from Q4_KIntSums; w_* the row group's
// (Q4_KScratch) and act_* the two activation groups' (AmxQ8_KActs) values
// for this super-block.
MOEGRAPH_AMX_TARGET inline void FoldSuperBlock(const int32_t (*c)[4][kTile][kTile],
                                               const float* w_d, const float* w_dmin,
                                               const uint32_t* w_mins, const float* act_d[2],
                                               const uint32_t* act_bsums[2], float (*acc)[kStep]) {
  const __m512 ad[2] = {_mm512_loadu_ps(act_d[0]), _mm512_loadu_ps(act_d[1])};
  __m512i bsums[2][kSubBlocks / 2];
  for (int g = 0; g < 2; ++g) {
    for (int k = 0; k < kSubBlocks / 2; ++k) {
      bsums[g][k] = _mm512_loadu_si512(act_bsums[g] + k * kTile);
    }
  }
  for (int row = 0; row < kStep; ++row) {
    const int half = row / kTile, i = row % kTile;
    const __m512 wd = _mm512_set1_ps(w_d[row]), wdmin = _mm512_set1_ps(w_dmin[row]);
    __m512i mins[kSubBlocks / 2];
    for (int k = 0; k < kSubBlocks / 2; ++k) mins[k] = _mm512_set1_epi32(w_mins[row * 4 + k]);
    for (int g = 0; g < 2; ++g) {
      const __m512i hi = _mm512_maskz_slli_epi32(0xffff, _mm512_load_si512(c[half][2 + g][i]), 8);
      const __m512i isum = _mm512_add_epi32(hi, _mm512_load_si512(c[half][g][i]));
      __m512i msum = _mm512_madd_epi16(mins[0], bsums[g][0]);
      for (int k = 1; k < kSubBlocks / 2; ++k) msum = _mm512_dpwssd_epi32(msum, mins[k], bsums[g][k]);
      float* a = acc[row] + g * kTile;
      // maskz: GCC 12 warns on _mm512_cvtepi32_ps's undefined pass-through.
      __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(wd, ad[g]), _mm512_maskz_cvtepi32_ps(0xffff, isum),
                                 _mm512_load_ps(a));
      // fnmadd: -(x * y) + v, the contract's fmaf(-x, y, v) exactly.
      v = _mm512_fnmadd_ps(_mm512_mul_ps(wdmin, ad[g]), _mm512_maskz_cvtepi32_ps(0xffff, msum), v);
      _mm512_store_ps(a, v);
    }
  }
}

// RunSteps' path for q4_K: a 256-element super-block a step; A 64 bytes a
// row, B two blocks of 16 activations.
struct Q4_KPath {
  static constexpr GgmlType kType = GgmlType::kQ4_K;
  static constexpr int kBlock = QK_K, kABytes = 64, kBRows = kTile;
  using Scratch = Q4_KScratch;
  const MatMulArgs& m;
  const AmxQ8_KActs& acts;
  Scratch& s;

  MOEGRAPH_AMX_TARGET void PackRows(int64_t r0, int64_t n_rows) {
    PackQ4_KWeights(m, r0, n_rows, acts.nb, s);
  }
  MOEGRAPH_AMX_TARGET void Block(int64_t group, int64_t b, float (*acc)[kStep]) {
    const int64_t nb = acts.nb, n_sub = nb * kSubBlocks;
    alignas(64) int32_t c[2][4][kTile][kTile];  // [row half][tile][row][act]
    const uint8_t* b_tiles = acts.vnni.data() + (group * n_sub + b * kSubBlocks) * kBTileBytes;
    for (int half = 0; half < 2; ++half) {
      Q4_KIntSums(s.w_quants.data() + (b * 2 + half) * 2 * kChunks * kChunkTile, b_tiles,
                  n_sub * kBTileBytes, c[half]);
    }
    const int64_t at = (group * nb + b) * kTile;
    const float* act_d[2] = {acts.scale.data() + at, acts.scale.data() + at + nb * kTile};
    const uint32_t* act_bsums[2] = {acts.bsums.data() + at * kSubBlocks / 2,
                                    acts.bsums.data() + (at + nb * kTile) * kSubBlocks / 2};
    FoldSuperBlock(c, s.w_d.data() + b * kStep, s.w_dmin.data() + b * kStep,
                   s.w_mins.data() + b * kStep * kSubBlocks / 2, act_d, act_bsums, acc);
  }
};

}  // namespace

MOEGRAPH_AMX_TARGET void AmxMatMulQ4_K(const MatMulArgs& m, const AmxQ8_KActs& acts) {
  RunSteps<Q4_KPath>(m, acts);
}

void AmxMatMulQ4_K(const MatMulArgs& m) {
  PackAndRun(m, GgmlType::kQ4_K, QK_K, &PackAmxQ8_KActs, &AmxMatMulQ4_K);
}

uint64_t AmxMatMulCalls() { return amx_calls.load(std::memory_order_relaxed); }

#else

bool AmxInt8Available() { return false; }

void PackAmxQ8_0Acts(const uint8_t*, size_t, int64_t, int64_t, AmxQ8_0Acts*) {
  MG_CHECK(false, "AMX needs x86-64 Linux");
}
void AmxMatMulQ8_0(const MatMulArgs&, const AmxQ8_0Acts&) {
  MG_CHECK(false, "AMX needs x86-64 Linux");
}
void AmxMatMulQ8_0(const MatMulArgs&) { MG_CHECK(false, "AMX needs x86-64 Linux"); }
void PackAmxQ8_KActs(const uint8_t*, size_t, int64_t, int64_t, AmxQ8_KActs*) {
  MG_CHECK(false, "AMX needs x86-64 Linux");
}
void AmxMatMulQ4_K(const MatMulArgs&, const AmxQ8_KActs&) {
  MG_CHECK(false, "AMX needs x86-64 Linux");
}
void AmxMatMulQ4_K(const MatMulArgs&) { MG_CHECK(false, "AMX needs x86-64 Linux"); }
uint64_t AmxMatMulCalls() { return 0; }

#endif

}  // namespace moegraph
